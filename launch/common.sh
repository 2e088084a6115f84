# Sourced by the sbatch scripts (after REPO is set): GPU / network settings from the environment,
# the job's log directory, and the teardown that stops every step of the job when it ends.
#   SKYRL_IFNAME   network interface for NCCL and gloo (sets NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME
#                  unless those are set); NCCL_IB_* and the like pass through from the environment
#   SKYRL_LOG_DIR  per-node logs (default <repo>/logs/<job id>)
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # NVLink multicast off (hangs seen on lent H200s)
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # megatron's TP/SP comm overlap needs 1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # a dead peer ends the step
if [ -n "${SKYRL_IFNAME:-}" ]; then
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$SKYRL_IFNAME} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$SKYRL_IFNAME}
fi
LOG_DIR=${SKYRL_LOG_DIR:-$REPO/logs/${SLURM_JOB_ID:-local}}
mkdir -p "$LOG_DIR"
STEPS=()  # pids of the job's background srun steps

stop_steps() {  # every step still running is stopped (srun forwards the signal to its tasks)
  local p
  for p in "${STEPS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${STEPS[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap stop_steps EXIT
trap 'echo "[skyrl-mega] job ${SLURM_JOB_ID:-} interrupted: stopping every step" >&2; exit 130' INT TERM

show_logs() {  # the end of each per-node trainer log, into the job's own output
  local f
  for f in "$LOG_DIR"/trainer-*.log; do
    [ -f "$f" ] || continue
    echo "== $f (last 60 lines) =="
    tail -n 60 "$f"
  done
}
