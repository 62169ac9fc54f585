"""Copies of a GGUF with header key/values dropped, set or renamed (same weights): twins without a chat template,
with BOS added, or without ChatML's control tokens."""

from __future__ import annotations

import struct
from pathlib import Path

from gguf import GGUFValueType

from artifacts.gguf_header import read_header

_SIZES = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1, GGUFValueType.UINT16: 2,
          GGUFValueType.INT16: 2, GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
          GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}


def _value_end(raw: bytes, pos: int, vtype: int) -> int:
    if vtype == GGUFValueType.STRING:
        return pos + 8 + struct.unpack_from("<Q", raw, pos)[0]
    if vtype == GGUFValueType.ARRAY:
        etype, n = struct.unpack_from("<IQ", raw, pos)
        pos += 12
        if etype in _SIZES:
            return pos + n * _SIZES[etype]
        for _ in range(n):
            pos = _value_end(raw, pos, etype)
        return pos
    return pos + _SIZES[vtype]


def _string(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def edited_gguf(src: Path, dst: Path, *, drop: tuple[str, ...] = (), bools: dict[str, bool] | None = None,
                strings: dict[str, str] | None = None, rename_tokens: dict[str, str] | None = None) -> Path:
    """A copy of ``src`` at ``dst`` without the keys ``drop``, with the keys ``bools`` and ``strings`` set (added
    when absent) and the vocabulary's tokens ``rename_tokens`` renamed (same tensor data, offsets, alignment)."""
    h = read_header(src)
    raw = src.read_bytes()
    n_kv = struct.unpack_from("<Q", raw, 16)[0]
    pos, kvs = 24, []
    for _ in range(n_kv):
        start = pos
        klen = struct.unpack_from("<Q", raw, pos)[0]
        key = raw[pos + 8:pos + 8 + klen].decode()
        vtype = struct.unpack_from("<I", raw, pos + 8 + klen)[0]
        pos = _value_end(raw, pos + 12 + klen, vtype)
        kvs.append((key, raw[start:pos]))
    todo = {k: struct.pack("<IB", GGUFValueType.BOOL, v) for k, v in (bools or {}).items()}
    todo |= {k: struct.pack("<I", GGUFValueType.STRING) + _string(v) for k, v in (strings or {}).items()}
    out = []
    for key, blob in kvs:
        if key in drop:
            continue
        if key in todo:
            blob = _string(key) + todo.pop(key)
        if key == "tokenizer.ggml.tokens" and rename_tokens:
            for old, new in rename_tokens.items():
                assert blob.count(_string(old)) == 1, f"{old} is a token once"
                blob = blob.replace(_string(old), _string(new))
        out.append(blob)
    out += [_string(k) + v for k, v in todo.items()]
    assert pos == h.metadata_end
    infos = raw[pos:h.metadata_end + sum(8 + len(t.name.encode()) + 4 + 8 * len(t.shape) + 4 + 8 for t in h.tensors)]
    head = raw[:16] + struct.pack("<Q", len(out)) + b"".join(out) + infos
    head += b"\0" * (-len(head) % h.alignment)
    dst.write_bytes(head + raw[h.data_offset:])
    return dst
