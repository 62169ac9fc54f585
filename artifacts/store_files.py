"""The store's file-level helpers: names it accepts (kinds, keys, metadata), atomic writes, listings."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from artifacts.errors import StoreError
from artifacts.ids import canonical_json

_KIND_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")  # names a directory and an SQL view
_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")  # names a file: no separator, no leading dot
META_MAX_BYTES = 4096


def _check_kind(kind: str) -> None:
    """Validate a kind: it names a directory and an SQL view."""
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind):
        raise StoreError(f"invalid kind {kind!r}: use a-z, 0-9 and '_', starting with a letter")


def _check_id(oid: str) -> str:
    """Validate an explicit key: it names a file."""
    if not isinstance(oid, str) or not _ID_RE.fullmatch(oid):
        raise StoreError(f"invalid key {oid!r}: use letters, digits, '_', '.', '-' (not first), up to 128")
    return oid


def _check_meta(kind: str, meta: dict[str, Any] | None) -> None:
    """Validate a catalog meta: a small JSON dict."""
    if meta is None:
        return
    try:
        size = len(canonical_json(dict(meta)).encode("utf-8"))
    except (TypeError, ValueError) as exc:
        raise StoreError(f"meta of {kind} must be a JSON dict: {exc}") from exc
    if size > META_MAX_BYTES:
        raise StoreError(f"meta of {kind} is {size} bytes, over {META_MAX_BYTES}: keep it small")


def _publish(path: Path, write: Callable[[Path], object]) -> None:
    """Write a file atomically: ``write`` fills a temp file in the same directory, then os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())  # content on disk before the name points at it
        os.replace(tmp, path)
    except (OSError, pa.ArrowException, duckdb.Error) as exc:
        raise StoreError(f"cannot write {path}: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)


def _listdir(path: Path) -> list[str]:
    """Sorted entry names of a directory; none when it does not exist."""
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _subdirs(path: Path) -> list[str]:
    """Names of the kind directories under ``path``."""
    return [n for n in _listdir(path) if _KIND_RE.fullmatch(n) and (path / n).is_dir()]


def _sql_str(path: Path) -> str:
    """A path as the body of an SQL string literal."""
    return str(path).replace("'", "''")
