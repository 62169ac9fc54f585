#!/usr/bin/env bash
# device-kit.sh [KIT_DIR] — make the folder a lent, offline GPU machine needs (docs/gpu.md), on a machine with
# the package registries: the trimmed llama-cpp-python sdist (KIT/src), the Python 3.12 wheels Flux needs that the
# GPU image lacks, split so that no call carries more than ~60 MB (KIT/whl1: the small ones, KIT/whl2: the rest),
# and the working tree at HEAD (KIT/tree.tar). Versions are the ones installed here, so the GPU machine runs what
# CI tested. A packed backend (scripts/backend-pack.sh, KIT/backend) is kept if it is already there.
#
#   scripts/device-kit.sh .carry          # then one call carries .carry (docs/gpu.md)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KIT=${1:-$ROOT/.carry}
mkdir -p "$KIT"
KIT=$(cd "$KIT" && pwd)
say() { printf '[device-kit] %s\n' "$*" >&2; }

# 1. the source, unless a packed build of the current patches is carried instead
if ! ls "$KIT"/backend/backend-*.tar.xz.* > /dev/null 2>&1; then
  [ -d "$KIT/src" ] || [ -f "$KIT/src.tar.xz" ] || "$ROOT/scripts/trim-sdist.sh" "$KIT/src"
fi

# 2. wheels: what Flux imports, at the versions installed here, with their dependencies, minus the image's
PKGS=(prefect duckdb litestar uvicorn pydantic gguf diskcache asyncpg openai prometheus-client jsonschema)
PINS=$(python3 - "${PKGS[@]}" <<'EOF'
import importlib.metadata as m, sys
print(" ".join(f"{p}=={m.version(p)}" for p in sys.argv[1:]))
EOF
)
ALL=$(mktemp -d)
trap 'rm -rf "$ALL"' EXIT
say "downloading $PINS"
# shellcheck disable=SC2086  # PINS is a list of requirement strings
python3 -m pip download -q --no-color --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_34_x86_64 --platform manylinux2014_x86_64 --platform any -d "$ALL" $PINS
# the cuda image's own packages (/work/.library/device/KINDS.md, "Python packages already there"): not carried
IMAGE="anyio attrs certifi charset-normalizer click cloudpickle colorama filelock fsspec h11 httpcore httpx idna
jinja2 markdown-it-py markupsafe mdurl msgpack numpy packaging pathspec prometheus-client protobuf psutil pyarrow
pygments python-dateutil pyyaml regex requests rich scipy setuptools shellingham six sortedcontainers sympy tqdm
typer typing-extensions urllib3 uvloop wheel wrapt zipp nvidia-ml-py toolz multidict yarl frozenlist aiosignal
aiohttp aiohappyeyeballs propcache"
for w in "$ALL"/*.whl; do
  name=$(basename "$w" | cut -d- -f1 | tr '_A-Z' '-a-z')
  case " $(echo $IMAGE) " in *" $name "*) rm -f "$w" ;; esac
done
# installed here for the GPU machine's Python (3.12, manylinux) and packed with xz: the wheels' deflate gives way
# to xz (67 MB of wheels -> ~43 MB), so that the source, the packages and the tree travel in one call of 64 MiB
# and nothing depends on a second call reaching the machine while it is still warm
rm -rf "$KIT/whl1" "$KIT/whl2" "$ALL/site"
python3 -m pip install -q --no-color --no-deps --no-compile --target "$ALL/site" --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux2014_x86_64 --platform any \
  "$ALL"/*.whl
tar -C "$ALL" -cf - site | xz -T0 -6 > "$KIT/site.tar.xz"
if [ -d "$KIT/src" ]; then tar -C "$KIT" -cf - src | xz -T0 -6 > "$KIT/src.tar.xz" && rm -rf "$KIT/src"; fi
git -C "$ROOT" archive --prefix=repo/ HEAD -o "$KIT/tree.tar"
say "$(du -sh "$KIT"/* | tr '\n' ' ')"
say "one call carries $(du -shc "$KIT" | tail -1 | cut -f1) (at most 64 MiB); scripts/gpu-e2e.sh unpacks site.tar.xz and src.tar.xz"
