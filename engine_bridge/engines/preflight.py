"""Before anything is measured, each engine other than the worker is started once on the model and asked for
one short completion: it must start, answer within its timeout, and stream per-token logprobs (with token ids)
and completion usage, which Flux needs to time and score it. Anything less ends ``flux plan`` in one line."""

from __future__ import annotations

from pathlib import Path

from artifacts.engine_params import EngineParams
from artifacts.engine_spec import EngineSpec
from engine_bridge.engines.process import EngineProcess
from engine_bridge.engines.registry import EngineRefused
from engine_bridge.engines.stream import body, client, completion
from engine_bridge.errors import EngineError

PROBE_PROMPT = (1, 2, 3, 4)


def preflight(spec: EngineSpec, model: Path, params: EngineParams, log_path: Path | None) -> None:
    """Start ``spec`` on ``model``, ask for four greedy tokens, stop it.

    Raises:
        EngineRefused: it did not start or answer in its timeout, or its stream lacked what Flux needs.
    """
    if spec.native:
        return
    proc = EngineProcess(spec, str(model), params, log_path=log_path)
    try:
        proc.start()
        with client(spec.start_timeout_s) as http:
            got = completion(http, proc.base, body(PROBE_PROMPT, 4, top_logprobs=2))
    except EngineError as exc:
        raise EngineRefused(spec.name, exc.message.removeprefix(f"engine {spec.name}: ")) from None
    finally:
        proc.stop()
    missing = got.missing()
    if missing:
        raise EngineRefused(spec.name, f"its /v1/completions stream lacks {' and '.join(missing)}, which Flux needs "
                                       "to time and score it")
