"""The content-addressed store: immutable JSON objects and Parquet tables, indexed by a DuckDB catalog.

Layout under ``data_dir``: ``catalog.duckdb`` (writers only, opened briefly per write, one process at a time
under ``catalog.duckdb.lock``),
``objects/<kind>/<id>.json`` and ``tables/<kind>/<id>.parquet`` (immutable), ``index/objects.parquet`` (the
catalog's rows exported for readers after each write), ``pending/`` (journal of rows not yet in the catalog).

Files are the truth, published atomically (temp file + ``os.replace``). A write journals its catalog row,
then records every journaled row; when another process holds the catalog too long the row waits for the next
write or ``reindex``. Readers never open the catalog (DuckDB's lock would fail them while a writer holds it).
"""

from __future__ import annotations

import builtins
import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict

from artifacts.errors import NotFound, StoreError
from artifacts.ids import canonical_json, content_id
from artifacts.migrations import (
    INDEX_SCHEMA,
    CatalogBusy,
    Entry,
    Format,
    drain_journal,
    export_index,
    journal_path,
    load_entry,
    open_catalog,
    recorded_keys,
    write_rows,
)
from artifacts.store_files import (
    _ID_RE,
    _check_id,
    _check_kind,
    _check_meta,
    _listdir,
    _publish,
    _sql_str,
    _subdirs,
)
from artifacts.store_views import FILENAME_KINDS, NAMED_VIEWS

logger = logging.getLogger(__name__)

__all__ = ["AmbiguousId", "CatalogBusy", "Entry", "ReindexReport", "Store"]

_LAYOUT: dict[Format, tuple[str, str]] = {"json": ("objects", ".json"), "parquet": ("tables", ".parquet")}
RESERVED_TABLE_KINDS = frozenset({"objects"})  # the catalog's view in query()


def _how_to_list(kind: str) -> str:
    """The command a person runs to see what of ``kind`` is stored (a record kind may name a better one)."""
    return f"`flux sql \"SELECT id FROM objects WHERE kind = '{kind}'\"`"


class AmbiguousId(NotFound):
    """An id prefix matches several stored objects."""

    def __init__(self, kind: str, prefix: str, candidates: list[str]) -> None:
        self.kind = kind
        self.prefix = prefix
        self.candidates = candidates
        shown = ", ".join(candidates[:10]) + (", ..." if len(candidates) > 10 else "")
        super().__init__(f"{kind} id prefix '{prefix}' matches {len(candidates)} ids ({shown}): type more")


