#!/usr/bin/env bash
# The main job on a fresh CPU machine: set up, then a real DAPO run of examples/tiny_cpu.yaml
# (megatron-core policy on CPU, embedded rollout engine, synthetic integer-answer task).
# Extra arguments are dotted config overrides, e.g. trainer.total_steps=10.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
exec dapo-megatron train examples/tiny_cpu.yaml "$@"
