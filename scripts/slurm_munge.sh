# Sourced by scripts/slurm_local.sh and scripts/slurm_two_node.sh (root): Debian's slurm and
# munge packages installed if missing, a munge key made once, munged running.
#   ensure_slurm_and_munged
ensure_slurm_and_munged() {
  if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
  fi
  mkdir -p /run/munge
  chown munge:munge /run/munge 2>/dev/null || true
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  fi
  pgrep -x munged >/dev/null || su -s /bin/sh munge -c "munged" || munged --force
}
