#!/usr/bin/env bash
# Carry a built backend between offline machines in pieces small enough for a file transfer limit.
#
#   scripts/backend-pack.sh pack DIR        # the current build (~/.cache/flux/backend/current) -> DIR/backend-<key>.tar.xz.NN
#   scripts/backend-pack.sh pack-stock DIR  # the stock llama-bench (backend/stock, FLUX_STOCK=1) -> DIR/stock-<key>.tar.xz.NN
#   scripts/backend-pack.sh unpack DIR      # DIR's pieces of either kind -> the backend cache; build-backend.sh then hits it
#                                           # (a tarball of scripts/package.sh in DIR, flux-*-<key>.tar.gz, too)
#
# A CUDA build takes 5-8 minutes of a lent GPU machine's time: packing it once (gpu-e2e.sh with
# FLUX_PACK_BACKEND=1) and carrying the pieces back (.carry/backend/) lets the next session skip the build.
# Pieces are PIECE_MB MiB (default 15). The key (hash of pin, patches and cmake flags) is in the name, so
# a build for other flags or another pin is never unpacked into the wrong place.
set -euo pipefail
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/flux/backend"
usage="usage: backend-pack.sh pack|pack-stock|unpack DIR"
cmd=${1:?$usage}; dir=${2:?$usage}

# pack KIND LINK MARK: the build backend/LINK points at, which must hold MARK, into DIR/KIND-<key>.tar.xz.NN
pack() {
  local kind=$1 link=$2 mark=$3 src key
  src=$(readlink -f "$CACHE/$link") || { echo "backend-pack: no build in $CACHE/$link" >&2; exit 2; }
  [ -e "$src/$mark" ] || { echo "backend-pack: $src has no $mark (an unfinished build?)" >&2; exit 2; }
  key=$(basename "$src")
  mkdir -p "$dir"
  rm -f "$dir/$kind-$key.tar.xz."*
  tar -C "$CACHE" --exclude "$key/src" --exclude "$key/stock-build" --exclude "$key/over-stock" -cf - "$key" | xz -T0 -6 \
    | split -b "${PIECE_MB:-15}M" -d -a 2 - "$dir/$kind-$key.tar.xz."
  echo "backend-pack: $kind $key -> $(ls "$dir/$kind-$key.tar.xz."* | wc -l) piece(s) in $dir" >&2
}

# unpack KIND MARK: DIR's KIND-<key>.tar.xz.NN pieces (one build) into the cache; 1 when DIR holds none
unpack() {
  local kind=$1 mark=$2 keys
  local pieces=("$dir"/"$kind"-*.tar.xz.[0-9][0-9])
  [ ${#pieces[@]} -gt 0 ] || return 1
  keys=$(printf '%s\n' "${pieces[@]}" | sed "s/.*$kind-\(.*\)\.tar\.xz\.[0-9][0-9]$/\1/" | sort -u)
  [ "$(echo "$keys" | wc -l)" = 1 ] || { echo "backend-pack: pieces of several builds ($kind) in $dir: $keys" >&2; exit 2; }
  mkdir -p "$CACHE"
  cat "${pieces[@]}" | xz -d | tar -C "$CACHE" -xf -
  [ -e "$CACHE/$keys/$mark" ] || { echo "backend-pack: $dir's $kind pieces held no $mark" >&2; exit 2; }
  echo "backend-pack: $kind $keys unpacked into $CACHE" >&2
}

# unpack_package: the backend of DIR's scripts/package.sh tarball (flux-<version>-<key>.tar.gz, whole or cut by
# `split -b 15M -d -a 2` into .tar.gz.NN pieces for a transfer limit) into the cache, through the tarball's own
# install.sh --backend-only; 1 when DIR holds none
unpack_package() {
  local whole=("$dir"/flux-*.tar.gz) pieces=("$dir"/flux-*.tar.gz.[0-9][0-9]) tmp
  [ $((${#whole[@]} + ${#pieces[@]})) -gt 0 ] || return 1
  [ ${#whole[@]} -le 1 ] && { [ ${#whole[@]} = 0 ] || [ ${#pieces[@]} = 0 ]; } \
    && [ "$(printf '%s\n' "${pieces[@]}" | sed 's/\.[0-9][0-9]$//' | sort -u | grep -c .)" -le 1 ] \
    || { echo "backend-pack: several package tarballs in $dir: ${whole[*]} ${pieces[*]}" >&2; exit 2; }
  tmp=$(mktemp -d)
  cat "${whole[@]}" "${pieces[@]}" | tar -xzf - -C "$tmp"
  "$tmp"/flux-*/install.sh --backend-only
  rm -rf "$tmp"
}

case "$cmd" in
  pack) pack backend current build.json ;;
  pack-stock) pack stock stock bin/llama-bench ;;
  unpack)
    shopt -s nullglob
    found=0
    unpack backend build.json && found=1
    unpack stock bin/llama-bench && found=1
    unpack_package && found=1
    [ "$found" = 1 ] || { echo "backend-pack: no backend-*.tar.xz.NN or stock-*.tar.xz.NN pieces or flux-*.tar.gz in $dir" >&2; exit 2; }
    ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
