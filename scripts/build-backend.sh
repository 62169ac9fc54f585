#!/usr/bin/env bash
# Build Flux's pinned, patched llama.cpp backend.
#
#   scripts/build-backend.sh                 CPU build (default)
#   CUDA_ARCHS=90 scripts/build-backend.sh   CUDA build for compute capability 9.0 (H100/H200)
#   scripts/build-backend.sh --key           print the cache key such a build has, and stop
#
# 1. downloads the llama-cpp-python sdist named in third_party/backend.pin with pip and checks its sha256
#    (or takes it from FLUX_SDIST=/path/to/sdist.tar.gz, for offline machines);
# 2. applies every patches/llama.cpp/*.patch to its vendored llama.cpp (a patch that does not apply
#    stops the build and names the patch);
# 3. builds a wheel, cached under $XDG_CACHE_HOME/flux/backend/<key>, key = hash(pin, patches, CMAKE_ARGS),
#    and installs it (a patch counts from its first `diff --git` line: its header is not part of the key);
# 4. builds llama.cpp's own llama-server, llama-bench and rpc-server (web UI off, static) from the same patched source into that dir;
# 5. writes third_party/architectures.txt, the architectures the pinned llama.cpp implements.
# A second run with nothing changed finds the key in the cache and only checks the install.
#
# The terminal gets a line per step and, during a long compile, a progress line every FLUX_PROGRESS_S seconds
# (default 60). Each step's full output (pip, cmake, the compiler's warnings) goes to
# $XDG_CACHE_HOME/flux/build-logs/<key>/<step>.log (build-logs/latest points at the last build's); a step that
# fails prints its first errors and the tail of its log, and the script exits with the step's status.
#
# Environment: PYTHON (interpreter to install into), JOBS (parallel compile jobs), CMAKE_ARGS (extra cmake
# flags, part of the key), FLUX_OFFLINE=1 (no package index), FLUX_SRC_DIR (a source tree made by
# scripts/trim-sdist.sh, instead of downloading), FLUX_SKIP_SERVER=1 (skip llama-server and llama-bench),
# FLUX_PARALLEL=1 (build the wheel and llama-server at the same time: for many-core machines),
# FLUX_ONE_BUILD=1 (build llama.cpp once, as shared libraries, and put the same libraries in the wheel and
# beside llama-server/llama-bench: one compile instead of two, which halves a CUDA build), FLUX_PROGRESS_S
# (seconds between progress lines), FLUX_BUILD_VERBOSE=1 (also copy every step's output to stderr, as before logs),
# FLUX_STOCK=1 (build only llama-bench of the pin without the patches, for scripts/patch_ab.sh; static, or
# against shared libraries with FLUX_ONE_BUILD=1, as the patched build it is raced against; FLUX_STOCK_KEEP=1
# keeps its source and build tree for scripts/patch-over-stock.sh).
set -euo pipefail
shopt -s inherit_errexit  # a failing command inside $(...) fails the script too (bash clears -e there otherwise)

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PIN_FILE="$ROOT/third_party/backend.pin"
PATCH_DIR="$ROOT/patches/llama.cpp"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/flux"
PY="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
PROGRESS_S="${FLUX_PROGRESS_S:-60}"

log() { printf '[build-backend] %s\n' "$*" >&2; }
die() { printf '[build-backend] error: %s\n' "$*" >&2; exit 1; }

