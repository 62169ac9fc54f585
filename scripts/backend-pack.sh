#!/usr/bin/env bash
# Carry a built backend between offline machines in pieces small enough for a file transfer limit.
#
#   scripts/backend-pack.sh pack DIR     # the current build (~/.cache/flux/backend/current) -> DIR/backend-<key>.tar.xz.NN
#   scripts/backend-pack.sh unpack DIR   # DIR/backend-*.tar.xz.NN -> the backend cache; build-backend.sh then hits it
#
# A CUDA build takes 5-8 minutes of a lent GPU machine's time: packing it once (gpu-e2e.sh with
# FLUX_PACK_BACKEND=1) and carrying the pieces back (.carry/backend/) lets the next session skip the build.
# Pieces are PIECE_MB MiB (default 15). The key (hash of pin, patches and cmake flags) is in the name, so
# a build for other flags or another pin is never unpacked into the wrong place.
set -euo pipefail
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/flux/backend"
cmd=${1:?usage: backend-pack.sh pack|unpack DIR}; dir=${2:?usage: backend-pack.sh pack|unpack DIR}
case "$cmd" in
  pack)
    src=$(readlink -f "$CACHE/current") || { echo "backend-pack: no built backend in $CACHE/current" >&2; exit 2; }
    [ -f "$src/build.json" ] || { echo "backend-pack: $src has no build.json (an unfinished build?)" >&2; exit 2; }
    key=$(basename "$src")
    mkdir -p "$dir"
    rm -f "$dir/backend-$key.tar.xz."*
    tar -C "$CACHE" --exclude "$key/src" -cf - "$key" | xz -T0 -6 \
      | split -b "${PIECE_MB:-15}M" -d -a 2 - "$dir/backend-$key.tar.xz."
    echo "backend-pack: $key -> $(ls "$dir/backend-$key.tar.xz."* | wc -l) piece(s) in $dir" >&2
    ;;
  unpack)
    shopt -s nullglob
    pieces=("$dir"/backend-*.tar.xz.[0-9][0-9])
    [ ${#pieces[@]} -gt 0 ] || { echo "backend-pack: no backend-*.tar.xz.NN pieces in $dir" >&2; exit 2; }
    keys=$(printf '%s\n' "${pieces[@]}" | sed 's/.*backend-\(.*\)\.tar\.xz\.[0-9][0-9]$/\1/' | sort -u)
    [ "$(echo "$keys" | wc -l)" = 1 ] || { echo "backend-pack: pieces of several builds in $dir: $keys" >&2; exit 2; }
    mkdir -p "$CACHE"
    cat "${pieces[@]}" | xz -d | tar -C "$CACHE" -xf -
    [ -f "$CACHE/$keys/build.json" ] || { echo "backend-pack: $dir's pieces held no build.json" >&2; exit 2; }
    echo "backend-pack: $keys unpacked into $CACHE" >&2
    ;;
  *) echo "usage: backend-pack.sh pack|unpack DIR" >&2; exit 2 ;;
esac
