"""The worker's versioned JSON-lines protocol (shared by the worker and its clients).

One JSON object per line. Client → worker: ``{"id": n, "op": "load", "args": {...}}``.
Worker → client: ``{"id": n, "ok": true, "result": {...}}``, ``{"id": n, "ok": false, "error": {"code",
"message"}}``, or, before the final answer of a streaming op, ``{"id": n, "event": {...}}``.
The first exchange is ``hello``; its result carries ``protocol``, which must equal PROTOCOL_VERSION.

A token array may travel packed: ``{"$i32le": "<base64 of little-endian int32>"}`` (:func:`packed`) where a list of
token ids is expected; :func:`decode` gives it back as a list. A 32k-token prompt is then about a millisecond to
write and to read, where JSON's integers take several on each side (and a cached prompt crosses the pipe twice:
tokenized, then generated).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from engine_bridge import ops
from engine_bridge.errors import EngineError

# 2: typed ops (engine_bridge.ops); load without logits_all. 3: packed token arrays. 4: generate's sampling is one
# field (engine_bridge.sampling.SamplingParams)
PROTOCOL_VERSION = 4
PACKED_KEY = "$i32le"  # a key no request of a client writes by chance
PACK_MIN_TOKENS = 64  # shorter arrays stay JSON lists (readable in logs and tests, and as fast)


def packed(tokens: Sequence[int] | np.ndarray) -> list[int] | dict[str, str]:
    """``tokens`` as they travel: packed when long, else the list itself.

    Raises:
        EngineError: ``bad_request``: an id that int32 cannot hold (no token id is that large).
    """
    if len(tokens) < PACK_MIN_TOKENS:
        return [int(t) for t in tokens]
    try:
        arr = np.asarray(tokens, dtype="<i4")
    except OverflowError:
        raise EngineError("bad_request", "a token id does not fit 32 bits: no vocabulary is that large") from None
    return {PACKED_KEY: base64.b64encode(arr.tobytes()).decode("ascii")}


def _unpack(obj: dict[str, Any]) -> Any:
    """A packed token array as a list; any other object as it is (json's object hook: an object that only looks
    packed stays an object, and the op's model says what is wrong with it)."""
    if len(obj) == 1 and isinstance(obj.get(PACKED_KEY), str):
        try:
            raw = base64.b64decode(obj[PACKED_KEY], validate=True)
        except ValueError:
            return obj
        if len(raw) % 4 == 0:
            return np.frombuffer(raw, dtype="<i4").tolist()
    return obj


def encode(msg: dict[str, Any]) -> bytes:
    """One protocol line.

    Raises:
        EngineError: ``bad_request``: the message holds text that is not Unicode (a lone UTF-16 surrogate,
            which JSON can escape but UTF-8 cannot hold); nothing was sent.
    """
    text = json.dumps(msg, separators=(",", ":"), ensure_ascii=False) + "\n"
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise EngineError("bad_request", f"the {msg.get('op', 'message')!s} request holds text that is not Unicode "
                          f"(a lone UTF-16 surrogate, {text[exc.start]!a}): it cannot be sent to the engine") from None


def decode(line: bytes) -> dict[str, Any]:
    """Parse one protocol line (packed token arrays become lists); raises ValueError on garbage."""
    msg = json.loads(line, object_hook=_unpack)
    if not isinstance(msg, dict) or "id" not in msg:
        raise ValueError(f"not a protocol message: {line[:200]!r}")
    return msg


def generate_args(args: ops.GenerateArgs) -> dict[str, Any]:
    """A ``generate`` request's arguments as they travel: its fields but the defaults, the prompt packed as it is
    (a model built with ``model_construct`` carries a long prompt unvalidated and is not copied here).

    Raises:
        EngineError: ``bad_request``: a prompt token id that does not fit 32 bits.
    """
    out = args.model_dump(mode="json", exclude={"prompt"}, exclude_defaults=True)
    out["prompt"] = packed(args.prompt)
    return out


def generate_event(msg: dict[str, Any]) -> ops.GenerateEvent | None:
    """A ``generate`` stream's message (an event, or the client's ``{"result": ...}``) as its typed event; None for
    an event kind this side does not know. The result is validated (once a request); a token or prefill event is
    the worker's own, typed where it is built (:mod:`engine_bridge.worker.serving`), and not validated again on
    the hot path (one a token)."""
    if "result" in msg:
        return {"type": "result", "result": ops.GenerateResult.model_validate(msg["result"])}
    kind = msg.get("type")
    if kind == "token":
        return cast(ops.TokenEvent, msg)
    if kind == "prefill":
        return cast(ops.PrefillEvent, msg)
    return None
