#!/usr/bin/env bash
# Install everything (scripts/install.sh), then run Flux's main job on an embedded default:
# synthesize a tiny MoE twin, inspect it, and generate text with it through the native backend.
# Pass a model path to use your own GGUF instead of the synthetic one.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash scripts/install.sh
MODEL="${1:-}"
if [ -z "$MODEL" ]; then
  MODEL="${XDG_CACHE_HOME:-$HOME/.cache}/flux/models/tiny-moe.gguf"
  [ -f "$MODEL" ] || flux synth --like tiny-moe -o "$MODEL"
fi
flux inspect "$MODEL"
flux generate "$MODEL" --prompt "Flux plans where every layer runs." -n 24
