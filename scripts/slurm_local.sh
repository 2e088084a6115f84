#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine (for the launch-script tests and local use).
#   scripts/slurm_local.sh start   -> installs Debian's slurm + munge if missing, starts munged,
#                                     slurmctld and slurmd; prints `export SLURM_CONF=...`
#   scripts/slurm_local.sh stop    -> cancels jobs, stops the daemons
# State lives in ${SLURM_LOCAL_DIR:-/tmp/skyrl-slurm}. Needs root (apt-get, munge user).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/slurm_munge.sh"
DIR=${SLURM_LOCAL_DIR:-/tmp/skyrl-slurm}
CONF=$DIR/slurm.conf
cmd=${1:-start}

start() {
  ensure_slurm_and_munged
  mkdir -p "$DIR"/{spool,state,log}
  local cpus mem
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  cat > "$CONF" <<CONF
ClusterName=skyrl
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=batch_sched_delay=0
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=skyrl-node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=skyrl-node Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
  export SLURM_CONF=$CONF
  [ -f "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null || \
    (slurmctld -D -i -f "$CONF" > "$DIR/log/slurmctld.out" 2>&1 &)
  [ -f "$DIR/slurmd.pid" ] && kill -0 "$(cat "$DIR/slurmd.pid")" 2>/dev/null || \
    (slurmd -D -N skyrl-node -f "$CONF" > "$DIR/log/slurmd.out" 2>&1 &)
  for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -qE "idle|mixed|alloc"; then
      echo "export SLURM_CONF=$CONF"
      return 0
    fi
    sleep 0.5
  done
  echo "slurm did not come up; logs in $DIR/log" >&2
  return 1
}

stop() {
  export SLURM_CONF=$CONF
  scancel --user=root 2>/dev/null || true
  sleep 1
  for p in slurmd slurmctld; do
    [ -f "$DIR/$p.pid" ] && kill "$(cat "$DIR/$p.pid")" 2>/dev/null || true
  done
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
