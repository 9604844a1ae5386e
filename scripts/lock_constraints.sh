#!/usr/bin/env bash
# Regenerate the exact pins in constraints/ from pyproject.toml's ranges (run after changing a range or a pin here).
#
#   scripts/lock_constraints.sh        needs uv (in .venv: `pip install uv`) and the package registry
#
# constraints/gpu-trainer.txt  the GPU trainer environment: Linux x86_64, Python 3.11, torch 2.14.1 (CUDA 13),
#                              megatron-core, Transformer Engine, every extra.
# constraints/gpu-sglang.txt   the GPU SGLang environment: SGLang 0.5.23 with its own pins (transformers 5.19.0,
#                              tokenizers 0.23.2, torch 2.14.1). Both GPU files must pin one torch and one NCCL
#                              (nvidia-nccl-cu13): scripts/check_installs.py checks it.
# constraints/cpu.txt          the CPU environment scripts/setup_env.sh builds and CI tests, the SGLang CPU server
#                              included (constraints/sglang-cpu.in): torch 2.13.0, CPU build (torch 2.14.1 exists on
#                              PyPI only as a CUDA build) and torchvision 0.28.0 built for it; every other package at
#                              gpu-trainer.txt's version, else at gpu-sglang.txt's, where the two environments have it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
UV="${UV:-uv}"
GPU_TORCH="torch==2.14.1"  # the release SGLang 0.5.23 pins
CPU_TORCH="torch==2.13.0"
SGLANG="sglang==0.5.23"
source scripts/uv_args.sh

common=(--python-version 3.11 --config-file constraints/uv-metadata.toml --no-header --no-annotate --quiet)
gpu=(--python-platform x86_64-manylinux_2_34)  # SGLang's wheels need glibc 2.34
echo "$GPU_TORCH" | "$UV" pip compile "${common[@]}" "${gpu[@]}" pyproject.toml - --extra gpu --extra dev --extra wandb --extra mlflow \
  -o constraints/gpu-trainer.txt
printf '%s\n' "$GPU_TORCH" "$SGLANG" | "$UV" pip compile "${common[@]}" "${gpu[@]}" - -o constraints/gpu-sglang.txt

# The CPU environment follows the GPU ones wherever a package is in them, except the torch family (torch,
# torchvision, ...): first the trainer's versions, then the server's for packages the trainer does not have.
from_trainer="$(mktemp)" from_server="$(mktemp)"
trap 'rm -f "$from_trainer" "$from_server"' EXIT
grep -vE '^torch' constraints/gpu-trainer.txt >"$from_trainer"
awk -F'==' 'NR == FNR { trainer[$1]; next } /==/ && !($1 in trainer) && $1 !~ /^torch/' \
  constraints/gpu-trainer.txt constraints/gpu-sglang.txt >"$from_server"
echo "$CPU_TORCH" | "$UV" pip compile "${common[@]}" --python-platform x86_64-manylinux_2_28 \
  "${UV_FIND_LINKS_ARGS[@]}" pyproject.toml constraints/sglang-cpu.in - --extra dev --extra wandb --extra mlflow \
  -c "$from_trainer" -c "$from_server" -o constraints/cpu.txt

for lock in constraints/gpu-trainer.txt constraints/gpu-sglang.txt constraints/cpu.txt; do
  { echo "# Written by scripts/lock_constraints.sh from pyproject.toml: do not edit by hand."
    cat "$lock"; } >"$lock.tmp"
  mv "$lock.tmp" "$lock"
  echo "$lock: $(grep -c '==' "$lock") pins"
done