# step NAME LOGNAME CMD...: run CMD with its output in $LOG_DIR/LOGNAME.log, a progress line every PROGRESS_S s
# while it runs and, if it fails, its first errors and the log's tail on stderr, then exit with its status.
# CMD must be a program (env, pip, cmake), not a shell function: bash turns errexit off inside `f || rc=$?`.
step() {
  local name=$1 logf="$LOG_DIR/$2.log" t0=$SECONDS hb rc=0
  shift 2
  log "$name (log: $logf)"
  : > "$logf"
  # A ticker: a progress line every PROGRESS_S s. Killed, it kills its sleep too (no stray process holding stderr).
  ( s=""; trap 'kill "$s" 2>/dev/null; exit 0' TERM
    while :; do
      sleep "$PROGRESS_S" </dev/null >/dev/null 2>&1 & s=$!
      wait "$s" || true
      kill -0 $$ 2>/dev/null || exit 0  # the script is gone
      log "  ... $name: $((SECONDS - t0)) s $(progress_of "$logf")"
    done ) >&2 &
  hb=$!
  if [ "${FLUX_BUILD_VERBOSE:-0}" = 1 ]; then
    "$@" 2>&1 | tee -a "$logf" >&2 || rc=$?
  else
    "$@" >>"$logf" 2>&1 || rc=$?
  fi
  kill "$hb" 2>/dev/null || true
  wait "$hb" 2>/dev/null || true
  if [ "$rc" != 0 ]; then
    log "error: $name failed (exit $rc); its whole output is in $logf"
    if grep -qaE 'error:|Error [0-9]+|ERROR' "$logf"; then
      log "first errors:"
      grep -naE 'error:|Error [0-9]+|ERROR' "$logf" | head -n 15 | sed 's/^/  /' >&2 || true
    fi
    log "last 40 lines:"
    tail -n 40 "$logf" | sed 's/^/  /' >&2 || true
    exit "$rc"
  fi
  log "  $name: done in $((SECONDS - t0)) s"
}

# The last build-progress mark in a log: "[ 45%]" (make) or "[123/456]" (ninja); nothing before the compile starts.
progress_of() { { grep -aoE '\[ *[0-9]+%\]|\[[0-9]+/[0-9]+\]' "$1" 2>/dev/null || true; } | tail -n 1; }

pin_value() { sed -n "s/^$1=//p" "$PIN_FILE" | head -n1; }
VERSION=$(pin_value LLAMA_CPP_PYTHON_VERSION)
SHA256=$(pin_value LLAMA_CPP_PYTHON_SHA256)
COMMIT=$(pin_value LLAMA_CPP_COMMIT)
[ -n "$VERSION" ] && [ -n "$SHA256" ] && [ -n "$COMMIT" ] || die "$PIN_FILE must set LLAMA_CPP_PYTHON_VERSION, LLAMA_CPP_PYTHON_SHA256 and LLAMA_CPP_COMMIT"

# -- what this build is: cmake flags + key -------------------------------------------------------------
FLAGS="-DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_RPC=ON"
if [ -n "${CUDA_ARCHS:-}" ]; then
  FLAGS="$FLAGS -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS}"
