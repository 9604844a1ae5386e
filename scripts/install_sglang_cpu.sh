#!/usr/bin/env bash
# Install SGLang 0.5.23 into a Python environment on a CPU-only x86 machine.
#
#   scripts/install_sglang_cpu.sh [VENV_PYTHON]      (default: python3 on PATH)
#
# Why not `pip install sglang==0.5.23`: its metadata pins torch==2.14.1 and ~20 CUDA-only packages
# (flashinfer, sglang-kernel, deep-gemm, cutlass, ...), 208 wheels / 4.3 GB. On CPU none of them is used, so:
#   1. torch 2.13.0 (CPU build) is kept; if the environment has no torch, torch==2.13.0 is installed
#      (on these machines pip resolves it to the local CPU wheel).
#   2. SGLang's requirements minus the CUDA-only ones are installed with every package already present in
#      the environment pinned to its current version (a constraints file made from `pip freeze`), so this
#      script never upgrades or downgrades transformers, datasets, numpy, ... in an existing environment.
#      If a requirement cannot be met without changing one of them, pip stops and says which.
#   3. `pip install --no-deps sglang==0.5.23`.
#   4. torchvision: SGLang imports it (srt/configs). PyPI's torchvision 0.28.0 (the release built for
#      torch 2.13) is linked against CUDA torch, so its C extension does not load under CPU torch; its
#      Python code works, except two unguarded `torch.library.register_fake("torchvision::nms"/"qnms")`
#      calls that then fail with "operator torchvision::nms does not exist" and break `import torchvision`.
#      This script wraps those two registrations in the `extension._has_ops()` check that torchvision
#      already uses for its other fake kernels (an in-place edit of the installed
#      torchvision/_meta_registrations.py, applied once and verified by importing torchvision).
#      torchvision ops (nms, roi_align, ...) stay unavailable, which no text model needs.
#
# The server additionally needs, at run time (set by dapo_megatron.rollout.sglang_server, not here):
# SGLANG_USE_CPU_ENGINE=1 and the `sgl_kernel` stand-in of dapo_megatron/cpu/sglang on PYTHONPATH.
#
# Idempotent: when sglang 0.5.23, its CPU requirements and an importable torchvision are already present it
# returns in about a second without calling pip.
set -euo pipefail

PYTHON="${1:-python3}"
SGLANG_VERSION="0.5.23"
TORCH_VERSION="2.13.0"
TORCHVISION_VERSION="0.28.0"  # the torchvision release built for torch 2.13

# SGLang 0.5.23's requirements without the CUDA-only ones. Versions are SGLang's own pins where it pins
# a package that is new to the environment; transformers, tokenizers, python-dateutil, sentencepiece,
# soundfile and timm are left unpinned so the environment's versions are kept (SGLang 0.5.23 runs with
# transformers 5.24 and python-dateutil 4 here).
SGLANG_CPU_REQUIREMENTS=(
  aiohttp "anthropic>=0.20.0" blobfile==3.0.0 build compressed-tensors==0.18.0 datasets distro easydict einops
  fastapi gguf interegular IPython "llguidance>=1.7.6,<2.0.0" modelscope msgspec ninja
  numpy nvidia-ml-py openai==2.8.0 openai-harmony==0.0.4 orjson outlines==0.1.11 packaging partial_json_parser
  pillow "prometheus-client>=0.20.0" psutil py-spy pybase64 pydantic python-dateutil python-multipart
  "pyzmq>=25.1.2" regex requests scipy sentencepiece setproctitle "smg-grpc-servicer>=0.9.0" soundfile timm
  tiktoken tokenizers tqdm transformers "uvicorn>=0.51" uvloop watchfiles xgrammar==0.2.7 xxhash zstandard
  "torchvision==${TORCHVISION_VERSION}"
)

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

# ---- 1. torch 2.13.0 (CPU build) ------------------------------------------------------------------------
torch_version="$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
if [ -z "$torch_version" ]; then
  log "no torch in this environment: installing torch==${TORCH_VERSION}"
  "$PYTHON" -m pip install --quiet "torch==${TORCH_VERSION}"
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
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
# Everything installed stays at its version; torch is pinned even where `pip freeze` spells it oddly.
"$PYTHON" -m pip freeze --exclude-editable 2>/dev/null | grep -E '^[A-Za-z0-9_.-]+==' >"$constraints" || true
echo "torch==${torch_version}" >>"$constraints"
log "installing SGLang's CPU requirements (installed packages pinned by $(wc -l <"$constraints") constraints)"
"$PYTHON" -m pip install --quiet --constraint "$constraints" "${SGLANG_CPU_REQUIREMENTS[@]}"

# ---- 3. SGLang itself ----------------------------------------------------------------------------------
log "installing sglang==${SGLANG_VERSION} without its CUDA dependencies"
"$PYTHON" -m pip install --quiet --no-deps "sglang==${SGLANG_VERSION}"

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
    path.write_text(guarded)
    print(f"[install_sglang_cpu] guarded torchvision::nms/qnms fake registrations in {path}")
PY
"$PYTHON" -c "import torchvision" || { log "torchvision still does not import; see the error above"; exit 1; }

if ! already_installed; then
  log "installation finished but the check still fails: run '$PYTHON -c \"import sglang, torchvision\"' to see why"
  exit 1
fi
size_after_kb="$(du -sk "$site_packages" | cut -f1)"
log "done in $((SECONDS - start_seconds)) s; site-packages grew by $(((size_after_kb - size_before_kb) / 1024)) MiB"
