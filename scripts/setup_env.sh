#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install the package into it.
# Sourced by scripts/run_tiny.sh and scripts/test.sh. VENV=/path overrides the location.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON_BIN="${PYTHON_BIN:-python3.11}"
command -v "$PYTHON_BIN" >/dev/null || PYTHON_BIN=python3
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PYTHON_BIN --version)"
  "$PYTHON_BIN" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip >/dev/null
# torch first and pinned: an unpinned torch resolves to a multi-GB CUDA build; 2.13.0 is the CPU build on CPU hosts.
"$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
  || "$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e "$ROOT[${EXTRAS:-dev}]"
export PATH="$VENV/bin:$PATH"