fi
FLAGS="$FLAGS ${CMAKE_ARGS:-}"
# A toolchain with libstdc++.so.6 and libstdc++.a but no libstdc++.so link (the H200 image) links libstdc++
# statically into every library it builds: libggml-cuda.so then exports its copy of the stream code, a process
# that also loads the shared libstdc++.so.6 (numpy does) mixes the two, and llama_model::print_info died with
# SIGSEGV in libggml-cuda.so's copy of ostream::_M_insert (cuda-gdb, H200 run 13: every tiny twin's load from
# Python). Such a toolchain gets the link in a folder of its own, so that every library loads libstdc++.so.6.
stdcxx_link_dir() {
  local cxx=${CXX:-c++} found so6
  command -v "$cxx" > /dev/null || return 0
  found=$("$cxx" -print-file-name=libstdc++.so 2> /dev/null) || return 0
  [ "$found" != libstdc++.so ] && [ -e "$found" ] && return 0
  so6=$("$cxx" -print-file-name=libstdc++.so.6 2> /dev/null)
  [ -e "$so6" ] || so6=$(ldconfig -p 2> /dev/null | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')
  [ -n "$so6" ] && [ -e "$so6" ] || return 0
  mkdir -p "$CACHE/toolchain"
  ln -sfn "$so6" "$CACHE/toolchain/libstdc++.so"
  echo "$CACHE/toolchain"
}
STDCXX_DIR=$(stdcxx_link_dir)
if [ -n "$STDCXX_DIR" ]; then
  FLAGS="$FLAGS -DCMAKE_SHARED_LINKER_FLAGS=-L$STDCXX_DIR -DCMAKE_EXE_LINKER_FLAGS=-L$STDCXX_DIR"
fi
PATCHES=()
if compgen -G "$PATCH_DIR/*.patch" >/dev/null && [ "${FLUX_STOCK:-0}" != 1 ]; then
  mapfile -t PATCHES < <(ls "$PATCH_DIR"/*.patch | LC_ALL=C sort)
fi
MODE=separate; [ "${FLUX_ONE_BUILD:-0}" = 1 ] && MODE=one-build
# (the static stock build keeps the key it had before the shared one existed: packed builds stay valid)
[ "${FLUX_STOCK:-0}" = 1 ] && MODE=stock-bench && [ "${FLUX_ONE_BUILD:-0}" = 1 ] && MODE=stock-bench-shared
# A patch's header (the text before its first `diff --git` line, which git apply skips) is left out of the key:
# editing a header rebuilds nothing (engine_bridge/backend.py's build id reads the same part).
patch_body() { sed -n '/^diff --git /,$p' "$1"; }
KEY=$( { cat "$PIN_FILE"; for p in "${PATCHES[@]}"; do basename "$p"; patch_body "$p"; done; echo "$FLAGS"; \
         [ "$MODE" = separate ] || echo "$MODE"; } \
       | sha256sum | cut -c1-16)
# --key: print the key this build would have and stop (nothing made, nothing downloaded)
if [ "${1:-}" = --key ]; then echo "$KEY"; exit 0; fi
OUT="$CACHE/backend/$KEY"
WHEEL_DIR="$OUT/wheel"
# Outside $OUT, so that backend-pack.sh carries the build without its logs.
LOG_DIR="$CACHE/build-logs/$KEY"
mkdir -p "$OUT" "$LOG_DIR"
ln -sfn "$KEY" "$CACHE/build-logs/latest"
log "pin llama-cpp-python $VERSION (llama.cpp $COMMIT), ${#PATCHES[@]} patch(es), key $KEY"
log "cmake flags: $FLAGS"
log "each step's output (compiler warnings included) goes to $LOG_DIR/<step>.log"

PIP_OFFLINE=()
if [ "${FLUX_OFFLINE:-0}" = 1 ]; then
  PIP_OFFLINE=(--no-index)
else
  # Build tools, installed once so that every pip step below can run without build isolation.
  step "installing the build tools (scikit-build-core)" tools "$PY" -m pip install "scikit-build-core>=0.9.2"
fi
"$PY" -c 'import scikit_build_core' 2>/dev/null || die "scikit-build-core is missing: pip install 'scikit-build-core[pyproject]>=0.9.2' (offline: bring its wheel)"

# -- 1. sdist ------------------------------------------------------------------------------------------
fetch_sdist() {
  local dir="$CACHE/sdist" f
  mkdir -p "$dir"
  f="$dir/llama_cpp_python-$VERSION.tar.gz"
  if [ -n "${FLUX_SDIST:-}" ]; then cp "$FLUX_SDIST" "$f.tmp" && mv "$f.tmp" "$f"; fi
  if [ ! -f "$f" ]; then
    step "downloading the llama-cpp-python==$VERSION sdist" sdist \
      "$PY" -m pip download --no-deps --no-binary :all: --no-build-isolation "llama-cpp-python==$VERSION" -d "$dir"
  fi
  [ -f "$f" ] || die "pip did not produce $f"
  local got
  got=$(sha256sum "$f" | cut -d' ' -f1)
  [ "$got" = "$SHA256" ] || die "sha256 of $f is $got, backend.pin says $SHA256: delete the file and run again"
  printf '%s' "$f"
}

# -- 2. unpack + patch ---------------------------------------------------------------------------------
prepare_source() {
  local sdist=$1 src="$OUT/src"
  rm -rf "$src" "$src.tmp"; mkdir -p "$src.tmp"
  tar -xzf "$sdist" -C "$src.tmp" --strip-components=1
  "$ROOT/scripts/apply-patches.sh" "$src.tmp/vendor/llama.cpp" "${PATCHES[@]}"
  mv "$src.tmp" "$src"
  printf '%s' "$src"
}

# -- 3. wheel ------------------------------------------------------------------------------------------
installed_key() {
  "$PY" - <<'EOF' 2>/dev/null || true
import importlib.util, pathlib
spec = importlib.util.find_spec("llama_cpp")
if spec and spec.origin:
    p = pathlib.Path(spec.origin).parent / "FLUX_BACKEND_KEY"
    print(p.read_text().strip() if p.exists() else "")
EOF
}

build_wheel() {
  local src=$1
  # The key file inside the package lets `flux version` and this script know which build is installed.
  echo "$KEY" > "$src/llama_cpp/FLUX_BACKEND_KEY"
  rm -rf "$WHEEL_DIR.tmp"; mkdir -p "$WHEEL_DIR.tmp"
  # -v: the compile's own output (its progress marks included) goes to the log
  step "building the llama-cpp-python wheel (a full llama.cpp compile: the longest step)" wheel \
    env CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
    "$PY" -m pip wheel -v --no-deps --no-build-isolation "${PIP_OFFLINE[@]}" -w "$WHEEL_DIR.tmp" "$src"
  rm -rf "$WHEEL_DIR"; mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"
}

install_wheel() {
  local whl
  whl=$(ls "$WHEEL_DIR"/llama_cpp_python-*.whl | head -n1)
  step "installing $(basename "$whl")" install "$PY" -m pip install --force-reinstall --no-deps "$whl"
  if [ "${FLUX_OFFLINE:-0}" != 1 ]; then
    step "installing its Python dependencies" install-deps \
      "$PY" -m pip install "typing-extensions>=4.5.0" "numpy>=1.20.0" "diskcache>=5.6.1" "jinja2>=2.11.3"
  fi
  install_libs
}

install_libs() {
  # FLUX_ONE_BUILD: the shared libraries llama-server and llama-bench use go into the installed package.
  [ -d "$OUT/lib" ] || return 0
  local pkg
  pkg=$("$PY" -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent)')
  mkdir -p "$pkg/lib"
  cp -a "$OUT/lib/." "$pkg/lib/"
}

# -- 4. llama-server -----------------------------------------------------------------------------------
build_server() {
  local src=$1 bdir="$OUT/server-build"
  # shellcheck disable=SC2086
  step "configuring llama-server" server-cmake \
    cmake -S "$src/vendor/llama.cpp" -B "$bdir" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_APP=OFF \
    $FLAGS
  step "building llama-server, llama-bench and rpc-server (a second llama.cpp compile)" server \
    cmake --build "$bdir" --target llama-server llama-bench ggml-rpc-server -j "$JOBS"
  mkdir -p "$OUT/bin"
  for exe in llama-bench llama-server ggml-rpc-server; do
    cp "$bdir/bin/$exe" "$OUT/bin/$exe.tmp" && mv "$OUT/bin/$exe.tmp" "$OUT/bin/${exe#ggml-}"
  done
  rm -rf "$bdir"
}

# A library that does not load libstdc++.so.6 carries its own copy (stdcxx_link_dir above): say so.
check_stdcxx() {
  command -v readelf > /dev/null || return 0
  readelf -d "$1" 2> /dev/null | grep -q 'NEEDED.*libstdc++' \
    || log "warning: $(basename "$1") has libstdc++ linked in statically (no libstdc++.so link on this toolchain?): loads from Python may crash"
}

# -- 3+4 in one compile (FLUX_ONE_BUILD=1) ------------------------------------------------------------
build_shared() {
  local src=$1 bdir="$OUT/build"
  log "building llama.cpp once (shared libraries, llama-server, llama-bench), then a wheel around it"
  # shellcheck disable=SC2086
  step "configuring llama.cpp (shared libraries)" shared-cmake \
    cmake -S "$src/vendor/llama.cpp" -B "$bdir" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_APP=OFF $FLAGS
  step "building llama.cpp, llama-server, llama-bench and rpc-server" shared \
    cmake --build "$bdir" --target llama llama-server llama-bench ggml-rpc-server -j "$JOBS"
  # lib/ holds the shared libraries once; bin/'s executables find them through links (their RPATH is $ORIGIN).
  rm -rf "$OUT/lib.tmp" "$OUT/bin.tmp"; mkdir -p "$OUT/lib.tmp" "$OUT/bin.tmp"
  cp -a "$bdir"/bin/lib*.so* "$OUT/lib.tmp/"
  cp -a "$bdir/bin/llama-server" "$bdir/bin/llama-bench" "$OUT/bin.tmp/"
  cp -a "$bdir/bin/ggml-rpc-server" "$OUT/bin.tmp/rpc-server"
  for f in "$OUT"/lib.tmp/lib*.so*; do ln -s "../lib/$(basename "$f")" "$OUT/bin.tmp/$(basename "$f")"; done
  rm -rf "$OUT/lib" "$OUT/bin"; mv "$OUT/lib.tmp" "$OUT/lib"; mv "$OUT/bin.tmp" "$OUT/bin"
  check_stdcxx "$OUT"/lib/libllama.so
  # The Python package: its own CMake builds nothing (LLAMA_BUILD=OFF); install_wheel puts $OUT/lib in it.
  echo "$KEY" > "$src/llama_cpp/FLUX_BACKEND_KEY"
  rm -rf "$WHEEL_DIR.tmp"; mkdir -p "$WHEEL_DIR.tmp"
  step "packing the llama-cpp-python wheel around them" wheel \
    env CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" \
    "$PY" -m pip wheel --no-deps --no-build-isolation "${PIP_OFFLINE[@]}" -w "$WHEEL_DIR.tmp" "$src"
  rm -rf "$WHEEL_DIR"; mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"
  rm -rf "$bdir"
}

# -- 5. architectures ----------------------------------------------------------------------------------
write_architectures() {
  local src=$1 dest="$ROOT/third_party/architectures.txt"
  {
    echo "# general.architecture values implemented by llama.cpp $COMMIT (from src/llama-arch.cpp LLM_ARCH_NAMES)."
    echo "# Written by scripts/build-backend.sh; do not edit."
    sed -n '/LLM_ARCH_NAMES = {/,/^};/p' "$src/vendor/llama.cpp/src/llama-arch.cpp" \
      | sed -n 's/.*{ *LLM_ARCH_[A-Z0-9_]*, *"\([^"]*\)" *}.*/\1/p' | grep -v -x -e clip -e unknown
  } > "$dest.tmp"
  mv "$dest.tmp" "$dest"
  cp "$dest" "$OUT/architectures.txt"
}

