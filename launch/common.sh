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

node_addr() {  # a node's address from SLURM (NodeAddr), else its name
  local a; a=$(scontrol show node "$1" -o | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p'); echo "${a:-$1}"
}

URLS=() ENGINE_LIST=() ENGINE_STEPS=()
start_engines() {  # PLACEMENT NODE...: one `skyrl-mega serve` step per node on ${ENGINE_PORT:-8000}
  # with the recipe's engine settings, the weight-transfer backend and the job secret (engines
  # bound beyond loopback refuse control / weight-transfer calls without it); fills URLS
  local placement=$1 node; shift
  export SKYRL_ENGINE_SECRET=${SKYRL_ENGINE_SECRET:-$("$VENV/bin/python" -c "import secrets; print(secrets.token_hex(16))")}
  for node in "$@"; do
    srun --overlap --nodes=1 --ntasks=1 -w "$node" \
      "$VENV/bin/python" -m skyrl_mega.cli serve --recipe "$RECIPE" --host 0.0.0.0 --port "${ENGINE_PORT:-8000}" \
      --placement "$placement" "${ARGS[@]}" > "$LOG_DIR/engine-$node.log" 2>&1 &
    STEPS+=($!) ENGINE_STEPS+=($!)
    URLS+=("http://$(node_addr "$node"):${ENGINE_PORT:-8000}") ENGINE_LIST+=("$node")
  done
  EXTERNAL="[$(IFS=,; echo "${URLS[*]}")]"
}

dead_engines() {  # engines whose step ended or whose /health does not answer: "node (url)" each
  local i
  for i in "${!URLS[@]}"; do
    if ! kill -0 "${ENGINE_STEPS[$i]}" 2>/dev/null || ! "$VENV/bin/python" -c \
        "import sys; from skyrl_mega.rollout.procs import http_status; sys.exit(http_status(sys.argv[1], 5) != 200)" \
        "${URLS[$i]}/health"; then
      echo -n "${ENGINE_LIST[$i]} (${URLS[$i]}) "
    fi
  done
}

wait_job() {  # TRAINER_PID: the first step to end decides; sets status (the trainer's exit code,
  # or 1+ when an engine step ended first: the job stops) and says which part failed
  local trainer=$1 first code=0 dead
  wait -n -p first "${STEPS[@]}" || code=$?  # bash >= 5.1
  if [ "$first" = "$trainer" ]; then
    status=$code
    dead=$([ "$status" = 0 ] || dead_engines || true)
    [ -z "$dead" ] || echo "[skyrl-mega] job $SLURM_JOB_ID: the trainer failed (exit $status) and an engine step ended:" \
      "${dead}(engine logs: $LOG_DIR/engine-*.log)" >&2
  else
    echo "[skyrl-mega] job $SLURM_JOB_ID: an engine step ended (exit $code) while the trainer ran; stopping" \
         "every step (engine logs: $LOG_DIR/engine-*.log)" >&2
    status=$(( code == 0 ? 1 : code ))
  fi
}

show_logs() {  # the end of each per-node trainer log, into the job's own output
  local f
  for f in "$LOG_DIR"/trainer-*.log; do
    [ -f "$f" ] || continue
    echo "== $f (last 60 lines) =="
    tail -n 60 "$f"
  done
}
