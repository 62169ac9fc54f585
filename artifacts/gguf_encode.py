"""GGUF container encoding: key/value entries and strings as the format writes them (little-endian, u64
lengths). :mod:`artifacts.synth` writes twins' headers with these."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
from gguf import GGUFValueType as VT

_SCALAR_FMT = {VT.UINT32: "<I", VT.INT32: "<i", VT.UINT64: "<Q", VT.FLOAT32: "<f", VT.BOOL: "<?"}


def string(s: str) -> bytes:
    """A GGUF string: its UTF-8 byte length (u64), then the bytes."""
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def value(vt: VT, v: Any) -> bytes:
    """One scalar or string value of type ``vt``."""
    if vt == VT.STRING:
        return string(v)
    return struct.pack(_SCALAR_FMT[vt], v)


def kv(key: str, vt: VT, v: Any) -> bytes:
    """A key/value entry holding one value."""
    return string(key) + struct.pack("<I", vt) + value(vt, v)


def kv_array(key: str, vt: VT, values: list[Any]) -> bytes:
    """A key/value entry holding an array of ``vt`` values."""
    head = string(key) + struct.pack("<IIQ", VT.ARRAY, vt, len(values))
    if vt == VT.INT32:
        return head + np.asarray(values, dtype="<i4").tobytes()
    return head + b"".join(value(vt, v) for v in values)
