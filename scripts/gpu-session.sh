#!/usr/bin/env bash
# The H200 benchmark record in one go, on an offline GPU machine with this checkout and .carry/ (docs/gpu.md):
# installs the carried wheels, builds the CUDA backend once (FLUX_ONE_BUILD: one compile for the wheel,
# llama-server and llama-bench) while the twins are synthesized into RAM, then runs scripts/bench_gpu.py.
#
#   scripts/gpu-session.sh OUT [bench_gpu.py arguments...]
#
# FLUX_PACK_BACKEND=1 also packs the build into OUT/backend/ (15 MiB pieces: scripts/backend-pack.sh); copied
# to .carry/backend/, the next session unpacks it and skips the build.
set -euo pipefail
OUTDIR=${1:?usage: scripts/gpu-session.sh OUT [bench_gpu.py args]}; shift
mkdir -p "$OUTDIR"
MODELS=/dev/shm/flux-models
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p "$MODELS"
( for m in qwen3-30b-a3b llama3-8b; do
    [ -f "$MODELS/$m-Q4_0.gguf" ] || python3 -c "import sys; from pathlib import Path; from artifacts.synth import synthesize
r = synthesize(sys.argv[1], Path(sys.argv[2]), quant='Q4_0'); print(f'synthesized {sys.argv[1]}: {r.file_bytes/1e9:.2f} GB in {r.seconds:.1f} s')" \
      "$m" "$MODELS/$m-Q4_0.gguf"
  done ) > "$OUTDIR/synth.log" 2>&1 &
synth=$!
start=$(date +%s)
# a build packed by an earlier session (FLUX_PACK_BACKEND=1, pieces copied to .carry/backend/) is a cache hit
if [ -d .carry/backend ]; then scripts/backend-pack.sh unpack .carry/backend 2>&1 | tee -a "$OUTDIR/build.log" || true; fi
FLUX_SRC_DIR=.carry/src FLUX_OFFLINE=1 FLUX_ONE_BUILD=1 CUDA_ARCHS=${CUDA_ARCHS:-90} JOBS=$(nproc) \
  scripts/build-backend.sh > "$OUTDIR/build.log" 2>&1
echo "backend built in $(( $(date +%s) - start )) s" | tee -a "$OUTDIR/build.log"
if [ "${FLUX_PACK_BACKEND:-0}" = 1 ]; then scripts/backend-pack.sh pack "$OUTDIR/backend" 2>&1 | tee -a "$OUTDIR/build.log"; fi
wait "$synth"; cat "$OUTDIR/synth.log"
python3 -c 'import llama_cpp, sys; print("llama_cpp", llama_cpp.__version__, file=sys.stderr)'
# FLUX_DIAG_NCMOE=N[,M]: llama-bench's own pp512/tg64 at --n-cpu-moe N with every host-weight layout: mapped,
# loaded into pinned host memory, and repacked for the CPU (--no-host 1): the decode-vs-prefill trade-off of
# where the CPU's experts live (docs/benchmarks/h200.md), measured in C++ before Flux's own figures.
if [ -n "${FLUX_DIAG_NCMOE:-}" ]; then
  bench=$(python3 -c 'from engine_bridge.backend import llama_server_path; from artifacts.config import load_settings
p = llama_server_path(load_settings().cache_dir); print(p.parent / "llama-bench" if p else "")')
  "$bench" -m "$MODELS/qwen3-30b-a3b-Q4_0.gguf" -ngl 999 -ncmoe "$FLUX_DIAG_NCMOE" -fa 1 -lm mmap,none \
    --no-host 0,1 -t "$(nproc)" -p 512 -n 64 -r 3 -o md 2>&1 | grep '^|' | tee "$OUTDIR/diag.log" || true
fi
# FLUX_DIAG_SPLIT=1 (several GPUs): llama-bench's own pp512/tg64 of every layer on the first GPU vs llama.cpp's
# layer split over the first two (-ts 1/0 vs 1/1): what the pipeline between GPUs costs, in C++.
if [ "${FLUX_DIAG_SPLIT:-0}" = 1 ]; then
  bench=$(python3 -c 'from engine_bridge.backend import llama_server_path; from artifacts.config import load_settings
p = llama_server_path(load_settings().cache_dir); print(p.parent / "llama-bench" if p else "")')
  for m in qwen3-30b-a3b llama3-8b; do
    "$bench" -m "$MODELS/$m-Q4_0.gguf" -ngl 999 -sm layer -ts 1/0,1/1 -fa 1 -t "$(nproc)" -p 512 -n 64 -r 3 \
      -o md 2>&1 | grep '^|' | tee -a "$OUTDIR/diag-split.log" || true
  done
fi
exec python3 scripts/bench_gpu.py --out "$OUTDIR" --model-dir "$MODELS" "$@"
