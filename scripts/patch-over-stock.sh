#!/usr/bin/env bash
# patch-over-stock.sh — llama-bench with Flux's patches, built over the stock llama-bench's build tree, for
# scripts/patch_ab.sh (FLUX_PATCHED_BENCH): the patches are applied to the source that
# `FLUX_STOCK=1 FLUX_STOCK_KEEP=1 scripts/build-backend.sh` kept and only what they change is compiled again, in
# the same build tree. The two llama-benches then come from one cmake project with the same flags and differ in
# the patches alone, and a CUDA pair costs one full compile and the patched files instead of two full compiles
# (the lent GPU machines' time). ggml.h gains two tensor flags there (enumerators with fixed values: a file that
# does not name them compiles to the same code), so its time stamp is kept and the files that merely include it
# are not compiled again; a ggml.h change beyond new tensor flags recompiles everything.
#
#   FLUX_STOCK=1 FLUX_STOCK_KEEP=1 [FLUX_ONE_BUILD=1 CUDA_ARCHS=90 ...] scripts/build-backend.sh
#   FLUX_PATCHED_BENCH=$(scripts/patch-over-stock.sh) scripts/patch_ab.sh OUT MODEL.gguf [llama-bench flags...]
#
# Prints the patched llama-bench's path (STOCK_DIR/over-stock/bin/llama-bench, linked as the stock one is).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/flux"
STOCK=$(readlink -f "$CACHE/backend/stock" || true)
SRC=$STOCK/src/vendor/llama.cpp BDIR=$STOCK/stock-build DEST=$STOCK/over-stock
if [ -z "$STOCK" ] || [ ! -d "$SRC" ] || [ ! -d "$BDIR" ]; then
  echo "patch-over-stock: no kept stock build tree under $CACHE/backend/stock: run FLUX_STOCK=1 FLUX_STOCK_KEEP=1 scripts/build-backend.sh first" >&2
  exit 2
fi
if [ ! -x "$DEST/bin/llama-bench" ]; then
  h=$SRC/ggml/include/ggml.h
  if [ ! -f "$STOCK/.patched" ]; then
    cp -p "$h" "$STOCK/ggml.h.stock"
    mapfile -t PATCHES < <(ls "$ROOT"/patches/llama.cpp/*.patch | LC_ALL=C sort)
    "$ROOT/scripts/apply-patches.sh" "$SRC" "${PATCHES[@]}"
    touch "$STOCK/.patched"
    # the lines ggml.h lost or gained: none but new GGML_TENSOR_FLAG_* enumerators keeps its time stamp
    if diff "$STOCK/ggml.h.stock" "$h" | grep '^[<>]' \
        | grep -q -v -E '^> +GGML_TENSOR_FLAG_[A-Z_]+ *= *[0-9]+, *(//.*)?$'; then
      echo "patch-over-stock: ggml.h changed beyond new tensor flags: everything is compiled again" >&2
    else
      touch -r "$STOCK/ggml.h.stock" "$h"
    fi
  fi
  start=$(date +%s)
  cmake --build "$BDIR" --target llama-bench -j "${JOBS:-$(nproc)}" > "$STOCK/over-stock.log" 2>&1 \
    || { tail -n 30 "$STOCK/over-stock.log" >&2; echo "patch-over-stock: the build failed: see $STOCK/over-stock.log" >&2; exit 1; }
  echo "patch-over-stock: built in $(( $(date +%s) - start )) s ($(grep -c -E 'Building (C|CXX|CUDA) object' "$STOCK/over-stock.log" || true) file(s) compiled)" >&2
  # laid out as build-backend.sh lays out the stock one: bin/ finds a shared build's libraries through links
  rm -rf "$DEST"; mkdir -p "$DEST/bin"
  cp "$BDIR/bin/llama-bench" "$DEST/bin/"
  if compgen -G "$BDIR/bin/lib*.so*" > /dev/null; then
    mkdir -p "$DEST/lib"; cp -a "$BDIR"/bin/lib*.so* "$DEST/lib/"
    for f in "$DEST"/lib/lib*.so*; do ln -s "../lib/$(basename "$f")" "$DEST/bin/$(basename "$f")"; done
  fi
fi
echo "$DEST/bin/llama-bench"