# -- stock llama-bench (FLUX_STOCK=1) --------------------------------------------------------------------
# The pin without Flux's patches, llama-bench alone, in its own key's folder (backend/stock points at it): what
# scripts/patch_ab.sh races the patched build against. Linked the way the patched llama-bench is, so that the
# A/B compares the patches and nothing else: static, or with FLUX_ONE_BUILD=1 against shared libraries in
# lib/ (the patched build of the GPU machines; bin/ finds them through links, as build_shared lays them out).
# Nothing is installed, backend/current and third_party/architectures.txt are left as they are.
build_stock_bench() {
  local src bdir="$OUT/stock-build" shared=OFF f
  [ "${FLUX_ONE_BUILD:-0}" = 1 ] && shared=ON
  if [ -n "${FLUX_SRC_DIR:-}" ]; then
    rm -rf "$OUT/src"; mkdir -p "$OUT/src"; cp -r "$FLUX_SRC_DIR/." "$OUT/src/"; src="$OUT/src"
  else
    src=$(prepare_source "$(fetch_sdist)")
  fi
  # shellcheck disable=SC2086
  step "configuring stock llama-bench" stock-cmake \
    cmake -S "$src/vendor/llama.cpp" -B "$bdir" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=$shared \
    -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_APP=OFF $FLAGS
  step "building stock llama-bench (the pin without patches)" stock cmake --build "$bdir" --target llama-bench -j "$JOBS"
  rm -rf "$OUT/lib" "$OUT/bin.tmp"; mkdir -p "$OUT/bin.tmp"
  cp "$bdir/bin/llama-bench" "$OUT/bin.tmp/llama-bench"
  if [ "$shared" = ON ]; then
    mkdir -p "$OUT/lib.tmp"; cp -a "$bdir"/bin/lib*.so* "$OUT/lib.tmp/"
    for f in "$OUT"/lib.tmp/lib*.so*; do ln -s "../lib/$(basename "$f")" "$OUT/bin.tmp/$(basename "$f")"; done
    mv "$OUT/lib.tmp" "$OUT/lib"
  fi
  rm -rf "$OUT/bin"; mv "$OUT/bin.tmp" "$OUT/bin"
  # FLUX_STOCK_KEEP=1 keeps the source and the build tree, over which scripts/patch-over-stock.sh builds the
  # patched llama-bench (recompiling only what the patches change); backend-pack.sh leaves them out
  if [ "${FLUX_STOCK_KEEP:-0}" = 1 ]; then log "kept the stock tree: $src, $bdir"; else rm -rf "$bdir" "$src"; fi
}
if [ "${FLUX_STOCK:-0}" = 1 ]; then
  if [ -x "$OUT/bin/llama-bench" ]; then log "cache hit: $OUT"; else build_stock_bench; fi
  ln -sfn "$OUT" "$CACHE/backend/stock"
  log "done: stock llama-bench in $OUT/bin (backend/stock points there)"
  exit 0
