#!/usr/bin/env bash
# Install what the code sandbox of tool-integrated rollouts needs (dapo_megatron/tools/, docs/tools-sandbox.md):
# bubblewrap (`bwrap`), the isolation tool it runs model-written code under, and libseccomp2, whose syscall tables
# tests/unit/test_sandbox_seccomp.py checks the sandbox's own filter against (Debian's apt depends on it already).
# Debian / Ubuntu, as root. util-linux (prlimit, setpriv) is essential there.
#
#   scripts/install_sandbox.sh
#
# Idempotent: returns at once when both are there. Without root it stops with a message saying what to ask an
# administrator for, instead of failing somewhere inside apt.
set -euo pipefail

have_libseccomp() { ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2'; }

if command -v bwrap >/dev/null 2>&1 && have_libseccomp; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "install_sandbox.sh: bwrap or libseccomp2 is missing and this is not root; ask for the Debian packages" \
       "'bubblewrap' and 'libseccomp2'" >&2
  exit 1
fi
echo "[install_sandbox] installing bubblewrap and libseccomp2"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap libseccomp2 >/dev/null
command -v bwrap >/dev/null
have_libseccomp
