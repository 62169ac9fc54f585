#!/usr/bin/env bash
# apply-patches.sh LLAMA_CPP_DIR PATCH...  — apply Flux's llama.cpp patches in order.
# Each patch is `git diff` output made inside llama.cpp. A patch that does not apply cleanly stops
# with its name and leaves the tree as it was before that patch.
set -euo pipefail
dir=$1; shift
[ -d "$dir" ] || { echo "[apply-patches] error: $dir is not a directory" >&2; exit 1; }
for p in "$@"; do
  name=$(basename "$p")
  p="$(cd "$(dirname "$p")" && pwd)/$name"  # git apply runs inside $dir
  if ! (cd "$dir" && git apply --check -p1 "$p") 2>/tmp/flux-patch-err.$$; then
    echo "[apply-patches] error: patch $name does not apply to $dir:" >&2
    sed 's/^/  /' /tmp/flux-patch-err.$$ >&2; rm -f /tmp/flux-patch-err.$$
    exit 1
  fi
  (cd "$dir" && git apply -p1 "$p")
  echo "[apply-patches] applied $name" >&2
done
rm -f /tmp/flux-patch-err.$$
