#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv: the package (editable) with the exact CPU pins of
# constraints/cpu.txt. Sourced by scripts/run_tiny.sh and scripts/test.sh. VENV=/path overrides the location,
# EXTRAS=a,b the extras (default: dev,wandb,mlflow: the test-suite runs every logger).
#
# The installer is uv, at the version cpu.txt pins, installed by the venv's own pip (no pip upgrade): it resolves
# and links from its cache in parallel where pip unpacks one wheel after another. An environment already installed
# from the same pyproject.toml, constraints/cpu.txt and extras is reused without running an installer (a stamp in
# the venv records them); delete .venv to rebuild it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
EXTRAS="${EXTRAS:-dev,wandb,mlflow}"
PYTHON_BIN="${PYTHON_BIN:-python3.11}"
command -v "$PYTHON_BIN" >/dev/null || PYTHON_BIN=python3
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PYTHON_BIN --version)"
  "$PYTHON_BIN" -m venv "$VENV"
fi
PY="$VENV/bin/python"
LOCK="$ROOT/constraints/cpu.txt"
stamp="$VENV/.dapo-megatron-installed"
wanted="$(cat "$ROOT/pyproject.toml" "$LOCK" | sha256sum | cut -d' ' -f1) extras=$EXTRAS"
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  uv_pin="$(grep -E '^uv==' "$LOCK")"
  if [ "$("$VENV/bin/uv" --version 2>/dev/null | cut -d' ' -f2)" != "${uv_pin#uv==}" ]; then
    "$PY" -m pip install -qq "$uv_pin"  # -qq: errors only, not this machine's pip-index warnings
  fi
  source "$ROOT/scripts/uv_args.sh"
  # torch comes pinned by the lock: unpinned it would resolve to a multi-GB CUDA build; 2.13.0+cpu is the CPU build.
  # --compile-bytecode, as pip does: these machines set PYTHONDONTWRITEBYTECODE=1, so without .pyc files every
  # process (each spawned rank of a test) would compile torch's and megatron's sources again on import.
  echo "[setup] installing dapo-megatron[$EXTRAS] with the pins of constraints/cpu.txt"
  "$VENV/bin/uv" pip install --quiet --compile-bytecode --python "$PY" --constraint "$LOCK" \
    "${UV_FIND_LINKS_ARGS[@]}" --editable "$ROOT[$EXTRAS]"
  echo "$wanted" >"$stamp"
fi
export PATH="$VENV/bin:$PATH"
