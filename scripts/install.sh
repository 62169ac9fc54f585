#!/usr/bin/env bash
# Install Flux and everything it needs on a fresh machine: Python dependencies, then the pinned, patched
# llama.cpp backend (llama-cpp-python wheel + llama-server; ~25 min on 2 cores the first time, a cache hit
# after that). Idempotent.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY="${PYTHON:-python3}"
cd "$ROOT"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[test]"
PYTHON="$PY" bash scripts/build-backend.sh