fi

# -- main ----------------------------------------------------------------------------------------------
if [ -f "$OUT/build.json" ] && [ -f "$WHEEL_DIR"/llama_cpp_python-*.whl ] 2>/dev/null \
   && { [ "${FLUX_SKIP_SERVER:-0}" = 1 ] || [ -x "$OUT/bin/llama-server" ]; }; then
  log "cache hit: $OUT"
  if [ "$(installed_key)" != "$KEY" ]; then install_wheel; else install_libs; fi
  cp "$OUT/architectures.txt" "$ROOT/third_party/architectures.txt"
else
  if [ -n "${FLUX_SRC_DIR:-}" ]; then
    # A tree made by scripts/trim-sdist.sh from the checked sdist (offline GPU machines).
    grep -q "^$SHA256 " "$FLUX_SRC_DIR/FLUX_SDIST_SHA256" 2>/dev/null \
      || die "$FLUX_SRC_DIR was not trimmed from the pinned sdist ($SHA256): run scripts/trim-sdist.sh"
    rm -rf "$OUT/src.tmp" "$OUT/src"; mkdir -p "$OUT/src.tmp"
    cp -r "$FLUX_SRC_DIR/." "$OUT/src.tmp/"
    "$ROOT/scripts/apply-patches.sh" "$OUT/src.tmp/vendor/llama.cpp" "${PATCHES[@]}"
    mv "$OUT/src.tmp" "$OUT/src"; SRC="$OUT/src"
  else
    SDIST=$(fetch_sdist)
    SRC=$(prepare_source "$SDIST")
  fi
  write_architectures "$SRC"
  need_server=0
  if [ "${FLUX_SKIP_SERVER:-0}" != 1 ] && [ ! -x "$OUT/bin/llama-server" ]; then need_server=1; fi
  server_pid=""
  if [ "${FLUX_ONE_BUILD:-0}" = 1 ]; then build_shared "$SRC"; need_server=0; fi
  if [ "$need_server" = 1 ] && [ "${FLUX_PARALLEL:-0}" = 1 ]; then build_server "$SRC" & server_pid=$!; need_server=0; fi
  if ! ls "$WHEEL_DIR"/llama_cpp_python-*.whl >/dev/null 2>&1; then build_wheel "$SRC"; fi
  install_wheel
  if [ -n "$server_pid" ]; then wait "$server_pid" || die "llama-server build failed"; fi
  if [ "$need_server" = 1 ]; then build_server "$SRC"; fi
  rm -rf "$SRC"
  cat > "$OUT/build.json" <<EOF
{"key": "$KEY", "llama_cpp_python": "$VERSION", "llama_cpp_commit": "$COMMIT", "cmake_flags": "$FLAGS",
 "patches": [$(for p in "${PATCHES[@]}"; do printf '"%s",' "$(basename "$p")"; done | sed 's/,$//')],
 "cuda_archs": "${CUDA_ARCHS:-}"}
EOF
fi
ln -sfn "$OUT" "$CACHE/backend/current"
log "done: wheel and llama-server in $OUT (backend/current points there)"
