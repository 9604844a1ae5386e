#!/usr/bin/env bash
# Install what the code sandbox of tool-integrated rollouts needs (dapo_megatron/tools/, docs/tools-sandbox.md):
# bubblewrap (`bwrap`), the isolation tool it runs model-written code under. Debian / Ubuntu, as root.
#
#   scripts/install_sandbox.sh
#
# Idempotent: returns at once when `bwrap` is on PATH. Without root (and without bwrap) it stops with a message
# saying what to ask an administrator for, instead of failing somewhere inside apt.
set -euo pipefail

if command -v bwrap >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "install_sandbox.sh: bwrap is missing and this is not root; ask for the Debian package 'bubblewrap'" >&2
  exit 1
fi
echo "[install_sandbox] installing bubblewrap"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null
command -v bwrap >/dev/null
