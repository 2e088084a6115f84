#!/usr/bin/env bash
# A real two-node SLURM on this machine, for the multi-node launch tests: each slurmd runs in a
# network namespace of its own (its own address, hostname and /etc/hosts), one slurmctld in the
# root namespace on the bridge between them.
#   scripts/slurm_two_node.sh start   -> namespaces + bridge, munged, slurmctld, two slurmd;
#                                        prints `export SLURM_CONF=...` (and SKYRL_IFNAME)
#   scripts/slurm_two_node.sh stop    -> cancels jobs, stops the daemons, kills what is left in
#                                        the namespaces, removes namespaces, veths and bridge
#   scripts/slurm_two_node.sh status  -> exit 0 when both nodes answer
#
#   node       namespace  address       interface inside
#   skyrl-n1   skyrl-n1   10.213.0.11   skyrl0
#   skyrl-n2   skyrl-n2   10.213.0.12   skyrl0
#   slurmctld  (root)     10.213.0.1    bridge skyrl-br0
#
# The subnet has no route out (traffic stays on these addresses). Ports 6827 (slurmctld) and
# 6828 (slurmd) keep clear of scripts/slurm_local.sh's one-node cluster (6817/6818), and the
# daemons run under the names skyrl2-slurmctld / skyrl2-slurmd (symlinks), so that the other
# cluster's teardown, which stops daemons by name, leaves these alone. Debian's slurmd is built
# without --enable-multiple-slurmd: two instances work here because each is in its own network,
# UTS and mount namespace (its spool and pid file are per node through %n in slurm.conf).
# State lives in ${SLURM_TWO_NODE_DIR:-/tmp/skyrl-slurm2}. Needs root (ip netns, apt-get, munge).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/slurm_munge.sh"
DIR=${SLURM_TWO_NODE_DIR:-/tmp/skyrl-slurm2}
CONF=$DIR/slurm.conf
NET=${SKYRL_TWO_NODE_NET:-10.213.0}
BRIDGE=skyrl-br0
IFNAME=skyrl0
NODES=(skyrl-n1 skyrl-n2)
CTLD_PORT=${SKYRL_TWO_NODE_CTLD_PORT:-6827}
SLURMD_PORT=${SKYRL_TWO_NODE_SLURMD_PORT:-6828}
cmd=${1:-start}

addr_of() { echo "$NET.$((10 + ${1#skyrl-n}))"; }

network_up() {
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip addr show dev "$BRIDGE" | grep -q "inet $NET.1/" || ip addr add "$NET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  local n i
  for n in "${NODES[@]}"; do
    i=${n#skyrl-n}
    ip netns list | grep -qw "$n" || ip netns add "$n"
    if ! ip netns exec "$n" ip link show "$IFNAME" >/dev/null 2>&1; then
      ip link add "skyrl-v$i" type veth peer name "$IFNAME" netns "$n"
      ip link set "skyrl-v$i" master "$BRIDGE" up
    fi
    ip netns exec "$n" ip addr show dev "$IFNAME" | grep -q "inet $(addr_of "$n")/" || \
      ip netns exec "$n" ip addr add "$(addr_of "$n")/24" dev "$IFNAME"
    ip netns exec "$n" ip link set lo up
    ip netns exec "$n" ip link set "$IFNAME" up
    mkdir -p "/etc/netns/$n"
    {
      echo "127.0.0.1 localhost"
      echo "$NET.1 skyrl-ctl"
      local m
      for m in "${NODES[@]}"; do echo "$(addr_of "$m") $m"; done
    } > "/etc/netns/$n/hosts"
  done
}

write_conf() {
  local cpus mem n
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 - 512 ))
  cat > "$CONF" <<CONF
