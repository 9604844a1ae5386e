#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): one table of the policy side on one GPU — bf16 vs fp32 log-prob parity, DAPO
# updates, training MFU of 0.5B- and 1.5B-shaped models per layer path (each row names it: Transformer Engine and the
# local spec where TE is importable, the local spec where not), the weight handoff in GB/s next to a device copy, the
# engine-vs-policy log-prob gap, the trainer's side of a colocated turn (optimizer state to host and back, the memory
# freed next to `plan`'s numbers). Made for a lent H200 (<= 8 minutes); `--tiny` runs the same code on CPU in seconds
# (the test-suite does: tests/integration/test_gpu_check.py).
#
#   scripts/gpu_check.sh [--tiny] [--json FILE]
#
# megatron-core is not installed on the H200 machine and it has no network: the check installs it from wheels in
# $DAPO_WHEEL_DIR (default .whl/ in the repository) into a private folder when `import megatron.core` fails. Make the
# wheel once, on a machine with pip and network, in the repository root (.whl/ kept out of git):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl megatron-core==0.16.1
# (its other needs — torch, numpy, packaging — are on that machine; so are this project's: transformers,
# safetensors, pyyaml, tqdm). Environment: PYTHON (default python3), DAPO_WHEEL_DIR, DAPO_SITE_DIR (where the wheel
# is installed, default /tmp/dapo_gpu_check_site).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${DAPO_WHEEL_DIR:-.whl}
SITE=${DAPO_SITE_DIR:-/tmp/dapo_gpu_check_site}

if ! "$PYTHON" -c "import megatron.core" 2>/dev/null; then
    shopt -s nullglob
    wheels=("$WHEELS"/megatron_core-*.whl)
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "gpu_check: megatron-core is not importable and there is no megatron_core-*.whl in $WHEELS" >&2
        echo "gpu_check: make the wheel as this script's header says, or set DAPO_WHEEL_DIR" >&2
        exit 2
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PYTHON" bench/gpu_check.py "$@"
