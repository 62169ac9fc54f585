"""The worker's versioned JSON-lines protocol (shared by the worker and its clients).

One JSON object per line. Client → worker: ``{"id": n, "op": "load", "args": {...}}``.
Worker → client: ``{"id": n, "ok": true, "result": {...}}``, ``{"id": n, "ok": false, "error": {"code",
"message"}}``, or, before the final answer of a streaming op, ``{"id": n, "event": {...}}``.
The first exchange is ``hello``; its result carries ``protocol``, which must equal PROTOCOL_VERSION.
"""

from __future__ import annotations

import json
from typing import Any

from engine_bridge.errors import EngineError

PROTOCOL_VERSION = 2  # 2: typed ops (engine_bridge.ops); load without logits_all


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
    """Parse one protocol line; raises ValueError on garbage."""
    msg = json.loads(line)
    if not isinstance(msg, dict) or "id" not in msg:
        raise ValueError(f"not a protocol message: {line[:200]!r}")
    return msg
