"""A fast GGUF header reader: metadata and tensor infos without touching the weights.

``gguf.GGUFReader`` builds a numpy view per array element: on a model with a 152k-token vocabulary it
needs ~6 s before the first field can be read. ``flux inspect`` must answer in well under a second on a
17 GB file, so this module walks the header itself, keeping large arrays as (element type, length) only.
The type codes, quant block sizes and names come from the ``gguf`` package.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from pydantic import BaseModel, ConfigDict

from artifacts.errors import ModelFileError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
KEEP_ARRAY_MAX = 4096  # longer arrays are summarized as ArrayInfo

_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


class ArrayInfo(BaseModel):
    """A metadata array too long to keep: its element type and length."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    element_type: str
    length: int


class TensorInfo(BaseModel):
    """One tensor's header entry. ``shape`` is in ggml order (ne0 is the contiguous dimension)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    shape: tuple[int, ...]
    ggml_type: str
    offset: int
    n_elements: int
    n_bytes: int


class GGUFHeader(BaseModel):
    """Everything before the tensor data of one GGUF file."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    path: str
    version: int
    file_bytes: int
    data_offset: int
    metadata_end: int
    alignment: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]


class _Cursor:
    """Reads little-endian values from a buffer, turning overruns into a 'truncated' error."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelFileError(self.path, "truncated GGUF header (the file ends inside it): download it again")

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        self.need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.unpack("<Q")
        self.need(n)
        self.pos += n


def _value(cur: _Cursor, vtype: int) -> Any:
    """Read one metadata value of GGUF value type ``vtype``."""
    if vtype in _SCALARS:
        return cur.unpack(_SCALARS[vtype])
    if vtype == GGUFValueType.STRING:
        return cur.string()
    if vtype == GGUFValueType.ARRAY:
        etype = cur.unpack("<I")
        length = cur.unpack("<Q")
        return _array(cur, etype, length)
    raise ModelFileError(cur.path, f"unknown GGUF metadata value type {vtype} (corrupt header?)")


def _array(cur: _Cursor, etype: int, length: int) -> Any:
    if length <= KEEP_ARRAY_MAX:
        return [_value(cur, etype) for _ in range(length)]
    if etype in _SCALARS:
        size = struct.calcsize(_SCALARS[etype]) * length
        cur.need(size)
        cur.pos += size
    elif etype == GGUFValueType.STRING:
        for _ in range(length):
            cur.skip_string()
    else:
        for _ in range(length):
            _value(cur, etype)
    return ArrayInfo(element_type=GGUFValueType(etype).name, length=length)


def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string()
    n_dims = cur.unpack("<I")
    if n_dims > 8:
        raise ModelFileError(cur.path, f"tensor {name!r} claims {n_dims} dimensions (corrupt header?)")
    shape = tuple(int(cur.unpack("<Q")) for _ in range(n_dims))
    return name, shape, int(cur.unpack("<I")), int(cur.unpack("<Q"))


def _tensor_bytes(path: Path, name: str, shape: tuple[int, ...], type_id: int) -> tuple[str, int, int]:
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError as exc:
        raise ModelFileError(path, f"tensor {name!r} has unknown ggml type {type_id}") from exc
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    n = 1
    for d in shape:
        n *= d
    return qtype.name, n, n // block * block_bytes


def read_header(path: Path) -> GGUFHeader:
    """Read a GGUF file's metadata and tensor infos.

    Raises:
        ModelFileError: not a regular file, unreadable, not a GGUF, unknown version, truncated header or tensor
            data.
    """
    try:
        # O_NONBLOCK: opening a FIFO for reading otherwise waits for a writer, forever (`flux inspect x.gguf` of a
        # `mkfifo x.gguf` hung); what is opened is then refused unless it is a regular file
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as exc:
        raise ModelFileError(path, "no such file") from exc
    except PermissionError as exc:
        raise ModelFileError(path, "permission denied: cannot read it") from exc
    except OSError as exc:
        raise ModelFileError(path, f"cannot read: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ModelFileError(path, f"is {_file_kind(st.st_mode)}, not a GGUF file: give a model's .gguf file")
        if st.st_size < 24:
            raise ModelFileError(path, f"only {st.st_size} bytes: not a GGUF model file")
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
            return _parse(mm, path, st.st_size)
    except OSError as exc:
        raise ModelFileError(path, f"cannot read: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _file_kind(mode: int) -> str:
    """What a file that is not a regular file is, for a person."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _parse(buf: mmap.mmap, path: Path, size: int) -> GGUFHeader:
    cur = _Cursor(buf, path)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ModelFileError(path, "not a GGUF file (no GGUF magic at the start)")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in SUPPORTED_VERSIONS:
        raise ModelFileError(path, f"GGUF version {version} is not supported (Flux reads versions 2 and 3)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    if n_tensors > 1_000_000 or n_kv > 1_000_000:
        raise ModelFileError(path, "header counts are implausible: the file is corrupt")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = _value(cur, cur.unpack("<I"))
    metadata_end = cur.pos
    raw = [_tensor_info(cur) for _ in range(n_tensors)]
    alignment = int(metadata.get("general.alignment", 32))
    data_offset = (cur.pos + alignment - 1) // alignment * alignment
    tensors = []
    for name, shape, type_id, offset in raw:
        tname, n_el, n_bytes = _tensor_bytes(path, name, shape, type_id)
        tensors.append(TensorInfo(name=name, shape=shape, ggml_type=tname, offset=offset,
                                  n_elements=n_el, n_bytes=n_bytes))
    end = max((data_offset + t.offset + t.n_bytes for t in tensors), default=data_offset)
    if end > size:
        raise ModelFileError(
            path, f"truncated: tensor data needs {end:,} bytes but the file has {size:,}: download it again"
        )
    return GGUFHeader(path=str(path), version=version, file_bytes=size, data_offset=data_offset,
                      metadata_end=metadata_end, alignment=alignment, metadata=metadata, tensors=tensors)
