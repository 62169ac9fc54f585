#!/usr/bin/env bash
# trim-sdist.sh OUT_DIR — extract the pinned llama-cpp-python sdist (sha256-checked) and drop what no
# CPU/CUDA build needs (vocab test models, docs, tests, examples, web UI, other ggml backends), so the
# source fits in a carried folder for an offline GPU machine (~30 MB instead of 217 MB). Build there with
#   FLUX_SRC_DIR=OUT_DIR FLUX_OFFLINE=1 CUDA_ARCHS=90 scripts/build-backend.sh
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${1:?usage: trim-sdist.sh OUT_DIR}
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/flux"
VERSION=$(sed -n 's/^LLAMA_CPP_PYTHON_VERSION=//p' "$ROOT/third_party/backend.pin")
SHA=$(sed -n 's/^LLAMA_CPP_PYTHON_SHA256=//p' "$ROOT/third_party/backend.pin")
SDIST="$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz"
[ -f "$SDIST" ] || { echo "run scripts/build-backend.sh once first (it downloads $SDIST)" >&2; exit 1; }
[ "$(sha256sum "$SDIST" | cut -d' ' -f1)" = "$SHA" ] || { echo "$SDIST: sha256 mismatch" >&2; exit 1; }
rm -rf "$OUT"; mkdir -p "$OUT"
tar -xzf "$SDIST" -C "$OUT" --strip-components=1
V="$OUT/vendor/llama.cpp"
rm -rf "$OUT/docs" "$OUT/examples" "$OUT/tests" "$OUT/docker" "$V/models" "$V/docs" "$V/tests" "$V/benches" \
       "$V/examples" "$V/conversion" "$V/media" "$OUT/.git" "$V/gguf-py" "$V/pocs" "$V/app" "$V/skills"
rm -f "$V/.git"  # a submodule's pointer to $OUT/.git, gone above: git apply (the patches) fails on a dangling one
for b in blas cann et hexagon hip metal musa opencl openvino sycl virtgpu vulkan webgpu zdnn zendnn; do
  rm -rf "$V/ggml/src/ggml-$b"
done
echo "$SHA (trimmed by scripts/trim-sdist.sh)" > "$OUT/FLUX_SDIST_SHA256"
du -sh "$OUT" >&2
