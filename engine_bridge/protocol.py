"""The worker's versioned JSON-lines protocol (shared by the worker and its clients).

One JSON object per line. Client → worker: ``{"id": n, "op": "load", "args": {...}}``.
Worker → client: ``{"id": n, "ok": true, "result": {...}}``, ``{"id": n, "ok": false, "error": {"code",
"message"}}``, or, before the final answer of a streaming op, ``{"id": n, "event": {...}}``.
The first exchange is ``hello``; its result carries ``protocol``, which must equal PROTOCOL_VERSION.
"""

from __future__ import annotations

import json
from typing import Any

PROTOCOL_VERSION = 2  # 2: typed ops (engine_bridge.ops); load without logits_all


def encode(msg: dict[str, Any]) -> bytes:
    """One protocol line."""
    return (json.dumps(msg, separators=(",", ":"), ensure_ascii=False) + "\n").encode("utf-8")


def decode(line: bytes) -> dict[str, Any]:
    """Parse one protocol line; raises ValueError on garbage."""
    msg = json.loads(line)
    if not isinstance(msg, dict) or "id" not in msg:
        raise ValueError(f"not a protocol message: {line[:200]!r}")
    return msg
