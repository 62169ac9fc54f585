#!/usr/bin/env bash
# The hybrid decode step's anatomy on a lent GPU machine, then the product path on one pair (docs/gpu.md):
#   scripts/gpu-anatomy.sh OUT TWIN [PAIRS [bench_gpu.py flags...]]
# after `FLUX_E2E_STEPS=setup scripts/gpu-e2e.sh OUT PAIRS` has built the backend and written TWIN:
#   1. scripts/gpu_anatomy.py: llama-bench decode variants with the scheduler's profile (OUT/anatomy/);
#   2. the GPU-only tests of the expert split (OUT/gpu-tests.log);
#   3. scripts/gpu-e2e.sh OUT PAIRS ...: flux plan, show and bench of each pair (skipped without PAIRS).
# Follow it with `FLUX_POLL_PATTERN='gpu-anatomy.sh' scripts/gpu-poll.sh OUT2 SECONDS`.
set -uo pipefail
OUT=${1:?usage: scripts/gpu-anatomy.sh OUT TWIN [PAIRS [flags]]}; TWIN=${2:?twin}; shift 2
PAIRS=${1:-}; [ $# -gt 0 ] && shift
mkdir -p "$OUT/anatomy"
for d in .carry/whl*; do
  [ -d "$d" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$d"/*.whl 2>&1 | tail -n 3
done
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
echo "[gpu-anatomy $(date +%H:%M:%S)] anatomy of $TWIN"
python3 scripts/gpu_anatomy.py "$TWIN" "$OUT/anatomy" ${FLUX_ANATOMY_FLAGS:-}
echo "[gpu-anatomy $(date +%H:%M:%S)] GPU tests"
python3 -m pytest -q -p no:cacheprovider tests/engine_bridge/test_expert_split_gpu.py > "$OUT/gpu-tests.log" 2>&1
tail -n 3 "$OUT/gpu-tests.log"
if [ -n "$PAIRS" ]; then
  echo "[gpu-anatomy $(date +%H:%M:%S)] product path: $PAIRS"
  FLUX_E2E_BUILD=0 scripts/gpu-e2e.sh "$OUT" "$PAIRS" "$@"
fi
echo "[gpu-anatomy $(date +%H:%M:%S)] done"
