#!/usr/bin/env bash
# The GPU vLLM runs behind BENCHMARKS.md's "Real vLLM on GPU" section, on one lent H200 with the
# vLLM kit installed in /root/vsite and the project's wheels in /tmp/site (see BENCHMARKS.md):
#   bench/h200_issue13.sh tests | sync | sync2b | sync8b | sync15b | sync8b-rpc | sync15b-rpc | rollout     results under $OUT (default runs/h200)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:/tmp/site:/root/vsite VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-runs/h200}; mkdir -p "$OUT"
tiny() {  # family dir size [extra make_tiny kwargs]
  [ -f "$2/config.json" ] || python -c "from skyrl_mega.models.tiny import make_tiny; \
make_tiny('$1', '$2', size='$3', dtype='bfloat16', device='cuda' ${4:-})"
}
rpc() { [[ $1 == *-rpc ]] && echo --no-worker-channel || true; }  # -rpc: every round through /collective_rpc
case "$1" in
  tests)   SKYRL_GPU_RESULTS=$OUT python -m pytest -q -x -p no:cacheprovider tests/test_vllm_gpu_sync.py tests/test_vllm_gpu.py ;;
  sync2b)  tiny qwen3_moe runs/qwen3_moe_2b 2b
           python bench/vllm_weight_sync.py --model runs/qwen3_moe_2b --out "$OUT/ws2b" ;;
  sync8b|sync8b-rpc)    tiny qwen3_moe runs/qwen3_moe_8b 8b ", weights=False"
           python bench/vllm_weight_sync.py --model runs/qwen3_moe_8b --random $(rpc "$1") --out "$OUT/ws$1" ;;
  sync15b|sync15b-rpc)  tiny qwen3_moe runs/qwen3_moe_15b 15b ", weights=False"
           python bench/vllm_weight_sync.py --model runs/qwen3_moe_15b --random $(rpc "$1") --out "$OUT/ws$1" ;;
  sync)    python bench/vllm_weight_sync.py --out "$OUT/wsauto" ;;  # the largest shape this GPU holds
  rollout) tiny qwen3_moe runs/qwen3_moe_1b 1b
           python bench/rollout_throughput.py --device gpu --dtype bfloat16 --servers 1 --model runs/qwen3_moe_1b \
             --prompts 1024 --n 1 --max-tokens 128 --concurrency 512 --kv-cache-gib 16 --repeats 3 \
             --log-dir "$OUT/rollout_logs" | tee "$OUT/rollout.txt" ;;
  *) echo "usage: $0 tests | sync | sync2b | sync8b | sync15b | sync8b-rpc | sync15b-rpc | rollout"; exit 2 ;;
esac
