#!/usr/bin/env bash
# Install SGLang into a Python environment on a CPU-only x86 machine, at the versions of constraints/cpu.txt.
#
#   scripts/install_sglang_cpu.sh [VENV_PYTHON]      (default: python3 on PATH)
#
# Why not `pip install sglang==0.5.23`: its metadata pins torch==2.14.1 and ~20 CUDA-only packages
# (flashinfer, sglang-kernel, deep-gemm, cutlass, ...), 208 wheels / 4.3 GB. On CPU none of them is used, so:
#   1. torch 2.13.0 (CPU build, constraints/cpu.txt) is kept; another torch in the environment stops the install.
#   2. SGLang's requirements minus the CUDA-only ones (constraints/sglang-cpu.in) are installed at the versions of
#      constraints/cpu.txt, with every package already in the environment pinned to its current version (a
#      constraints file made from `pip freeze`): nothing installed is upgraded or downgraded; where a requirement
#      cannot be met without that, the installer stops and says which.
#   3. sglang itself, at the version of constraints/gpu-sglang.txt, without its dependencies.
#   4. torchvision: SGLang imports it (srt/configs). PyPI's torchvision 0.28.0 (the release built for
#      torch 2.13) is linked against CUDA torch, so its C extension does not load under CPU torch; its
#      Python code works, except two unguarded `torch.library.register_fake("torchvision::nms"/"qnms")`
#      calls that then fail with "operator torchvision::nms does not exist" and break `import torchvision`.
#      This script wraps those two registrations in the `extension._has_ops()` check that torchvision
#      already uses for its other fake kernels (the installed torchvision/_meta_registrations.py is replaced by
#      the guarded copy once, and verified by importing torchvision).
#      torchvision ops (nms, roi_align, ...) stay unavailable, which no text model needs.
# The installer is uv at the version constraints/cpu.txt pins (installed into the environment by its pip if absent).
#
# The server additionally needs, at run time (set by dapo_megatron.rollout.sglang.server, not here):
# SGLANG_USE_CPU_ENGINE=1 and the `sgl_kernel` stand-in of dapo_megatron/cpu/sglang on PYTHONPATH.
#
# Idempotent: when sglang, its CPU requirements and an importable torchvision are already present it
# returns in about a second without calling an installer.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${1:-python3}"
CPU_LOCK="$ROOT/constraints/cpu.txt"
pinned() { sed -n "s/^$1==//p" "$2"; }
SGLANG_VERSION="$(pinned sglang "$ROOT/constraints/gpu-sglang.txt")"
TORCH_VERSION="$(pinned torch "$CPU_LOCK")"
TORCH_VERSION="${TORCH_VERSION%+*}"  # 2.13.0+cpu -> 2.13.0
mapfile -t SGLANG_CPU_REQUIREMENTS < <(grep -vE '^\s*(#|$)' "$ROOT/constraints/sglang-cpu.in")

log() { echo "[install_sglang_cpu] $*" >&2; }

if ! command -v "$PYTHON" >/dev/null 2>&1 && [ ! -x "$PYTHON" ]; then
  log "no python executable at '$PYTHON'"
  exit 2
fi

py_minor="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
if [ "$py_minor" != "3.11" ]; then
  log "SGLang ${SGLANG_VERSION} is installed from its cp311 wheel; '$PYTHON' is Python ${py_minor}"
  exit 2
fi

# ---- fast path: already installed ---------------------------------------------------------------------
already_installed() {
  "$PYTHON" - "$SGLANG_VERSION" "${SGLANG_CPU_REQUIREMENTS[@]}" <<'PY' 2>/dev/null
import importlib.metadata as metadata
import re
import sys

wanted_sglang, requirements = sys.argv[1], sys.argv[2:]
if metadata.version("sglang") != wanted_sglang:
    sys.exit(1)
for requirement in requirements:
    metadata.version(re.split(r"[<>=!~ ]", requirement, maxsplit=1)[0])  # raises if missing
# torchvision's nms guard (step 4) is in place; checked on the file, since importing torch takes seconds.
import importlib.util  # noqa: E402
import pathlib  # noqa: E402

torchvision_dir = pathlib.Path(importlib.util.find_spec("torchvision").submodule_search_locations[0])
if "_has_ops() else (lambda fn: fn)" not in (torchvision_dir / "_meta_registrations.py").read_text():
    sys.exit(1)
PY
}

