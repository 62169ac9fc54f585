"""Content ids: one hash over canonical JSON, used as store key, file name and cache key."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from pydantic import BaseModel

ID_BYTES = 32  # 64 hex chars (blake2b-256)


def _normalize(obj: Any) -> Any:
    """Turn models, tuples and sets into plain JSON values; reject what has no canonical form."""
    if isinstance(obj, BaseModel):
        return _normalize(obj.model_dump(mode="json"))
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"content_id: dict keys must be str, got {type(k).__name__}")
            out[k] = _normalize(v)
        return out
    if isinstance(obj, list | tuple):
        return [_normalize(v) for v in obj]
    if isinstance(obj, set | frozenset):
        return sorted(_normalize(v) for v in obj)
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise ValueError("content_id: NaN and infinities have no canonical JSON form")
        return obj
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    raise TypeError(f"content_id: cannot hash a {type(obj).__name__}")


def canonical_json(obj: Any) -> str:
    """Return the canonical JSON text of ``obj``: sorted keys, no spaces, UTF-8 kept as is."""
    return json.dumps(_normalize(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def content_id(obj: Any) -> str:
    """Return the content id of ``obj``: blake2b-256 of its canonical JSON, as 64 hex chars.

    Args:
        obj: JSON-like data or a pydantic model. Dict key order does not matter; list order does.
    """
    return hashlib.blake2b(canonical_json(obj).encode("utf-8"), digest_size=ID_BYTES).hexdigest()
