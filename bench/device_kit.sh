#!/usr/bin/env bash
# Builds, on this machine (pip access, no GPU), everything the lent H200 needs that its image lacks,
# into git-ignored folders that the device tool carries (read bench/h200_hybrids.sh for their use):
#   .pw/      megatron-core 0.19.2 (cp312), mbridge, hydra-core, omegaconf, antlr4 (sdist),
#             fla-core + flash-linear-attention (Triton), causal-conv1d (sdist, optional build there),
#             kern/mamba_ssm (mamba-ssm's source tree: its Triton kernels, no CUDA build)
#   .pr/      this project's wheel
#   .device/  tiny checkpoints (make-tiny) and their CPU stand-in logits
#   .whl/     the vLLM 0.26.0 kit in six 60 MiB parts (../shared/gpu-vllm/make_parts.sh)
#   .te/      transformer-engine 2.20.2 for cu13: the core wheel in five 60 MiB parts (pNN), and in
#             small/ its torch extension's sdist plus the runtime deps the image lacks (bench/h200_te.sh)
# Usage: bench/device_kit.sh [pw|pr|device|whl|te ...]   (default: all but te; each step skips what exists)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$PWD/.venv/bin/python}
for d in /.pw/ /.pr/ /.whl/ /.device/ /.te/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
P312="--python-version 3.12 --implementation cp --only-binary=:all: --platform any"
for t in 2_39 2_35 2_34 2_31 2_28 2_27 2_24 2_17; do P312="$P312 --platform manylinux_${t}_x86_64"; done

sdist() {  # NAME VERSION DIR: the source archive as published (pip download would run its setup.py)
  local norm; norm=$(echo "$1" | tr - _)
  local url; url=$(curl -fsSL "https://pypi.org/simple/$1/" | grep -o "https://[^\"#]*/${norm}-$2\.tar\.gz" | head -1)
  [ -n "$url" ] && curl -fsSL -o "$3/${norm}-$2.tar.gz" "$url"
}

pw() {
  mkdir -p .pw/kern
  local have; have=$(ls .pw)
  for spec in megatron-core==0.19.2 mbridge==0.15.1 hydra-core==1.3.2 omegaconf==2.3.0 fla-core==0.4.1 \
              flash-linear-attention==0.4.1; do
    echo "$have" | grep -qi "^$(echo ${spec%%==*} | tr - _)-${spec##*==}" && continue
    $PY -m pip download -q --no-deps $P312 -d .pw "$spec"
  done
  ls .pw/antlr4-*.tar.gz >/dev/null 2>&1 || $PY -m pip download -q --no-deps --no-binary=:all: -d .pw antlr4-python3-runtime==4.9.3
  ls .pw/causal_conv1d-*.tar.gz >/dev/null 2>&1 || sdist causal-conv1d 1.7.0 .pw
  if [ ! -d .pw/kern/mamba_ssm ]; then
    local t; t=$(mktemp -d)
    sdist mamba-ssm 2.3.2.post1 "$t" && tar xzf "$t"/mamba_ssm-*.tar.gz -C "$t"
    cp -r "$t"/mamba_ssm-*/mamba_ssm .pw/kern/ && rm -rf "$t"
  fi
  ls .pw
}

pr() { rm -rf .pr && $PY -m pip wheel -q --no-deps --no-build-isolation -w .pr . && ls .pr; }

device() {
  mkdir -p .device
  local mk="$PY -m skyrl_mega.cli make-tiny"
  [ -d .device/tiny_qwen3_moe ] || $mk qwen3_moe .device/tiny_qwen3_moe
  [ -d .device/tiny_nemotron3 ] || $mk nemotron3 .device/tiny_nemotron3
  [ -d .device/tiny_qwen3_5_moe ] || $mk qwen3_5_moe .device/tiny_qwen3_5_moe
  [ -d .device/tiny_qwen3_5_moe_vl ] || $mk qwen3_5_moe --multimodal .device/tiny_qwen3_5_moe_vl
  for f in nemotron3 qwen3_5_moe; do
    [ -f .device/standin_$f.safetensors ] || $PY bench/hybrid_kernels.py --model .device/tiny_$f \
      --save-logits .device/standin_$f.safetensors
  done
  du -sh .device
}

whl() { [ -f .whl/p05/part.05 ] || bash ../shared/gpu-vllm/make_parts.sh .whl; cp ../shared/gpu-vllm/install_parts.sh .whl/; }

te() {
  [ -f .te/p04/part.04 ] && ls .te/small/pydantic-*.whl >/dev/null 2>&1 && return 0
  mkdir -p .te/small
  # transformer-engine (the 1 MB meta package): TE's import asserts its distribution is installed;
  # pydantic and its deps: TE's common.recipe imports it
  $PY -m pip download -q --no-deps $P312 -d .te/small transformer-engine==2.20.2 einops==0.8.2 onnx==1.23.2 onnxscript==0.7.2 onnx-ir==1.1.0 \
    ml-dtypes==0.7.0 protobuf==7.36.2 pybind11==3.1.0 ninja==1.13.2 nvdlfw-inspect==0.2.2 nvidia-cudnn-frontend==1.32.0 pyyaml==6.0.4 \
    pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2
  ls .te/small/transformer_engine_torch-*.tar.gz >/dev/null 2>&1 || sdist transformer-engine-torch 2.20.2 .te/small
  [ -f .te/p04/part.04 ] && { du -sh .te/*; return 0; }  # the core wheel's parts are there already
  local t; t=$(mktemp -d)
  $PY -m pip download -q --no-deps $P312 -d "$t" transformer-engine-cu13==2.20.2
  ( cd .te && cat "$t"/transformer_engine_cu13-*.whl | split -b 62914560 -d -a 2 - part. \
    && sha256sum "$t"/transformer_engine_cu13-*.whl | cut -c1-64 > SUM \
    && for f in part.*; do mkdir -p "p${f#part.}" && mv "$f" "p${f#part.}/"; done && mv SUM p00/ )
  rm -rf "$t"; du -sh .te/*
}

for step in ${@:-pw pr device whl}; do "$step"; done
