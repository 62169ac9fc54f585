#!/usr/bin/env bash
# The whole user path on a fresh, offline NVIDIA machine, with this checkout and .carry/ (docs/gpu.md):
#   1. the carried Python wheels (Prefect, DuckDB, Litestar, pydantic, ...) into /tmp/site;
#   2. the CUDA backend: a packed build from .carry/backend (scripts/backend-pack.sh), else built from the
#      trimmed sdist in .carry/src (FLUX_ONE_BUILD: one compile for the wheel, llama-server and llama-bench);
#   3. the twins, written by `flux synth` into /dev/shm;
#   4. for each MODEL:BUDGET[@CTX]: `flux plan` (the Prefect flow and its store), `flux show`, and
#      `flux bench run --via serve` against llama-server --fit, the best --n-cpu-moe and the most -ngl
#      (`flux bench record`, tasks/bench/gpu_record.py, drives those commands and writes the record);
#   5. `flux serve` of the first plan, answered by the `openai` client (chat, streamed chat, models).
#
#   scripts/gpu-e2e.sh OUT [MODEL[/ROUTING]:BUDGET[@CTX][~WORKLOAD][+spec|+draftK][%PLAN_S][#D1/D2/...],...] [flux bench record flags...]
#   (--depths D1,D2,... or a pair's #D1/D2/...: that plan raced by depth too, docs/benchmarks/race.md)
#   (the pair grammar: tasks/bench/gpu_pairs.py)
#
# Steps that are already done (wheels installed, backend built, twins written) are skipped, so the same
# command can continue in a second call on a machine that stayed warm. FLUX_E2E_STEPS=setup stops after
# step 3 (to build while the wheels of a second call are on their way), =patch-ab after the patch A/B (3b),
# =stock once the A/B's stock build has started (step 0);
# FLUX_PACK_BACKEND=1 packs the build
# into OUT/backend (copy to .carry/backend/ to skip the build next time; not when it came from there) and the patch A/B's stock llama-bench into
# OUT/stock (.carry/stock/); FLUX_PATCH_AB="MODEL.gguf FLAGS" races
# the patched llama-bench against the unpatched pin after step 3 (scripts/patch_ab.sh); with
# FLUX_PATCH_AB_OVER_STOCK=1 the patched one is built over the stock build tree (scripts/patch-over-stock.sh),
# and with FLUX_E2E_STEPS=patch-ab step 2 is left out: the pair costs one full compile.
set -euo pipefail
OUT=${1:?usage: scripts/gpu-e2e.sh OUT [MODEL:BUDGET[@CTX],...] [flux bench record flags]}; shift
PAIRS=${1:-qwen3-30b-a3b:10}; [ $# -gt 0 ] && shift
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
MODELS=${FLUX_MODEL_DIR:-/dev/shm/flux-models}
export PYTHONUNBUFFERED=1 DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
say() { printf '[gpu-e2e %s] %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$OUT/e2e.log" >&2; }

# 0. the packed source, if that is how it came; with FLUX_PATCH_AB, the A/B's stock build starts from it at once,
# detached, and runs while the packages, the backend and the twins are made (it needs no Python package; 319 s
# of a 16-core machine in H200 run 19). FLUX_E2E_STEPS=stock starts it and returns: a call 1 that brings
# .carry/src.tar.xz builds while call 2's packages are on their way. Step 3b waits for it; patch_ab.sh then finds
# the build in the cache (the same key: the pin, no patches, shared libraries as the patched one-compile build).
if [ -f .carry/src.tar.xz ] && [ ! -d .carry/src ]; then tar -xJf .carry/src.tar.xz -C .carry; fi
STOCK_PID=/tmp/flux-stock-build.pid
stock_running() { [ -f "$STOCK_PID" ] && kill -0 "$(cat "$STOCK_PID")" 2> /dev/null; }
if { [ -n "${FLUX_PATCH_AB:-}" ] || [ "${FLUX_E2E_STEPS:-all}" = stock ]; } && [ -d .carry/src ] \
   && [ ! -d .carry/stock ] && [ "${FLUX_E2E_BUILD:-1}" != 0 ] && ! stock_running; then
  setsid bash -c 'echo $$ > "$1"; shift; exec env "$@"' _ "$STOCK_PID" FLUX_STOCK=1 FLUX_ONE_BUILD=1 \
    FLUX_STOCK_KEEP="${FLUX_PATCH_AB_OVER_STOCK:-0}" \
    FLUX_SRC_DIR=.carry/src FLUX_OFFLINE=1 CUDA_ARCHS="${CUDA_ARCHS:-90}" JOBS="$(nproc)" scripts/build-backend.sh \
    >> "$OUT/build-stock.log" 2>&1 < /dev/null &
  sleep 1
  say "stock llama-bench build started (pid $(cat "$STOCK_PID" 2> /dev/null); log $OUT/build-stock.log)"
fi
[ "${FLUX_E2E_STEPS:-all}" = stock ] && exit 0

# 1. packages: .carry/site.tar.xz (scripts/device-kit.sh: installed for this Python and packed), else every
# .carry/whl*/ folder of wheels (a large set may come in two calls)
mkdir -p /tmp/site
if [ -f .carry/site.tar.xz ] && [ ! -f /tmp/site/.flux-unpacked ]; then
  tar -xJf .carry/site.tar.xz -C /tmp && touch /tmp/site/.flux-unpacked
fi
for d in .carry/whl*; do
  [ -d "$d" ] || continue
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$d"/*.whl 2>&1 | tail -n 3 >&2 || true
done
# byte-compiled as `pip install` does by default (left out above to keep the copy fast): without it, the first
# `flux plan` compiled Prefect and its dependencies on import, ~40 s counted as planning time in run 7
python3 -m compileall -q -j 0 /tmp/site flows tasks engine_bridge artifacts server > /dev/null 2>&1 || true
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
flux() { python3 -m flows "$@"; }

# 2. the CUDA backend (FLUX_E2E_BUILD=0: use the installed one, e.g. to try this script on a CPU machine; not
# needed by an A/B alone whose patched llama-bench is built over the stock tree, FLUX_PATCH_AB_OVER_STOCK=1)
start=$(date +%s)
OVER_STOCK_ONLY=0
[ "${FLUX_PATCH_AB_OVER_STOCK:-0}" = 1 ] && [ "${FLUX_E2E_STEPS:-all}" = patch-ab ] && OVER_STOCK_ONLY=1
if [ "${FLUX_E2E_BUILD:-1}" != 0 ] && [ "$OVER_STOCK_ONLY" = 0 ]; then
  if [ -d .carry/backend ]; then scripts/backend-pack.sh unpack .carry/backend >> "$OUT/build.log" 2>&1 || true; fi
  # the stock llama-bench of an earlier run's patch A/B (FLUX_PACK_BACKEND=1 packed it into OUT/stock)
  if [ -d .carry/stock ]; then scripts/backend-pack.sh unpack .carry/stock >> "$OUT/build.log" 2>&1 || true; fi
  FLUX_SRC_DIR=.carry/src FLUX_OFFLINE=1 FLUX_ONE_BUILD=1 CUDA_ARCHS=${CUDA_ARCHS:-90} JOBS=$(nproc) \
    scripts/build-backend.sh >> "$OUT/build.log" 2>&1
fi
say "backend ready in $(( $(date +%s) - start )) s"
# (not when the build in use came in .carry/backend: packing it again costs a minute of the lent machine)
key=$(basename "$(readlink -f "${XDG_CACHE_HOME:-$HOME/.cache}/flux/backend/current" || true)")
if [ "${FLUX_PACK_BACKEND:-0}" = 1 ] && [ ! -d "$OUT/backend" ] && [ ! -f ".carry/backend/backend-$key.tar.xz.00" ]; then
  scripts/backend-pack.sh pack "$OUT/backend" >> "$OUT/build.log" 2>&1
fi

# 3. twins
mkdir -p "$MODELS"
for mr in $(echo "$PAIRS" | tr ',' '\n' | cut -d: -f1 | sort -u); do
  m=${mr%%/*}; r=uniform; [ "$mr" = "$m" ] || r=${mr#*/}
  f="$MODELS/$m-Q4_0.gguf"; [ "$r" = uniform ] || f="$MODELS/$m-$r-Q4_0.gguf"  # tasks/bench/gpu_commands.py's twin_path
  # artifacts.synth directly (what `flux synth` runs): it needs no database, so it runs before the second
  # call's wheels (DuckDB, Prefect) have arrived
  [ -f "$f" ] || { python3 -c "import sys; from pathlib import Path; from artifacts.synth import synthesize
r = sys.argv[3]; synthesize(sys.argv[1], Path(sys.argv[2]), quant='Q4_0', overrides=None if r == 'uniform' else {'routing': r})" \
                     "$m" "$f" "$r" >> "$OUT/synth.log" 2>&1
                   say "synthesized $m ($r routing)"; }
done
[ "${FLUX_E2E_STEPS:-all}" = setup ] && { say "setup done"; exit 0; }

# 3b. FLUX_PATCH_AB="MODEL.gguf FLAGS": the patched llama-bench on a stock placement against the pin built without
# the patches (scripts/patch_ab.sh; the stock build needs .carry/src), before anything else loads the machine
if [ -n "${FLUX_PATCH_AB:-}" ]; then
  if stock_running; then
    say "waiting for the stock llama-bench build (step 0)"
    while stock_running; do sleep 2; done
  fi
  # FLUX_PATCH_AB_OVER_STOCK=1: the patched llama-bench is built over the stock build tree (step 0 kept it),
  # recompiling what the patches change (scripts/patch-over-stock.sh): one full compile for the pair, not two
  patched=""
  if [ "${FLUX_PATCH_AB_OVER_STOCK:-0}" = 1 ]; then
    patched=$(JOBS=$(nproc) scripts/patch-over-stock.sh 2>> "$OUT/build-stock.log") \
      && say "patched llama-bench built over the stock tree: $(grep 'patch-over-stock: built' "$OUT/build-stock.log" | tail -n 1)" \
      || say "the patched build over the stock tree failed: see $OUT/build-stock.log"
  fi
  # shellcheck disable=SC2086  # a model path and llama-bench flags
  FLUX_PATCHED_BENCH=$patched FLUX_SRC_DIR=.carry/src FLUX_OFFLINE=1 CUDA_ARCHS=${CUDA_ARCHS:-90} JOBS=$(nproc) \
    scripts/patch_ab.sh "$OUT/patch-ab" $FLUX_PATCH_AB 2>&1 | tee -a "$OUT/e2e.log" || say "patch A/B failed"
  if [ "${FLUX_PACK_BACKEND:-0}" = 1 ] && [ ! -d "$OUT/stock" ]; then  # carried as .carry/stock next time
    scripts/backend-pack.sh pack-stock "$OUT/stock" >> "$OUT/build.log" 2>&1 || say "packing the stock build failed"
  fi
fi
[ "${FLUX_E2E_STEPS:-all}" = patch-ab ] && { say "patch A/B done"; exit 0; }

# 4. plan, show, bench (each pair) and the record
flux bench record "$PAIRS" --out "$OUT" --model-dir "$MODELS" "$@" 2>&1 | tee -a "$OUT/e2e.log"

# 5. flux serve of the first plan, and the openai client against it
PLAN=$(python3 - "$OUT" <<'EOF'
import sys, pyarrow.parquet as pq
rows = [r for r in pq.read_table(f"{sys.argv[1]}/h200_results.parquet").to_pylist() if r.get("plan_id")]
print(rows[0]["plan_id"] if rows else "")
EOF
)
[ -n "$PLAN" ] || { say "no plan was made: see $OUT/plan-*.log"; exit 1; }
PORT=18090
flux serve "$PLAN" --port "$PORT" > "$OUT/serve.log" 2>&1 &
SERVE=$!
# flux serve gets 15 s to stop after SIGINT, then SIGKILL: a wait on a server that did not stop kept run 12's
# chain (and the poll following it) alive after its last line
stop_serve() {
  kill -INT "$SERVE" 2> /dev/null || return 0
  for _ in $(seq 30); do kill -0 "$SERVE" 2> /dev/null || return 0; sleep 0.5; done
  pkill -KILL -P "$SERVE" 2> /dev/null; kill -KILL "$SERVE" 2> /dev/null || true
}
trap stop_serve EXIT
python3 - "$PORT" "$PLAN" <<'EOF' 2>&1 | tee -a "$OUT/e2e.log"
import sys, time, httpx
from openai import OpenAI
port, plan = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"
for _ in range(600):
    try:
        if httpx.get(f"{base}/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(1)
client = OpenAI(base_url=f"{base}/v1", api_key="none")
model = client.models.list().data[0]
print(f"[openai] model {model.id}: {model.model_dump().get('context_length')} tokens of context (plan {plan[:12]})")
t0 = time.perf_counter()
reply = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "Hello"}], max_tokens=64)
print(f"[openai] chat: {reply.usage.completion_tokens} tokens in {time.perf_counter() - t0:.2f} s, "
      f"finish {reply.choices[0].finish_reason}")
t0, first, n = time.perf_counter(), None, 0
for chunk in client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "Count to ten"}],
                                            max_tokens=128, stream=True, stream_options={"include_usage": True}):
    if chunk.choices and chunk.choices[0].delta.content:
        first = first or time.perf_counter()
        n += 1
    if chunk.usage:
        n = chunk.usage.completion_tokens
dt = time.perf_counter() - (first or t0)
print(f"[openai] streamed chat: first token after {(first or t0) - t0:.3f} s, {n} tokens, "
      f"{(n - 1) / dt if dt > 0 else 0:.1f} tok/s after it")
EOF
say "done: $OUT/h200_results.parquet, $OUT/show-*.log, $OUT/bench-*.log, $OUT/e2e.log"
