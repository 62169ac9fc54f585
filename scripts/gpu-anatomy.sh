#!/usr/bin/env bash
# The hybrid decode step's anatomy on a lent GPU machine, then the product path on one pair (docs/gpu.md):
#   scripts/gpu-anatomy.sh OUT TWIN [PAIRS [flux bench record flags...]]
# after `FLUX_E2E_STEPS=setup scripts/gpu-e2e.sh OUT PAIRS` has built the backend and written TWIN:
#   1. scripts/gpu_anatomy.py: llama-bench decode variants with the scheduler's profile (OUT/anatomy/);
#   2. the tiny twins' loads on the GPU, one process each (OUT/load-check.log), then the GPU-only tests of the
#      expert split (OUT/gpu-tests.log);
#   3. scripts/gpu-e2e.sh OUT PAIRS ...: flux plan, show and bench of each pair (skipped without PAIRS).
# FLUX_WAIT_FILE=PATH: after the anatomy, wait for PATH (a later call's wheels have arrived) before the tests.
# Started detached, it writes its pid to /tmp/run.pid; follow it with `scripts/gpu-poll.sh OUT2 SECONDS`.
set -uo pipefail
OUT=${1:?usage: scripts/gpu-anatomy.sh OUT TWIN [PAIRS [flags]]}; TWIN=${2:?twin}; shift 2
PAIRS=${1:-}; [ $# -gt 0 ] && shift
mkdir -p "$OUT/anatomy"
kill -0 "$(cat /tmp/run.pid 2> /dev/null)" 2> /dev/null || echo $$ > /tmp/run.pid  # unless a chain around it wrote its own
wheels() {
  for d in .carry/whl*; do
    [ -d "$d" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$d"/*.whl 2>&1 | tail -n 3
  done
}
wheels
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
echo "[gpu-anatomy $(date +%H:%M:%S)] anatomy of $TWIN"
python3 scripts/gpu_anatomy.py "$TWIN" "$OUT/anatomy" ${FLUX_ANATOMY_FLAGS:-}
if [ -n "${FLUX_WAIT_FILE:-}" ]; then
  echo "[gpu-anatomy $(date +%H:%M:%S)] waiting for $FLUX_WAIT_FILE"
  while [ ! -f "$FLUX_WAIT_FILE" ]; do sleep 2; done
  wheels
fi
echo "[gpu-anatomy $(date +%H:%M:%S)] tiny twins' loads, one process each"
timeout 400 python3 scripts/gpu_load_check.py /tmp/loadcheck | tee "$OUT/load-check.log"
cp /tmp/loadcheck/gdb-*.log "$OUT/" 2> /dev/null
echo "[gpu-anatomy $(date +%H:%M:%S)] GPU tests"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine_bridge/test_expert_split_gpu.py > "$OUT/gpu-tests.log" 2>&1
tail -n 3 "$OUT/gpu-tests.log"
if [ -n "$PAIRS" ]; then
  echo "[gpu-anatomy $(date +%H:%M:%S)] product path: $PAIRS"
  FLUX_E2E_BUILD=0 scripts/gpu-e2e.sh "$OUT" "$PAIRS" "$@"
fi
echo "[gpu-anatomy $(date +%H:%M:%S)] done"