ClusterName=skyrl2
SlurmctldHost=localhost($NET.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=batch_sched_delay=0
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=10
CONF
  for n in "${NODES[@]}"; do
    echo "NodeName=$n NodeAddr=$(addr_of "$n") CPUs=$cpus RealMemory=$mem State=UNKNOWN" >> "$CONF"
  done
  echo "PartitionName=two Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" \
    >> "$CONF"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
  [ "$(id -u)" = 0 ] || { echo "slurm_two_node.sh: needs root (ip netns, munge, slurmd)" >&2; exit 2; }
  ip netns list >/dev/null 2>&1 || { echo "slurm_two_node.sh: ip netns does not work here" >&2; exit 2; }
  ensure_slurm_and_munged
  mkdir -p "$DIR"/{state,log,bin}
  ln -sf "$(command -v slurmctld)" "$DIR/bin/skyrl2-slurmctld"
  ln -sf "$(command -v slurmd)" "$DIR/bin/skyrl2-slurmd"
  network_up
  write_conf
  export SLURM_CONF=$CONF
  local n pids=()
  if ! alive "$DIR/slurmctld.pid"; then
    setsid "$DIR/bin/skyrl2-slurmctld" -D -i -f "$CONF" > "$DIR/log/slurmctld.out" 2>&1 < /dev/null &
    pids+=($!)
  fi
  for n in "${NODES[@]}"; do
    mkdir -p "$DIR/spool-$n"
    alive "$DIR/slurmd-$n.pid" && continue
    # the node's network (nsenter keeps the host's /sys, where slurmd finds the cgroup mounts),
    # its own hostname and /etc/hosts (a private mount namespace)
    setsid nsenter --net="/run/netns/$n" unshare --mount --uts sh -c \
      "mount --bind /etc/netns/$n/hosts /etc/hosts && hostname $n && exec $DIR/bin/skyrl2-slurmd -D -N $n -f $CONF" \
      > "$DIR/log/slurmd-$n.out" 2>&1 < /dev/null &
    pids+=($!)
  done
  local p
  for _ in $(seq 60); do
    if status; then
      echo "export SLURM_CONF=$CONF SKYRL_IFNAME=$IFNAME"
      return 0
    fi
    for p in "${pids[@]}"; do
      kill -0 "$p" 2>/dev/null && continue
      echo "two-node slurm: a daemon exited at start; logs in $DIR/log:" >&2
      tail -n 3 "$DIR"/log/*.out >&2
      return 1
    done
    sleep 0.5
  done
  echo "two-node slurm did not come up (sinfo: $(sinfo -h -N -o '%N %T' 2>&1 | tr '\n' ' ')); logs in $DIR/log" >&2
  return 1
}

stop() {
  export SLURM_CONF=$CONF
  if alive "$DIR/slurmctld.pid"; then
    scancel --user=root 2>/dev/null || true
    for _ in $(seq 40); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.5; done
  fi
  local n p
  for n in "${NODES[@]}"; do
    alive "$DIR/slurmd-$n.pid" && kill "$(cat "$DIR/slurmd-$n.pid")" 2>/dev/null || true
  done
  alive "$DIR/slurmctld.pid" && kill "$(cat "$DIR/slurmctld.pid")" 2>/dev/null || true
  for n in "${NODES[@]}"; do  # whatever a job left in a namespace (job processes outlive slurmd)
    if ip netns list 2>/dev/null | grep -qw "$n"; then
      for p in $(ip netns pids "$n" 2>/dev/null); do kill -TERM "$p" 2>/dev/null || true; done
      for _ in $(seq 20); do [ -z "$(ip netns pids "$n" 2>/dev/null)" ] && break; sleep 0.5; done
      for p in $(ip netns pids "$n" 2>/dev/null); do kill -KILL "$p" 2>/dev/null || true; done
      ip netns del "$n" 2>/dev/null || true
    fi
    rm -rf "/etc/netns/$n"
    ip link del "skyrl-v${n#skyrl-n}" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  rmdir /etc/netns 2>/dev/null || true  # when nothing else uses it
  for p in slurmctld "slurmd-${NODES[0]}" "slurmd-${NODES[1]}"; do
    for _ in $(seq 20); do alive "$DIR/$p.pid" || break; sleep 0.25; done
  done
  rm -f "$DIR"/*.pid
}

status() {
  export SLURM_CONF=$CONF
  [ "$(timeout 5 sinfo -h -N -o '%N %T' 2>/dev/null | grep -cE ' (idle|mixed|alloc)')" = "${#NODES[@]}" ]
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
