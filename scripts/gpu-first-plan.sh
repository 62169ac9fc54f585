#!/usr/bin/env bash
# A model's first plan, timed as a user waits for it: `flux plan` from a store that has never seen the model
# (its probe, routing trace, reference and noise floor all computed), once per GPU budget.
#
#   scripts/gpu-first-plan.sh OUT PRESET[/ROUTING] WORKLOAD BUDGET_S GIB[,GIB...]
#   e.g. scripts/gpu-first-plan.sh /tmp/o mixtral-8x7b chat 240 12,4   (GIB 0: no --gpu-mem-budget)
#
# Each plan gets a store of its own (XDG_DATA_HOME under OUT's scratch) and the validation cache is emptied before
# it, so every plan is a first plan; the twin is written by `flux synth` into FLUX_MODEL_DIR (/dev/shm/flux-models)
# when missing. OUT/first-plan-TAG.log holds flux plan's output, OUT/first-plan.tsv one line per plan: the tag, the
# exit code, the wall seconds and B + 90 (docs/gpu.md: a first plan ends within it). Run it after scripts/gpu-e2e.sh
# has installed the packages and the backend (it reuses /tmp/site).
set -uo pipefail
OUT=${1:?usage: scripts/gpu-first-plan.sh OUT PRESET[/ROUTING] WORKLOAD BUDGET_S GIB[,GIB...]}
MR=${2:?preset}; WORKLOAD=${3:?workload}; BUDGET=${4:?budget_s}; GIBS=${5:?gib list}
mkdir -p "$OUT"
MODELS=${FLUX_MODEL_DIR:-/dev/shm/flux-models}
export PYTHONUNBUFFERED=1 DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
m=${MR%%/*}; r=uniform; [ "$MR" = "$m" ] || r=${MR#*/}
f="$MODELS/$m-Q4_0.gguf"; [ "$r" = uniform ] || f="$MODELS/$m-$r-Q4_0.gguf"
mkdir -p "$MODELS"
if [ ! -f "$f" ]; then
  t0=$(date +%s)
  routing=(); [ "$r" = uniform ] || routing=(--routing "$r")
  python3 -m flows synth --like "$m" --quant Q4_0 "${routing[@]}" -o "$f" >> "$OUT/synth.log" 2>&1 || { echo "first-plan: flux synth $m failed (see $OUT/synth.log)"; exit 1; }
  echo "first-plan: synthesized $f in $(( $(date +%s) - t0 )) s"
fi
cache=${XDG_CACHE_HOME:-$HOME/.cache}/flux
for gib in $(echo "$GIBS" | tr ',' ' '); do
  tag="$m-$r-$gib-$WORKLOAD-B$BUDGET"
  rm -rf "$cache/validation"
  data=$(mktemp -d /tmp/first-plan-XXXX)
  t0=$(date +%s.%N)
  gpu=(); [ "$gib" = 0 ] || gpu=(--gpu-mem-budget "$gib")  # 0: no GPU budget (a CPU machine)
  XDG_DATA_HOME=$data python3 -m flows plan "$f" "${gpu[@]}" --workload "$WORKLOAD" --budget-s "$BUDGET" \
    > "$OUT/first-plan-$tag.log" 2>&1
  rc=$?
  wall=$(python3 -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.0f}')" "$t0")
  printf '%s\t%s\t%s\t%s\n' "$tag" "$rc" "$wall" "$((BUDGET + 90))" | tee -a "$OUT/first-plan.tsv"
  XDG_DATA_HOME=$data python3 -m flows show "$(tail -n 1 "$OUT/first-plan-$tag.log")" > "$OUT/first-plan-show-$tag.log" 2>&1 || true
done
