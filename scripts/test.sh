#!/usr/bin/env bash
# Set up .venv from nothing and run the test-suite.
#
#   scripts/test.sh           everything: the README's install commands resolved (scripts/check_installs.py), unit
#                             tests and integration tests (a real SGLang server on CPU, a real
#                             3-node SLURM cluster in network namespaces, full DAPO runs, resume). Needs root on
#                             Debian (the cluster); a missing SLURM or SGLang fails the run instead of skipping.
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

# Every install command the README documents must resolve against the registry (the GPU ones never run here).
python scripts/check_installs.py
# Integration prerequisites. A failure here fails the run: CI must not silently skip what it is meant to test.
bash scripts/install_sglang_cpu.sh "$VENV/bin/python"
bash scripts/install_sandbox.sh  # bubblewrap, for the code sandbox probes (tests/integration/test_sandbox_probes.py)
# A cluster already up with this layout is reused and left running; one started here is torn down at the end.
if ! bash scripts/slurm_cluster.sh status >/dev/null 2>&1; then
  trap 'bash scripts/slurm_cluster.sh stop >/dev/null 2>&1 || true' EXIT
fi
bash scripts/slurm_cluster.sh start --nodes 3
# Every test marked slurm or sglang must run: a skip among them is reported as a failure (tests/conftest.py).
export DAPO_REQUIRE_INTEGRATION=1
python -m pytest -q -rs "$@"
