#!/bin/bash
# Local launcher (one machine): validate the config, then torchrun the trainer.
#   launch/local.sh recipes/qwen3_moe/tiny_cpu.yaml train.steps=5
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
RECIPE=${1:?usage: launch/local.sh RECIPE [key=value ...]}
shift
exec .venv/bin/python -m skyrl_mega.cli train --recipe "$RECIPE" "$@"
