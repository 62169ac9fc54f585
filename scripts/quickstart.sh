#!/usr/bin/env bash
# Install everything (scripts/install.sh), then run Flux's main job on an embedded default:
# plan a model (a synthesized tiny MoE twin when none is given: no model hub needed), show the plan,
# then serve it on 127.0.0.1:8090 with a curl line to try. Ctrl-C stops the server.
#   scripts/quickstart.sh [model.gguf] [flux plan flags...]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
(cd "$ROOT" && bash scripts/install.sh)   # flux then runs where the user stands: a relative model path holds
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
if [ $# -eq 0 ]; then set -- --budget-s 120; fi
PLAN=$(flux plan "$@" | tail -n 1)   # the plan id is the last line on stdout
flux show "$PLAN"
cat <<EOM

Serving plan ${PLAN:0:12} on http://127.0.0.1:8090 (Ctrl-C stops). Try, in another terminal:

  curl http://127.0.0.1:8090/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64}'

EOM
exec flux serve "$PLAN"
