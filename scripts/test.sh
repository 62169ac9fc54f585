#!/usr/bin/env bash
# Install everything (scripts/install.sh), then lint, type-check and run the whole test suite.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY="${PYTHON:-python3}"
cd "$ROOT"
bash scripts/install.sh
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
"$PY" -m ruff check .
"$PY" -m mypy
"$PY" -m pytest "$@"
