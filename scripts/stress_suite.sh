#!/usr/bin/env bash
# Runs the default test suite N times in a row (default 3) while two CPU hogs (the equivalent of
# `stress --cpu 2`) keep every core of a 2-core box busy: the suite must not depend on timing.
#   scripts/stress_suite.sh [N] [pytest args...]      logs: runs/stress/run_K.log
set -uo pipefail
cd "$(dirname "$0")/.."
n=${1:-3}; shift || true
mkdir -p runs/stress
hogs=()
for _ in 1 2; do python3 -c 'while True: pass' & hogs+=($!); done
trap 'kill "${hogs[@]}" 2>/dev/null' EXIT
for k in $(seq 1 "$n"); do
  start=$(date +%s)
  .venv/bin/python -m pytest -q -m "not slow and not gpu" "$@" > "runs/stress/run_$k.log" 2>&1
  rc=$?
  echo "run $k: rc=$rc in $(( $(date +%s) - start )) s: $(tail -1 runs/stress/run_$k.log)"
  [ $rc -eq 0 ] || exit $rc
done