if already_installed; then
  log "sglang ${SGLANG_VERSION} already installed for $PYTHON; nothing to do"
  exit 0
fi

start_seconds=$SECONDS
site_packages="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
size_before_kb="$(du -sk "$site_packages" | cut -f1)"

# ---- the installer: uv at the version the lock pins ------------------------------------------------------
uv_pin="$(grep -E '^uv==' "$CPU_LOCK")"
UV="$(dirname "$PYTHON")/uv"
if [ "$("$UV" --version 2>/dev/null | cut -d' ' -f2)" != "${uv_pin#uv==}" ]; then
  "$PYTHON" -m pip install -qq "$uv_pin"
  UV="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/uv"
fi
source "$ROOT/scripts/uv_args.sh"
# --compile-bytecode as in setup_env.sh: .pyc files now, not a compile of SGLang's sources at every server start.
uv_install() { "$UV" pip install --quiet --compile-bytecode --python "$PYTHON" "${UV_FIND_LINKS_ARGS[@]}" "$@"; }

# ---- 1. torch 2.13.0 (CPU build) ------------------------------------------------------------------------
torch_version="$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
if [ -z "$torch_version" ]; then
  log "no torch in this environment: installing torch at the version of constraints/cpu.txt"
  uv_install --constraint "$CPU_LOCK" torch
  torch_version="$("$PYTHON" -c 'import torch; print(torch.__version__)')"
fi
case "$torch_version" in
  "${TORCH_VERSION}"|"${TORCH_VERSION}+"*) ;;
  *) log "this install keeps torch ${TORCH_VERSION}; the environment has torch ${torch_version}"; exit 2 ;;
esac
if [ "$("$PYTHON" -c 'import torch; print(torch.version.cuda is None)')" != "True" ]; then
  log "note: torch ${torch_version} is a CUDA build; this script is meant for CPU machines"
fi

# ---- 2. SGLang's CPU requirements, without touching what is installed ----------------------------------
installed="$(mktemp)"
trap 'rm -f "$installed"' EXIT
# Everything installed stays at its version; torch is pinned even where `pip freeze` spells it oddly.
"$PYTHON" -m pip freeze --exclude-editable 2>/dev/null | grep -E '^[A-Za-z0-9_.-]+==' >"$installed" || true
echo "torch==${torch_version}" >>"$installed"
log "installing SGLang's CPU requirements at the versions of constraints/cpu.txt" \
  "(and $(wc -l <"$installed") installed packages kept at theirs)"
uv_install --constraint "$CPU_LOCK" --constraint "$installed" "${SGLANG_CPU_REQUIREMENTS[@]}"

# ---- 3. SGLang itself ----------------------------------------------------------------------------------
log "installing sglang==${SGLANG_VERSION} without its CUDA dependencies"
uv_install --no-deps "sglang==${SGLANG_VERSION}"

# ---- 4. guard torchvision's two unguarded fake-kernel registrations ----------------------------------------
"$PYTHON" - <<'PY'
import importlib.util
import pathlib
import re

spec = importlib.util.find_spec("torchvision")
path = pathlib.Path(spec.submodule_search_locations[0]) / "_meta_registrations.py"
source = path.read_text()
guarded = source
for op in ("nms", "qnms"):
    # `@torch.library.register_fake("torchvision::nms")` -> the same decorator only when the ops are loaded.
    guarded = re.sub(
        rf'^@torch\.library\.register_fake\("torchvision::{op}"\)$',
        f'@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() '
        f"else (lambda fn: fn))",
        guarded,
        flags=re.MULTILINE,
    )
if guarded != source:
    # A new file, not a write into the old one: an installer that links wheels from its cache (uv) would
    # otherwise carry the edit into the cached copy.
    staged = path.with_suffix(".py.guarded")
    staged.write_text(guarded)
    staged.replace(path)
    print(f"[install_sglang_cpu] guarded torchvision::nms/qnms fake registrations in {path}")
PY
"$PYTHON" -c "import torchvision" || { log "torchvision still does not import; see the error above"; exit 1; }

if ! already_installed; then
  log "installation finished but the check still fails: run '$PYTHON -c \"import sglang, torchvision\"' to see why"
  exit 1
fi
size_after_kb="$(du -sk "$site_packages" | cut -f1)"
log "done in $((SECONDS - start_seconds)) s; site-packages grew by $(((size_after_kb - size_before_kb) / 1024)) MiB"
