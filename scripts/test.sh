#!/usr/bin/env bash
# Set up .venv from nothing and run the test-suite.
#
#   scripts/test.sh           everything: unit tests and integration tests (a real SGLang server on CPU, a real
#                             single-node SLURM cluster when run as root on Debian, full DAPO runs, resume)
#   scripts/test.sh --fast    unit tests only (pytest -m "not slow"), a few minutes
#
# Extra arguments after the first are passed to pytest.
set -euo pipefail
MODE=all
if [ "${1:-}" = "--fast" ]; then MODE=fast; shift; fi
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if [ "$MODE" = fast ]; then
  exec python -m pytest -m "not slow" -q "$@"
fi

# Integration prerequisites. A failure here fails the run: CI must not silently skip what it is meant to test.
bash scripts/install_sglang_cpu.sh "$VENV/bin/python"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  bash scripts/slurm_cluster.sh start
  trap 'bash scripts/slurm_cluster.sh stop >/dev/null 2>&1 || true' EXIT
fi
python -m pytest -q -rs "$@"
