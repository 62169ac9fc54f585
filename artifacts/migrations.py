"""The store's DuckDB catalog: numbered schema migrations, its row model, and the writer's brief access.

Migrations are recorded in a ``migrations`` table. Append new ones at the end with the next number; never
edit or reorder applied ones. Only writers open the catalog file (DuckDB lets one process hold it), and only
for the length of one write: see ``open_catalog``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

import duckdb
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, ValidationError

from artifacts.errors import StoreError
from artifacts.ids import canonical_json

T = TypeVar("T")

logger = logging.getLogger(__name__)

MIGRATIONS: list[tuple[str, str]] = [
    (
        "m001_init",
        """
        CREATE TABLE objects (
            id VARCHAR NOT NULL,
            kind VARCHAR NOT NULL,
            format VARCHAR NOT NULL,            -- 'json' (objects/) or 'parquet' (tables/)
            created_at TIMESTAMPTZ NOT NULL,
            path VARCHAR NOT NULL,              -- relative to the store's data_dir
            bytes BIGINT NOT NULL,
            meta VARCHAR NOT NULL DEFAULT '{}', -- small JSON object
            PRIMARY KEY (kind, format, id)
        )
        """,
    ),
    (
        # `flux plans` lists one kind, newest first.
        "m002_objects_kind_created_at",
        "CREATE INDEX objects_kind_created_at ON objects (kind, created_at)",
    ),
]

_LEDGER = """
CREATE TABLE IF NOT EXISTS migrations (
    name VARCHAR PRIMARY KEY,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
)
"""

# Columns of the exported index (index/objects.parquet), which readers use instead of the catalog.
INDEX_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("kind", pa.string()),
        ("format", pa.string()),
        ("created_at", pa.timestamp("us", tz="UTC")),
        ("path", pa.string()),
        ("bytes", pa.int64()),
        ("meta", pa.string()),
    ]
)

Format = Literal["json", "parquet"]

# DuckDB shares one database instance per file within a process: serialise this process's writers.
_WRITE_LOCKS: dict[str, threading.Lock] = {}
_WRITE_LOCKS_GUARD = threading.Lock()


class Entry(BaseModel):
    """One row of the catalog's ``objects`` table: where a stored object lives and what it is."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    kind: str
    format: Format
    created_at: datetime
    path: str  # relative to the store's data_dir, '/'-separated
    bytes: int
    meta: dict[str, Any]


class CatalogBusy(StoreError):
    """Another process held the catalog file for longer than the writer waits."""

    def __init__(self, path: Path, waited_s: float, cause: str) -> None:
        self.path = str(path)
        self.waited_s = waited_s
        self.cause = cause
        super().__init__(
            f"{path} stayed locked for {waited_s:.1f} s ({cause}): close the other process's DuckDB "
            "connection to it (readers should use Store.query, which never opens it), then retry"
        )


def applied(conn: duckdb.DuckDBPyConnection) -> list[str]:
    """Return the names of the migrations recorded in ``conn``'s catalog, oldest first.

    Args:
        conn: A connection to the catalog; the ``migrations`` table is created when missing.
    """
    conn.execute(_LEDGER)
    rows = conn.execute("SELECT name FROM migrations ORDER BY applied_at, name").fetchall()
    return [str(row[0]) for row in rows]


def migrate(conn: duckdb.DuckDBPyConnection) -> list[str]:
    """Apply the migrations missing from ``conn``'s catalog, in order, each in its own transaction.

    Idempotent: a second call applies nothing. The caller must be the catalog's only writer (DuckDB's
    file lock guarantees it across processes, ``open_catalog`` within one).

    Args:
        conn: A read-write connection to the catalog.

    Returns:
        The names applied by this call (empty when the catalog was up to date).

    Raises:
        StoreError: The catalog records migrations this code does not know (a newer Flux wrote it), or a
            migration failed.
    """
    done = set(applied(conn))
    unknown = sorted(done - {name for name, _ in MIGRATIONS})
    if unknown:
        raise StoreError(
            f"the catalog has migrations {unknown} that this Flux does not know: a newer Flux wrote it; "
            "upgrade Flux, or move catalog.duckdb aside and run Store.reindex()"
        )
    new: list[str] = []
    for name, sql in MIGRATIONS:
        if name not in done:
            _apply(conn, name, sql)
            new.append(name)
    return new


def _apply(conn: duckdb.DuckDBPyConnection, name: str, sql: str) -> None:
    """Run one migration and record it, atomically."""
    conn.execute("BEGIN TRANSACTION")
    try:
        conn.execute(sql)
        conn.execute("INSERT INTO migrations (name) VALUES (?)", [name])
        conn.execute("COMMIT")
    except duckdb.Error as exc:
        conn.execute("ROLLBACK")
        raise StoreError(f"catalog migration {name} failed: {exc}") from exc
    logger.info("applied catalog migration %s", name)


@contextmanager
def open_catalog(path: Path, lock_timeout_s: float) -> Iterator[duckdb.DuckDBPyConnection]:
    """Open the catalog read-write and migrated, for the length of the ``with`` block only.

    Waits with jittered exponential backoff while another process holds the file's lock.

    Args:
        path: The catalog file (created when missing).
        lock_timeout_s: How long to wait for another process to release the file.

    Raises:
        CatalogBusy: The file stayed locked for ``lock_timeout_s``.
    """
    start = time.monotonic()
    with _write_lock(path), _process_lock(path, lock_timeout_s):
        conn = _connect(path, lock_timeout_s - (time.monotonic() - start))
        try:
            migrate(conn)
            yield conn
        finally:
            conn.close()


