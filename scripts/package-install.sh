#!/usr/bin/env bash
# Install Flux from the unpacked tarball scripts/package.sh made (this file is its install.sh): no compile.
#
#   ./install.sh [VENV]          # VENV (default ./venv, made with `python3 -m venv` if missing) gets Flux's wheel
#                                # and the backend's llama_cpp_python wheel (pip takes their pure-Python
#                                # dependencies from the package index, or from PIP_* settings such as
#                                # PIP_FIND_LINKS/PIP_NO_INDEX offline); the backend's binaries go into the
#                                # cache_dir that Flux in VENV reads (flux.toml, XDG_CACHE_HOME); then
#                                # `VENV/bin/flux version` checks the result
#   ./install.sh --backend-only  # only the backend into ${XDG_CACHE_HOME:-~/.cache}/flux/backend/<key>: a
#                                # checkout's scripts/build-backend.sh for the same key is then a cache hit
#                                # (what scripts/backend-pack.sh unpack does; the GPU path, docs/gpu.md)
#
# Environment: PYTHON (the interpreter that makes VENV; default python3).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY="${PYTHON:-python3}"
log() { printf '[flux install] %s\n' "$*" >&2; }
die() { printf '[flux install] error: %s\n' "$*" >&2; exit 2; }

key=$(ls "$HERE/backend")
[ "$(echo "$key" | wc -l)" = 1 ] && [ -f "$HERE/backend/$key/build.json" ] || die "$HERE/backend holds no single build"
machine=$(sed -n 's/.*"machine": "\(.*\)".*/\1/p' "$HERE/MANIFEST.json")
[ "$machine" = "$(uname -m)" ] || die "this package was built for $machine; this machine is $(uname -m)"

# backend_into CACHE_DIR: the build's folder into CACHE_DIR/backend/<key>, backend/current pointing at it
backend_into() {
  local dest="$1/backend"
  mkdir -p "$dest"
  rm -rf "$dest/$key.tmp"
  cp -a "$HERE/backend/$key" "$dest/$key.tmp"
  rm -rf "${dest:?}/$key"
  mv "$dest/$key.tmp" "$dest/$key"
  ln -sfn "$dest/$key" "$dest/current"
  log "backend $key in $dest/$key (backend/current points there)"
}

if [ "${1:-}" = --backend-only ]; then
  backend_into "${XDG_CACHE_HOME:-$HOME/.cache}/flux"
  exit 0
fi

VENV=${1:-$HERE/venv}
if [ ! -x "$VENV/bin/python" ]; then
  log "making a virtual environment in $VENV"
  "$PY" -m venv "$VENV"
fi
built=$(sed -n 's/.*"python": "\([0-9]*\.[0-9]*\).*/\1/p' "$HERE/MANIFEST.json")
have=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$built" = "$have" ] || log "warning: built with Python $built, installing into Python $have"

log "installing the wheels into $VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
  "$HERE"/wheels/flux-*.whl "$HERE/backend/$key"/wheel/llama_cpp_python-*.whl

pkg=$("$VENV/bin/python" -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent)')
# A FLUX_ONE_BUILD backend keeps its shared libraries beside the binaries, not in the wheel (build-backend.sh's
# install_libs puts them into the package the same way).
if [ -d "$HERE/backend/$key/lib" ]; then
  mkdir -p "$pkg/lib"
  cp -a "$HERE/backend/$key/lib/." "$pkg/lib/"
fi

cache_dir=$("$VENV/bin/python" -c 'from artifacts.config import load_settings; print(load_settings().cache_dir)')
backend_into "$cache_dir"
"$VENV/bin/flux" version >&2
log "done: $VENV/bin/flux; a starter flux.toml is $HERE/flux.toml (copy it to ~/.config/flux/flux.toml to change a setting)"
