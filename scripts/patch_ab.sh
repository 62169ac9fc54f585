#!/usr/bin/env bash
# The patches on a stock placement against stock llama.cpp: llama-bench of the patched build (backend/current,
# no FLUX_* switch set: the stock code path) raced against llama-bench of the same pin built without the patches
# (scripts/build-backend.sh with FLUX_STOCK=1, linked as the patched one is: static, or against shared libraries
# for a FLUX_ONE_BUILD=1 build), in alternating order, REPS times, the same flags for both. The
# baselines Flux races its plans against (llama-server --fit, --n-cpu-moe, -ngl) run on the patched build, so
# this is what says they are not slowed by it.
#
#   scripts/patch_ab.sh OUT MODEL.gguf [llama-bench flags...]      (REPS=5 by default; e.g. -ngl 999 -ncmoe 19)
#
# Writes OUT/patch_ab.json (each run's prefill and decode tok/s, the medians, patched/stock; rewritten after each
# repetition, so a run cut short keeps what it finished) and prints the ratios. Before each repetition it reads
# the host (RAM read and the GPU's pageable copies, tasks/bench/host_state.py: a few seconds), since a stock
# placement's prefill runs at the host's pageable copies and a lent host's speed changes under us; the readings
# go into patch_ab.json ("host", one per repetition) beside the pair they preceded. The stock build takes as long
# as a backend build the first time (cached after).
set -euo pipefail
OUT=${1:?usage: scripts/patch_ab.sh OUT MODEL.gguf [llama-bench flags...]}
MODEL=${2:?usage: scripts/patch_ab.sh OUT MODEL.gguf [llama-bench flags...]}
shift 2
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/flux"
REPS=${REPS:-5}
mkdir -p "$OUT"
[ -f "$MODEL" ] || { echo "patch_ab: $MODEL is not a file: give a .gguf (flux synth writes one)" >&2; exit 2; }
# FLUX_PATCHED_BENCH: another patched llama-bench, e.g. the one scripts/patch-over-stock.sh builds over the stock
# build tree (one cmake project for both, and one full compile instead of two)
PATCHED=${FLUX_PATCHED_BENCH:-$CACHE/backend/current/bin/llama-bench}
[ -x "$PATCHED" ] || { echo "patch_ab: no patched llama-bench at $PATCHED: run scripts/build-backend.sh first" >&2; exit 2; }
# How a llama-bench is linked: "shared" (it loads a libllama*.so: a FLUX_ONE_BUILD=1 build, the GPU machines') or
# "static". The stock build is linked the same way, so that the race compares the patches and nothing else.
# Without readelf (binutils), the layout says it: build-backend.sh puts a shared build's libraries beside bin/'s
# executables (links into lib/), and a static build has none there.
linkage() {
  if command -v readelf > /dev/null; then
    if readelf -d "$1" 2> /dev/null | grep -q 'NEEDED.*libllama'; then echo shared; else echo static; fi
  elif compgen -G "$(dirname "$1")/libllama*.so*" > /dev/null; then echo shared; else echo static; fi
}
LINK=$(linkage "$PATCHED")
ONE_BUILD=0; [ "$LINK" = shared ] && ONE_BUILD=1
FLUX_STOCK=1 FLUX_ONE_BUILD=$ONE_BUILD "$ROOT/scripts/build-backend.sh" >> "$OUT/build-stock.log" 2>&1 \
  || { echo "patch_ab: the stock build failed: see $OUT/build-stock.log" >&2; exit 1; }
STOCK="$CACHE/backend/stock/bin/llama-bench"
[ "$(linkage "$STOCK")" = "$LINK" ] \
  || { echo "patch_ab: the stock llama-bench is $(linkage "$STOCK"), the patched one $LINK: rebuild the stock one (FLUX_STOCK=1 FLUX_ONE_BUILD=$ONE_BUILD scripts/build-backend.sh)" >&2; exit 1; }
