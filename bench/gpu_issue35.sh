#!/usr/bin/env bash
# The released-checkpoint checks (issue 35) on one lent GPU (H100 or H200), with .pw .pr .device
# carried (bench/device_kit.sh makes them here) and, for check and sync, the vLLM kit's six parts
# stashed there first (.whl/install_parts.sh stash .whl/pNN, one transfer each):
#   bench/gpu_issue35.sh check   the GPU vLLM tests, and Qwen3.5-MoE (the released, fused expert
#                                layout: .device/tiny_qwen3_5_moe_vl) and Nemotron 3 colocated RL
#                                against vLLM 0.26 with R3, at once
#   bench/gpu_issue35.sh sync    the weight-sync benchmark at the largest shape this GPU holds
#   bench/gpu_issue35.sh speed   train-step speed of each family at its released width (fewer
#                                layers: bench/train_speed.py FAMILY_SHAPES), fast spec, one after another
# Results: runs/gpu35, and packed as $OUT/results.tar.gz when the device tool's $OUT is set.
set -uo pipefail
export PYTHONPATH=$PWD:/tmp/kern:/tmp/site:/root/vsite PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
cd "$(dirname "$0")/.."
RES=runs/gpu35; mkdir -p "$RES"
{ { [ "$1" = speed ] || bash .whl/install_parts.sh install; } && bash bench/h200_hybrids.sh install; } > "$RES/install_$1.log" 2>&1 \
  || { tail -20 "$RES/install_$1.log"; exit 1; }
case "$1" in
  check)
    ( OUT=$RES STEPS=${STEPS:-20} RL_TIMEOUT=${RL_TIMEOUT:-480} bash bench/h200_hybrids.sh rl "qwen3_5_moe nemotron3" \
        > "$RES/rl.log" 2>&1 ) &
    OUT=$RES bash bench/h200_issue13.sh tests > "$RES/tests.log" 2>&1; echo "[tests] exit $?" >> "$RES/tests.log"
    wait
    tail -n 4 "$RES/tests.log"; grep -h -E "^\[rl\]|reward|coverage" "$RES"/rl_*.log | tail -n 12 ;;
  sync)
    OUT=$RES bash bench/h200_issue13.sh sync > "$RES/sync.log" 2>&1; echo "[sync] exit $?" >> "$RES/sync.log"
    grep -E "^\[bench\]|exit" "$RES/sync.log" | tail -n 12 ;;
  speed)
    for f in ${FAMILIES:-qwen3_moe qwen3_5_moe nemotron3}; do
      timeout ${SPEED_TIMEOUT:-200} python3 bench/train_speed.py --preset h200_4k --family $f --specs fast \
        --max-tokens ${MAX_TOKENS:-8192} --steps 2 --out "$RES/speed_$f.json" > "$RES/speed_$f.log" 2>&1
      echo "[speed] $f exit $?" >> "$RES/speed_$f.log"; grep -E "ceiling|median|exit|Error" "$RES/speed_$f.log" | tail -n 4
    done ;;
  *) echo "usage: $0 check | sync | speed"; exit 2 ;;
esac
[ -n "${OUT:-}" ] && tar czf "$OUT/results_$1.tar.gz" -C runs gpu35