class ReindexReport(BaseModel):
    """What ``Store.reindex`` changed in the catalog."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    added: int
    removed: int
    total: int


class Store:
    """Immutable JSON objects and Parquet tables under one directory, with a DuckDB catalog."""

    def __init__(self, data_dir: Path, lock_timeout_s: float = 5.0) -> None:
        """Use the store rooted at ``data_dir``; nothing is created before the first write.

        Args:
            data_dir: The store's root directory.
            lock_timeout_s: How long a write waits for another process to release the catalog.
        """
        self.data_dir = Path(data_dir).resolve()
        self.lock_timeout_s = lock_timeout_s
        self.catalog_path = self.data_dir / "catalog.duckdb"
        self.index_path = self.data_dir / "index" / "objects.parquet"
        self.pending_dir = self.data_dir / "pending"

    def put_json(
        self,
        kind: str,
        obj: BaseModel | dict[str, Any],
        key: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> str:
        """Store a JSON object as ``objects/<kind>/<id>.json`` and return its id; no-op if already stored.

        Args:
            kind: Object kind, ``[a-z][a-z0-9_]*`` (e.g. ``plan``).
            obj: A pydantic model or a JSON-like dict; a model and its ``model_dump`` get the same id.
            key: The id; defaults to ``content_id(obj)``. With a key the first write wins.
            meta: A small JSON dict (at most 4 KiB) recorded in the catalog.

        Raises:
            StoreError: Invalid kind, key or meta; content without canonical JSON; a failed write.
        """
        _check_kind(kind)
        _check_meta(kind, meta)
        try:
            oid = content_id(obj) if key is None else _check_id(key)
            data = (canonical_json(obj) + "\n").encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise StoreError(f"cannot store {kind}: {exc}") from exc
        path = self._file(kind, "json", oid)
        if path.exists():
            logger.debug("%s %s is stored already: kept", kind, oid)
            return oid
        _publish(path, lambda tmp: tmp.write_bytes(data))
        extra = {"model": type(obj).__name__} if isinstance(obj, BaseModel) else {}
        self._record(kind, "json", oid, {**extra, **(meta or {})})
        return oid

    def put_table(self, kind: str, table: pa.Table, key: str, meta: dict[str, Any] | None = None) -> Path:
        """Store a table as ``tables/<kind>/<key>.parquet`` and return its path; no-op if already stored.

        Args:
            kind: Table kind, ``[a-z][a-z0-9_]*`` but not ``objects``; its view name in ``query``.
            table: The rows.
            key: The table's id, normally the content id of its inputs; the first write wins.
            meta: A small JSON dict (at most 4 KiB) recorded in the catalog, besides rows and columns.

        Raises:
            StoreError: Invalid kind, key, meta or table; a failed write.
        """
        _check_kind(kind)
        if kind in RESERVED_TABLE_KINDS:
            raise StoreError(f"table kind '{kind}' is the catalog's view name: pick another kind")
        oid = _check_id(key)
        _check_meta(kind, meta)
        if not isinstance(table, pa.Table):
            raise StoreError(f"put_table({kind!r}) needs a pyarrow.Table, got {type(table).__name__}")
        path = self._file(kind, "parquet", oid)
        if path.exists():
            logger.debug("table %s %s is stored already: kept", kind, oid)
            return path
        _publish(path, lambda tmp: pq.write_table(table, tmp))
        shape = {"rows": table.num_rows, "columns": table.num_columns}
        self._record(kind, "parquet", oid, {**shape, **(meta or {})})
        return path

    def reindex(self) -> ReindexReport:
        """Make the catalog match the files: record unrecorded files, drop rows whose file is gone.

        A row rebuilt from a file (no journal entry left) has the file's mtime as ``created_at`` and only the
        meta the file holds (a table's shape). To rebuild from nothing, move ``catalog.duckdb`` aside first.

        Raises:
            CatalogBusy: Another process held the catalog for longer than ``lock_timeout_s``.
        """
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open_catalog(self.catalog_path, self.lock_timeout_s) as conn:
            drain_journal(conn, self.pending_dir)
            on_disk = {(fmt, kind, oid): path for fmt, kind, oid, path in self._scan()}
            recorded = recorded_keys(conn)
            stale = sorted(recorded - on_disk.keys())
            added = [self._unrecorded(*k, path) for k, path in on_disk.items() if k not in recorded]
            write_rows(conn, added, stale)
            _publish(self.index_path, lambda tmp: export_index(conn, tmp))
        logger.info("reindexed %s: %d rows added, %d removed", self.data_dir, len(added), len(stale))
        return ReindexReport(added=len(added), removed=len(stale), total=len(on_disk))

    def has(self, kind: str, oid: str) -> bool:
        """Return whether a JSON object or a table of ``kind`` is stored under id ``oid``."""
        _check_kind(kind)
        return bool(_ID_RE.fullmatch(oid)) and any(self._file(kind, fmt, oid).is_file() for fmt in _LAYOUT)

    def get_json(self, kind: str, oid: str) -> dict[str, Any]:
        """Return the stored JSON object ``kind``/``oid``.

        Raises:
            NotFound: No such object.
        """
        path = self._existing(kind, "json", oid)
        try:
            value = json.loads(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise StoreError(f"cannot read {path}: {exc}") from exc
        if not isinstance(value, dict):
            raise StoreError(f"{path} does not hold a JSON object: was it written by hand?")
        return value

    def get_table(self, kind: str, oid: str) -> pa.Table:
        """Return the stored table ``kind``/``oid``.

        Raises:
            NotFound: No such table.
        """
        path = self._existing(kind, "parquet", oid)
        try:
            return pq.read_table(path)
        except (OSError, pa.ArrowException) as exc:
            raise StoreError(f"cannot read {path}: {exc}") from exc

    def find(self, kind: str, id_prefix: str, listed_by: str | None = None) -> str:
        """Resolve an id prefix (``flux show 3f2a``) to the one stored id of ``kind`` it starts.

        An exact id wins even when it also starts longer ids. ``listed_by``: the command that lists what of
        ``kind`` is stored, for the message (default: a ``flux sql`` query of the catalog).

        Raises:
            NotFound: No stored id starts with the prefix.
            AmbiguousId: Several do; ``candidates`` lists them.
        """
        _check_kind(kind)
        ids = sorted({oid for _, _, oid, _ in self._scan(kind) if oid.startswith(id_prefix)})
        if id_prefix in ids:
            return id_prefix
        if id_prefix and len(ids) == 1:
            return ids[0]
        if id_prefix and ids:
            raise AmbiguousId(kind, id_prefix, ids)
        raise NotFound(f"no {kind} id starts with '{id_prefix}' in {self.data_dir}; "
                       f"{listed_by or _how_to_list(kind)} lists them")

    def list(self, kind: str) -> builtins.list[dict[str, Any]]:
        """Return one row per stored object and table of ``kind``, oldest first.

        Rows have ``id, kind, format, created_at`` (UTC), ``path`` (absolute), ``bytes`` and ``meta``.
        Files the catalog has not recorded yet are listed too, from their journal entry or the file.
        """
        _check_kind(kind)
        indexed = {(e.format, e.id): e for e in self._index_entries(kind)}
        out: builtins.list[Entry] = []
        for fmt, _, oid, path in self._scan(kind):
            out.append(indexed.get((fmt, oid)) or self._unrecorded(fmt, kind, oid, path))
        out.sort(key=lambda e: (e.created_at, e.id))
        return [{**e.model_dump(), "path": str(self.data_dir / e.path)} for e in out]

    def query(self, sql: str) -> pa.Table:
        """Run SQL in an in-memory DuckDB over the store's Parquet files; the catalog is not opened.

        Views: one per table kind (its tables unioned by column name); ``objects``: the catalog's rows.

        Raises:
            StoreError: The query failed.
        """
        conn = duckdb.connect()
        try:
            self._create_views(conn)
            rel = conn.sql(sql)
            return pa.table({}) if rel is None else rel.to_arrow_table()
        except duckdb.Error as exc:
            raise StoreError(f"query failed: {' '.join(str(exc).split())}") from exc
        finally:
            conn.close()

    def _file(self, kind: str, fmt: Format, oid: str) -> Path:
        """Path of an object's file."""
        top, suffix = _LAYOUT[fmt]
        return self.data_dir / top / kind / f"{oid}{suffix}"

    def _existing(self, kind: str, fmt: Format, oid: str) -> Path:
        """Path of a stored object's file, or NotFound."""
        _check_kind(kind)
        path = self._file(kind, fmt, oid) if _ID_RE.fullmatch(oid) else None
        if path is None or not path.is_file():
            what = "table" if fmt == "parquet" else "object"
            raise NotFound(
                f"no {kind} {what} '{oid}' in {self.data_dir}: check the id (Store.find resolves a prefix)"
            )
        return path

    def _scan(self, kind: str | None = None) -> Iterator[tuple[Format, str, str, Path]]:
        """Yield (format, kind, id, path) of every published file, optionally of one kind."""
        for fmt, (top, suffix) in _LAYOUT.items():
            root = self.data_dir / top
            for k in [kind] if kind is not None else _subdirs(root):
                for name in _listdir(root / k):
                    if name.endswith(suffix) and not name.startswith("."):
                        yield fmt, k, name[: -len(suffix)], root / k / name

    def _record(self, kind: str, fmt: Format, oid: str, meta: dict[str, Any]) -> None:
        """Journal the catalog row of a just-published file, then record every journaled row."""
        entry = self._entry(fmt, kind, oid, self._file(kind, fmt, oid), meta)
        data = entry.model_dump_json().encode("utf-8")
        _publish(journal_path(self.pending_dir, fmt, kind, oid), lambda tmp: tmp.write_bytes(data))
        try:
            with open_catalog(self.catalog_path, self.lock_timeout_s) as conn:
                drain_journal(conn, self.pending_dir)
                _publish(self.index_path, lambda tmp: export_index(conn, tmp))
        except CatalogBusy as exc:
            logger.warning("%s; %s %s is stored, its catalog row waits in pending/", exc, kind, oid)

    def _entry(
        self, fmt: Format, kind: str, oid: str, path: Path, meta: dict[str, Any] | None = None
    ) -> Entry:
        """A catalog row for a published file."""
        st = path.stat()
        if meta is None and fmt == "parquet":
            md = pq.read_metadata(path)
            meta = {"rows": md.num_rows, "columns": md.num_columns}
        return Entry(
            id=oid,
            kind=kind,
            format=fmt,
            created_at=datetime.fromtimestamp(st.st_mtime, UTC),  # publish time
            path=path.relative_to(self.data_dir).as_posix(),
            bytes=st.st_size,
            meta=meta or {},
        )

    def _unrecorded(self, fmt: Format, kind: str, oid: str, path: Path) -> Entry:
        """The row of a file the catalog lacks: its journal entry, else what the file says."""
        return load_entry(journal_path(self.pending_dir, fmt, kind, oid)) or self._entry(fmt, kind, oid, path)

    def _index_entries(self, kind: str) -> builtins.list[Entry]:
        """Catalog rows of one kind, from the exported index."""
        try:
            table = pq.read_table(self.index_path, filters=[("kind", "==", kind)])
        except FileNotFoundError:
            return []
        return [Entry.model_validate({**r, "meta": json.loads(r["meta"])}) for r in table.to_pylist()]

    def _create_views(self, conn: duckdb.DuckDBPyConnection) -> None:
        """The query() views: one per table kind, ``objects`` over the index, and the named views of
        :data:`NAMED_VIEWS` (plans, probes, trials with their plan) over the JSON objects they need."""
        root = self.data_dir / "tables"
        for kind in _subdirs(root):
            if kind in RESERVED_TABLE_KINDS or not any(n.endswith(".parquet") for n in _listdir(root / kind)):
                continue
            glob = _sql_str(root / kind / "*.parquet")
            named = ", filename=true" if kind in FILENAME_KINDS else ""  # joined on their file's key
            conn.execute(f"CREATE VIEW \"{kind}\" AS FROM read_parquet('{glob}', union_by_name=true{named})")
        if self.index_path.is_file():
            conn.execute(f"CREATE VIEW objects AS SELECT * FROM read_parquet('{_sql_str(self.index_path)}')")
        else:
            conn.register("objects", INDEX_SCHEMA.empty_table())
        for name, (needs, sql) in NAMED_VIEWS.items():
            if not all(self._has_any(kind) for kind in needs):
                continue
            try:
                conn.execute(f"CREATE VIEW {name} AS " + sql.format(**{
                    k: _sql_str(self.data_dir / "objects" / k / "*.json") for k in ("plan", "probe")}))
            except duckdb.Error as exc:  # objects not shaped as plans or probes (a test's, a foreign file's)
                logger.debug("no view %s: %s", name, exc)

    def views(self) -> builtins.list[str]:
        """The names query() can select from now (table kinds with data, the named views, ``objects``)."""
        conn = duckdb.connect()
        try:
            self._create_views(conn)
            return sorted(r[0] for r in conn.sql("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall())
        finally:
            conn.close()

    def _has_any(self, kind: str) -> bool:
        """Whether a JSON kind has objects, or a table kind has Parquet files."""
        for sub, ext in (("objects", ".json"), ("tables", ".parquet")):
            if any(n.endswith(ext) for n in _listdir(self.data_dir / sub / kind)):
                return True
        return False