# summarize DONE [print]: patch_ab.json from the first DONE repetitions (written after each one, so that a run
# cut short, e.g. a lent machine taken back, leaves the pairs it finished summarized); "print" prints the ratios
summarize() {
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" python3 - "$OUT" "$1" "$FLAGS_TEXT" "$LINK" "$REPS" "${2:-}" "$PATCHED" "$STOCK" <<'EOF'
import json, statistics, sys
from pathlib import Path
out, reps, flags, link, planned, say = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]
exes = {"patched": sys.argv[7], "stock": sys.argv[8]}
runs = {w: [] for w in ("patched", "stock")}
host = [{"rep": i, **json.loads((out / f"host-{i}.json").read_text())} for i in range(1, reps + 1)
        if (out / f"host-{i}.json").is_file()]
for w in runs:
    for i in range(1, reps + 1):
        for line in (out / f"{w}-{i}.jsonl").read_text().splitlines():
            r = json.loads(line)
            runs[w].append({"rep": i, "test": "prefill" if r["n_gen"] == 0 else "decode", "n": r["n_prompt"] or r["n_gen"],
                            "tps": r["avg_ts"]})
med = {w: {t: statistics.median(r["tps"] for r in rs if r["test"] == t) for t in ("prefill", "decode")
           if any(r["test"] == t for r in rs)} for w, rs in runs.items()}
ratio = {t: med["patched"][t] / med["stock"][t] for t in med["patched"] if t in med["stock"]}
# each repetition ran both builds back to back: its pair's ratio, their median and a bootstrap interval
from tasks.bench.stats import paired_ratio
paired = {t: paired_ratio([r["tps"] for r in runs["patched"] if r["test"] == t],
                          [r["tps"] for r in runs["stock"] if r["test"] == t]).model_dump() for t in ratio}
(out / "patch_ab.json").write_text(json.dumps({"flags": flags, "reps": reps, "reps_planned": planned, "linkage": link,
                                                "executables": exes, "runs": runs, "median_tps": med, "patched_vs_stock": ratio,
                                                "paired": paired, "host": host}, indent=1))
for t, r in ratio.items() if say else ():
    ci = paired[t]
    interval = f" [{ci['low']:.3f}, {ci['high']:.3f}]" if ci["low"] is not None else ""
    print(f"patch_ab: {t} patched {med['patched'][t]:.1f} vs stock {med['stock'][t]:.1f} tok/s: {r:.3f}x; "
          f"paired {ci['ratio']:.3f}x{interval} (medians of {reps}; both {link}; llama-bench {flags})")
for what, key in (("RAM read", "ram_read_gbs"), ("pageable host-to-device", "h2d_pageable_gbs")) if say else ():
    got = [h[key] for h in host if h.get(key) is not None]
    if got:
        print(f"patch_ab: host {what} {min(got):.1f}-{max(got):.1f} GB/s over {len(got)} repetition(s)")
EOF
}
FLAGS_TEXT="$*"
# read_host DONE: the host before repetition DONE (OUT/host-DONE.json); a failed reading is left out, not fatal
read_host() {
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
    "from tasks.bench.host_state import read_host; print(read_host().model_dump_json())" \
    > "$OUT/host-$1.json" 2>> "$OUT/llama-bench.log" || rm -f "$OUT/host-$1.json"
}
for i in $(seq "$REPS"); do
  read_host "$i"
  order="patched stock"; [ $((i % 2)) = 0 ] && order="stock patched"
  for which in $order; do
    exe=$PATCHED; [ "$which" = stock ] && exe=$STOCK
    env -u FLUX_MOE_SPLIT -u FLUX_MOE_MAPPED "$exe" -m "$MODEL" -r 1 -o jsonl "$@" > "$OUT/$which-$i.jsonl" 2>> "$OUT/llama-bench.log"
  done
  [ "$i" = "$REPS" ] || summarize "$i"
done
summarize "$REPS" print
