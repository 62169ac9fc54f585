#!/usr/bin/env bash
# Follow a detached `scripts/gpu-e2e.sh` run on a lent machine from a later call (docs/gpu.md):
#   scripts/gpu-poll.sh OUT [SECONDS]
# copies the run's logs (/tmp/o and /tmp/run.log) into OUT/logs.tgz every 15 s, and returns as soon as the run
# has ended (the process whose id is in /tmp/run.pid, written by the detached run itself; without that file, no
# process matches FLUX_POLL_PATTERN, default scripts/gpu-e2e.sh) or SECONDS (default 570) have passed. On a machine that holds no run (released between two calls
# and lent afresh), it says so and exits 3 at once, rather than spending the call's device time waiting.
set -uo pipefail
OUT=${1:?usage: scripts/gpu-poll.sh OUT [SECONDS]}
LIMIT=${2:-570}
mkdir -p "$OUT"
if [ ! -f /tmp/run.log ]; then
  echo "gpu-poll: no run on this machine (a fresh one: the last was released); start again with the setup call"
  exit 3
fi
end=$((SECONDS + LIMIT))
while :; do
  tar czf "$OUT/logs.tgz" --exclude o/backend --exclude o/stock -C /tmp o run.log 2>/dev/null
  if [ -f /tmp/run.pid ]; then  # a pattern would also match this call's own command line when it names one
    kill -0 "$(cat /tmp/run.pid)" 2> /dev/null || { echo "gpu-poll: the run has ended"; break; }
  else
    pgrep -f "${FLUX_POLL_PATTERN:-scripts/gpu-e2e.sh}" > /dev/null || { echo "gpu-poll: the run has ended"; break; }
  fi
  [ "$SECONDS" -ge "$end" ] && { echo "gpu-poll: still running after ${LIMIT} s"; break; }
  sleep 15
done
grep -v '^WARNING' /tmp/run.log | tail -n 8