@contextmanager
def _process_lock(path: Path, lock_timeout_s: float) -> Iterator[None]:
    """Hold ``path``'s sidecar lock file (``catalog.duckdb.lock``) from before DuckDB opens the catalog until after
    it has closed it. DuckDB's own lock alone let a writer open the file while the last one was still closing it:
    four processes writing at once (tests/artifacts/test_store.py) once failed with "Could not read enough bytes
    from file catalog.duckdb"."""
    lock = path.with_name(path.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _retry(path, lock_timeout_s, lambda: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB), BlockingIOError,
               lambda _: f"another Flux process holds {lock.name}")
        yield
    finally:
        os.close(fd)  # releases the lock


def _connect(path: Path, lock_timeout_s: float) -> duckdb.DuckDBPyConnection:
    """Connect, retrying while the file is locked (``duckdb.IOException``: the lock conflict's type; it carries no
    finer code)."""
    return _retry(path, lock_timeout_s, lambda: duckdb.connect(str(path)), duckdb.IOException, str)


def _retry(path: Path, lock_timeout_s: float, attempt: Callable[[], T], busy: type[Exception],
           why: Callable[[Exception], str]) -> T:
    """``attempt()`` until it does not raise ``busy``, with jittered exponential backoff (10 ms up to 250 ms).

    Raises:
        CatalogBusy: The next wait would end past ``lock_timeout_s``.
    """
    start, delay = time.monotonic(), 0.01
    while True:
        try:
            return attempt()
        except busy as exc:
            waited = time.monotonic() - start
            if waited + delay > lock_timeout_s:
                raise CatalogBusy(path, waited, why(exc)) from exc
            time.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, 0.25)


def _write_lock(path: Path) -> threading.Lock:
    """This process's lock for one catalog file."""
    with _WRITE_LOCKS_GUARD:
        return _WRITE_LOCKS.setdefault(str(path.resolve()), threading.Lock())


def write_rows(
    conn: duckdb.DuckDBPyConnection, entries: list[Entry], stale: list[tuple[str, str, str]] | None = None
) -> None:
    """Insert rows (a row already there is kept: first write wins) and delete stale ones, in one transaction.

    Args:
        conn: A connection from ``open_catalog``.
        entries: Rows to insert.
        stale: ``(format, kind, id)`` of rows to delete.

    Raises:
        StoreError: The catalog rejected the change (nothing was changed).
    """
    rows = [
        [e.id, e.kind, e.format, e.created_at.isoformat(), e.path, e.bytes, canonical_json(e.meta)]
        for e in entries
    ]
    conn.execute("BEGIN TRANSACTION")
    try:
        if rows:
            conn.executemany(
                "INSERT INTO objects (id, kind, format, created_at, path, bytes, meta) "
                "VALUES (?, ?, ?, CAST(? AS TIMESTAMPTZ), ?, ?, ?) ON CONFLICT DO NOTHING",
                rows,
            )
        if stale:
            conn.executemany(
                "DELETE FROM objects WHERE format = ? AND kind = ? AND id = ?", [list(s) for s in stale]
            )
        conn.execute("COMMIT")
    except duckdb.Error as exc:
        conn.execute("ROLLBACK")
        raise StoreError(f"cannot update the catalog: {exc}") from exc


def recorded_keys(conn: duckdb.DuckDBPyConnection) -> set[tuple[str, str, str]]:
    """Return ``(format, kind, id)`` of every catalog row.

    Args:
        conn: A connection from ``open_catalog``.
    """
    rows = conn.execute("SELECT format, kind, id FROM objects").fetchall()
    return {(str(f), str(k), str(i)) for f, k, i in rows}


def export_index(conn: duckdb.DuckDBPyConnection, dest: Path) -> None:
    """Write the catalog's ``objects`` table to ``dest`` as Parquet (``INDEX_SCHEMA`` columns).

    Args:
        conn: A connection from ``open_catalog``.
        dest: The file to write; the caller publishes it atomically.
    """
    cols = ", ".join(INDEX_SCHEMA.names)
    target = str(dest).replace("'", "''")
    conn.execute(
        f"COPY (SELECT {cols} FROM objects ORDER BY kind, created_at, id) TO '{target}' (FORMAT parquet)"
    )


def journal_path(pending_dir: Path, fmt: Format, kind: str, oid: str) -> Path:
    """Return the journal file of one catalog row waiting to be recorded (kinds hold no '-').

    Args:
        pending_dir: The store's journal directory.
        fmt: The object's format.
        kind: The object's kind.
        oid: The object's id.
    """
    return pending_dir / f"{fmt}-{kind}-{oid}.json"


def load_entry(path: Path) -> Entry | None:
    """Return the row journaled in ``path``; None when it is missing or damaged (logged).

    Args:
        path: A journal file.
    """
    try:
        return Entry.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError) as exc:
        logger.warning("ignoring damaged catalog journal file %s: %s", path, exc)
        return None


def drain_journal(conn: duckdb.DuckDBPyConnection, pending_dir: Path) -> int:
    """Record every journaled row in the catalog, then delete the journal files.

    Args:
        conn: A connection from ``open_catalog``.
        pending_dir: The store's journal directory.

    Returns:
        How many journal files were drained.
    """
    try:
        files = [pending_dir / n for n in sorted(os.listdir(pending_dir)) if not n.startswith(".")]
    except FileNotFoundError:
        return 0
    write_rows(conn, [e for e in map(load_entry, files) if e is not None])
    for f in files:
        f.unlink(missing_ok=True)  # after the commit: a crash before here only repeats the inserts
    return len(files)
