#!/usr/bin/env bash
# The hybrid families' GPU kernel checks (issues 14, 15) on one lent H200 (Python 3.12, torch 2.11):
#   here:  make-tiny both families into .device/ (qwen3_5_moe also --multimodal into .device/tiny_qwen3_5_moe_vl),
#          and their stand-in logits on CPU:
#          python bench/hybrid_kernels.py --model .device/tiny_F --save-logits .device/standin_F.safetensors
#   there (carry .pw .pr .device): bench/h200_hybrids.sh install, then bench/h200_hybrids.sh kernels;
#   with the vLLM kit installed in /root/vsite (../shared/gpu-vllm): bench/h200_hybrids.sh rl
#   (each family's recipes/<family>/tiny_gpu.yaml, colocated RL against vLLM GPU with R3, all at once)
# .pw: megatron-core 0.19.2 (cp312), mbridge, hydra-core, omegaconf, antlr4 (sdist), fla-core and
# flash-linear-attention wheels, and kern/mamba_ssm (mamba-ssm 2.3.2.post1's source tree: its Triton
# kernels, no CUDA build; compat/mamba_ssm.py triton_only); .pr: the project's wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:/tmp/kern:/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-runs/h200}; mkdir -p "$OUT"
case "$1" in
  install)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .pw/megatron_core-*.whl \
      .pw/mbridge-*.whl .pw/hydra_core-*.whl .pw/omegaconf-*.whl .pr/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .pw/antlr4-*.tar.gz
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kern .pw/fla_core-*.whl .pw/flash_linear_attention-*.whl
    rm -rf /tmp/site/skyrl_mega /tmp/site/bridges && cp -r .pw/kern/mamba_ssm /tmp/kern/
    if [ -n "${BUILD_CONV:-}" ]; then  # causal-conv1d 1.7.0 from source, for sm_90 only (its setup.py lists 9 archs)
      rm -rf /tmp/cc && mkdir -p /tmp/cc && tar xzf .pw/causal_conv1d-*.tar.gz -C /tmp/cc
      sed -i 's/^    if FORCE_CXX11_ABI:/    cc_flag = ["-gencode", "arch=compute_90,code=sm_90"]  # skyrl: sm_90 only\n    if FORCE_CXX11_ABI:/' /tmp/cc/*/setup.py
      ( cd /tmp/cc/* && time CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=16 python3 -m pip install -q --no-index --no-deps \
          --no-build-isolation --target /tmp/kern . ) 2>&1 | tail -4
    fi
    python3 -c "import megatron.core, fla, torch; print('megatron-core', megatron.core.__version__, 'fla', fla.__version__, torch.__version__)" ;;
  kernels)  # [family:dtype ...]: each its own process, all at once (Triton's first compiles overlap)
    for job in ${2:-qwen3_5_moe:float32 qwen3_5_moe:bfloat16 nemotron3:float32 nemotron3:bfloat16}; do
      f=${job%%:*}; dt=${job##*:}
      timeout ${KERNEL_TIMEOUT:-300} python3 bench/hybrid_kernels.py --model .device/tiny_$f \
        --reference .device/standin_$f.safetensors --dtype $dt --out "$OUT/kernels_${f}_$dt.json" \
        > "$OUT/kernels_${f}_$dt.log" 2>&1 &
    done
    wait; tail -n 3 "$OUT"/kernels_*.log ;;
  rl)  # [family ...]: each family's colocated tiny_gpu RL run (trainer + vLLM GPU engine), all at once
    export PYTHONPATH=$PYTHONPATH:/root/vsite VLLM_USE_FLASHINFER_SAMPLER=0
    for f in ${2:-nemotron3 qwen3_5_moe}; do
      m=.device/tiny_$f; [ -d ${m}_vl ] && m=${m}_vl  # Qwen3.5: the multimodal layout vLLM 0.26 serves
      ( set +e; timeout ${RL_TIMEOUT:-560} python3 bench/gpu_colocated_rl.py --recipe $f/tiny_gpu --out runs/rl_$f \
          model.path=$m train.steps=${STEPS:-30} > "$OUT/rl_$f.log" 2>&1; echo "[rl] $f exit $?" >> "$OUT/rl_$f.log"
        cp runs/rl_$f/summary.json "$OUT/rl_${f}_summary.json"; cp runs/rl_$f/metrics.jsonl "$OUT/rl_${f}_metrics.jsonl"
        for l in runs/rl_$f/engine_logs/*.log; do tail -c 60000 "$l" > "$OUT/rl_${f}_$(basename "$l")"
          grep -a -n -E -B2 -A25 "Traceback|EngineCore.*(Error|Exception)|No module named" "$l" | head -c 40000 \
            > "$OUT/rl_${f}_errors_$(basename "$l")" || true; done ) &
    done
    wait; tail -n 45 "$OUT"/rl_*.log ;;
  *) echo "usage: $0 install | kernels | rl"; exit 2 ;;
esac
