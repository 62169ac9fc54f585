#!/usr/bin/env bash
# Pack Flux and the built backend into one relocatable tarball: a machine of the same OS gets a working
# `flux version` / `flux plan` / `flux serve` from it with no compile.
#
#   scripts/package.sh [DIST]     # -> DIST/flux-<version>-<backend key>.tar.gz (DIST defaults to dist/)
#
# It packs the build scripts/build-backend.sh left in ~/.cache/flux/backend/current (it builds nothing: run
# build-backend.sh first) and a Flux wheel built from this checkout's last commit (HEAD; edits not committed stay
# out, as they would of a release):
#
#   flux-<version>-<key>/
#     install.sh                 a virtual environment (made if missing) gets both wheels, the backend goes into
#                                that environment's cache_dir; --backend-only: only the cache (then
#                                build-backend.sh is a cache hit, as after backend-pack.sh unpack)
#     flux.toml                  a starter: `flux config --defaults` with the locations left to the machine
#     MANIFEST.json              version, commit, backend key, build.json, the build machine's Python, OS and glibc
#     wheels/flux-<version>-py3-none-any.whl
#     backend/<key>/             the cache layout build-backend.sh writes: wheel/llama_cpp_python-*.whl,
#                                bin/llama-server, bin/llama-bench, bin/rpc-server, lib/ (the shared libraries
#                                of a FLUX_ONE_BUILD build; a static build's are inside the wheel), build.json,
#                                architectures.txt
#
# Environment: PYTHON (the interpreter that builds the wheel; default python3), XDG_CACHE_HOME (where the
# backend cache is), FLUX_BACKEND (a build folder other than backend/current), FLUX_OFFLINE=1 (no package index:
# the wheel is built with the interpreter's own setuptools>=68 and wheel instead of an isolated build
# environment pip would download them into; the GPU machines).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY="${PYTHON:-python3}"
DIST=${1:-$ROOT/dist}
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/flux/backend"
log() { printf '[package] %s\n' "$*" >&2; }
die() { printf '[package] error: %s\n' "$*" >&2; exit 2; }

src=$(readlink -f "${FLUX_BACKEND:-$CACHE/current}") || die "no backend build in $CACHE/current: run scripts/build-backend.sh"
[ -f "$src/build.json" ] || die "$src has no build.json (an unfinished build?): run scripts/build-backend.sh"
for exe in llama-server llama-bench rpc-server; do
  [ -x "$src/bin/$exe" ] || die "$src/bin has no $exe (a FLUX_SKIP_SERVER build?): run scripts/build-backend.sh"
done
llama_whl=$(ls "$src"/wheel/llama_cpp_python-*.whl 2> /dev/null | head -n 1) || true
[ -n "$llama_whl" ] || die "$src/wheel has no llama_cpp_python wheel: run scripts/build-backend.sh"
key=$(basename "$src")
work=$(mktemp -d "${TMPDIR:-/tmp}/flux-package.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src"
# HEAD's tree, whole and consistent: a half-made change in the working tree (a module not yet added) stays out
git -C "$ROOT" archive --format=tar HEAD | tar -x -C "$work/src"
commit=$(git -C "$ROOT" rev-parse --short=12 HEAD)
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$work/src/pyproject.toml" | head -n 1)
[ -n "$version" ] || die "no version in pyproject.toml"
name="flux-$version-$key"
stage="$work/$name"
mkdir -p "$stage/wheels" "$stage/backend"

log "building the Flux $version wheel (commit $commit)"
isolation=(); [ "${FLUX_OFFLINE:-0}" = 1 ] && isolation=(--no-build-isolation --no-index)
"$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps "${isolation[@]}" -w "$stage/wheels" "$work/src" >&2
ls "$stage"/wheels/flux-*.whl > /dev/null 2>&1 || die "pip made no Flux wheel"

log "backend $key from $src"
# Build trees a FLUX_STOCK_KEEP or an interrupted build may have left: not part of the installed backend.
tar -C "$(dirname "$src")" --exclude "$key/src" --exclude "$key/src.tmp" --exclude "$key/stock-build" \
  --exclude "$key/over-stock" --exclude "$key/server-build" --exclude "$key/build" --exclude "$key/wheel.tmp" \
  -cf - "$key" | tar -x -C "$stage/backend"

# A starter flux.toml: every default, the three locations commented out (they are the build machine's).
PYTHONPATH="$work/src${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m flows config --defaults \
  | sed -E 's/^(models_dir|cache_dir|data_dir) = (.*)$/# \1 = \2  (this machine'"'"'s default: see `flux config`)/' \
  > "$stage/flux.toml"

glibc=$(ldd --version 2> /dev/null | head -n 1 | sed -E 's/.* ([0-9]+\.[0-9]+)$/\1/') || glibc=""
"$PY" - "$stage/MANIFEST.json" "$version" "$commit" "$key" "$src/build.json" "$glibc" <<'EOF'
import json, platform, sys
out, version, commit, key, build, glibc = sys.argv[1:]
json.dump({"flux": version, "commit": commit, "backend_key": key, "build": json.load(open(build)),
           "python": platform.python_version(), "machine": platform.machine(), "system": platform.system(),
           "glibc": glibc}, open(out, "w"), indent=1, sort_keys=True)
EOF
cp "$work/src/scripts/package-install.sh" "$stage/install.sh"
chmod +x "$stage/install.sh"

mkdir -p "$DIST"
tar -C "$work" -czf "$DIST/$name.tar.gz.tmp" "$name"
mv "$DIST/$name.tar.gz.tmp" "$DIST/$name.tar.gz"
log "$DIST/$name.tar.gz ($(du -h "$DIST/$name.tar.gz" | cut -f1))"
echo "$DIST/$name.tar.gz"
