"""File content hashes, remembered by (path, size, mtime_ns) so a model file is read once.

A model is hashed once and then recognised by a stat call: the answer is kept in
``<cache_dir>/hash-index/<blake2b(abspath)[:32]>.json``. A hit needs the same resolved path, size and
``mtime_ns``; anything else re-reads the file.

A file of at most one piece (PIECE_BYTES) hashes as the blake2b-256 of its bytes. A larger one hashes as a tree:
the blake2b-256 of its size and of the blake2b-256 of each piece, the pieces hashed on several threads (hashlib
releases the GIL), so a first plan of a 17 GB model reads it at memory or disk speed rather than at one core's
hashing speed (~1 GB/s: ~20 s of a first plan in run 8 on the H200).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from artifacts.errors import ModelFileError
from artifacts.ids import content_id

logger = logging.getLogger(__name__)

CHUNK_BYTES = 16 * 1024 * 1024  # large sequential reads: near disk speed, few syscalls
PIECE_BYTES = 64 * 1024 * 1024  # a larger file hashes as a tree of pieces this size, hashed in parallel
HASH_THREADS = 8  # at most this many pieces at once (bounded by the cores)
TREE_TAG = b"flux-tree-v1"
HASH_BYTES = 32  # blake2b-256, 64 hex chars: same width as content ids
INDEX_DIR = "hash-index"
# A file modified this recently may still change within the same mtime tick ("racy git"): its hash is
# returned but not remembered, so a later call re-reads it once it has settled.
RACY_WINDOW_NS = 2_000_000_000


class HashIndexEntry(BaseModel):
    """One remembered file hash."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    size: int
    mtime_ns: int
    hash: str


def index_path(path: Path, cache_dir: Path) -> Path:
    """Return where the remembered hash of ``path`` lives (whether or not it exists yet).

    Args:
        path: The file; resolved (symlinks followed) before naming the entry.
        cache_dir: The cache root; entries live under ``cache_dir/hash-index``.
    """
    key = hashlib.blake2b(str(path.resolve()).encode("utf-8"), digest_size=HASH_BYTES).hexdigest()[:32]
    return cache_dir / INDEX_DIR / f"{key}.json"


def file_hash(path: Path, cache_dir: Path) -> str:
    """Return the blake2b-256 hex digest of a file's content, reading it only when it changed.

    Args:
        path: The file to hash.
        cache_dir: Directory holding the ``hash-index`` of remembered hashes (created when missing).

    Returns:
        64 hex characters.

    Raises:
        ModelFileError: The file is missing, unreadable, or changed while it was being read.
    """
    real = path.resolve()
    before = _stat(real)
    entry_path = index_path(real, cache_dir)
    cached = _load_entry(entry_path)
    if cached is not None and (cached.path, cached.size, cached.mtime_ns) == (
        str(real),
        before.st_size,
        before.st_mtime_ns,
    ):
        return cached.hash
    t0 = time.monotonic()
    digest = _hash_content(real)
    took = time.monotonic() - t0
    if took > 1.0:
        logger.info("hashed %s (%.1f GB) in %.1f s, once: remembered by its path, size and mtime", real.name,
                    before.st_size / 1e9, took)
    after = _stat(real)
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise ModelFileError(real, "changed while it was being hashed; run again once it is complete")
    if time.time_ns() - after.st_mtime_ns < RACY_WINDOW_NS:
        logger.debug("not remembering the hash of %s: modified less than 2 s ago", real)
        return digest
    entry = HashIndexEntry(path=str(real), size=after.st_size, mtime_ns=after.st_mtime_ns, hash=digest)
    _write_entry(entry_path, entry)
    return digest


def model_hash(paths: list[Path], cache_dir: Path) -> str:
    """Return one content id for a model made of one or more files (split GGUFs).

    The id covers the files' content hashes in shard order (their names sorted), not the names: a model
    renamed or moved is the same model, whose plans and planning stages are reused; the order the shards
    are given in does not matter, while a changed shard does.

    Args:
        paths: The model's files (``model-00001-of-00003.gguf``, ...).
        cache_dir: Directory holding the ``hash-index`` of remembered hashes.

    Raises:
        ModelFileError: No paths were given, or a file cannot be hashed.
    """
    if not paths:
        raise ModelFileError("<none>", "a model needs at least one file")
    return content_id({"shards": [file_hash(p, cache_dir) for p in sorted(paths, key=lambda p: p.name)]})


def _stat(path: Path) -> os.stat_result:
    """Stat a file that must be a regular file, with a typed error otherwise."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ModelFileError(path, "not found: check the path") from None
    except OSError as exc:
        raise ModelFileError(path, f"cannot stat: {exc.strerror}") from exc
    if not path.is_file():
        raise ModelFileError(path, "not a regular file")
    return st


def _hash_content(path: Path) -> str:
    """Hash a file's bytes: one pass for a file of at most one piece, a parallel tree of pieces beyond."""
    try:
        with open(path, "rb", buffering=0) as fh:
            size = os.fstat(fh.fileno()).st_size
            if size <= PIECE_BYTES:
                return _hash_sequential(fh)
            return _hash_tree(fh.fileno(), size)
    except OSError as exc:
        raise ModelFileError(path, f"cannot read: {exc.strerror}") from exc
    finally:
        logger.debug("hashed %s", path)


def _hash_sequential(fh: io.RawIOBase) -> str:
    """blake2b-256 of a file's bytes in large chunks read into one reused buffer."""
    hasher = hashlib.blake2b(digest_size=HASH_BYTES)
    view = memoryview(bytearray(CHUNK_BYTES))
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
    while n := fh.readinto(view):
        hasher.update(view[:n])
    return hasher.hexdigest()


def _hash_tree(fd: int, size: int) -> str:
    """blake2b-256 over TREE_TAG, the size and each PIECE_BYTES piece's blake2b-256, pieces hashed in parallel."""
    local = threading.local()

    def piece(offset: int) -> bytes:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = memoryview(bytearray(CHUNK_BYTES))
        hasher = hashlib.blake2b(digest_size=HASH_BYTES)
        end = min(offset + PIECE_BYTES, size)
        while offset < end:
            n = os.preadv(fd, [buf[: min(CHUNK_BYTES, end - offset)]], offset)
            if n <= 0:
                raise OSError(0, "the file ended early (truncated while hashing)")
            hasher.update(buf[:n])
            offset += n
        return hasher.digest()

    threads = max(1, min(HASH_THREADS, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="flux-hash") as pool:
        digests = list(pool.map(piece, range(0, size, PIECE_BYTES)))
    root = hashlib.blake2b(TREE_TAG + size.to_bytes(8, "little"), digest_size=HASH_BYTES)
    for d in digests:
        root.update(d)
    return root.hexdigest()


def _load_entry(entry_path: Path) -> HashIndexEntry | None:
    """Read a remembered entry; a missing or damaged one is a miss."""
    try:
        return HashIndexEntry.model_validate_json(entry_path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError) as exc:
        logger.warning("ignoring damaged hash cache entry %s: %s", entry_path, exc)
        return None


def _write_entry(entry_path: Path, entry: HashIndexEntry) -> None:
    """Publish an entry atomically (temp file in the same directory + os.replace)."""
    entry_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry_path.with_name(f".{entry_path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(entry.model_dump_json(), encoding="utf-8")
        os.replace(tmp, entry_path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        # The hash is still right; only the speed-up for next time is lost.
        logger.warning("cannot remember the hash of %s in %s: %s", entry.path, entry_path, exc)
