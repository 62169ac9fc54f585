"""The store: round trips, prefix ids, migrations, reindex, concurrent writers, readers beside a writer."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict

from artifacts.errors import NotFound, StoreError
from artifacts.ids import content_id
from artifacts.migrations import MIGRATIONS, CatalogBusy, applied, migrate
from artifacts.store import AmbiguousId, Store

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=15,
)


class Probe(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu: str
    cores: int
    bandwidth_gbs: float


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store")


def _catalog_rows(store: Store) -> set[tuple[str, str, str, str, int]]:
    conn = duckdb.connect(str(store.catalog_path), read_only=True)
    try:
        rows = conn.execute("SELECT format, kind, id, path, bytes FROM objects").fetchall()
    finally:
        conn.close()
    return {(str(f), str(k), str(i), str(p), int(b)) for f, k, i, p, b in rows}


def _files(store: Store) -> set[tuple[str, str, str, str, int]]:
    out = set()
    for fmt, top, suffix in (("json", "objects", ".json"), ("parquet", "tables", ".parquet")):
        for path in (store.data_dir / top).glob(f"*/*{suffix}"):
            rel = path.relative_to(store.data_dir).as_posix()
            out.add((fmt, path.parent.name, path.name[: -len(suffix)], rel, path.stat().st_size))
    return out


def _assert_consistent(store: Store) -> None:
    """Catalog rows == published files == exported index; nothing left pending or half-written."""
    files = _files(store)
    assert _catalog_rows(store) == files
    index = store.query("SELECT format, kind, id, path, bytes FROM objects").to_pylist()
    assert {(r["format"], r["kind"], r["id"], r["path"], r["bytes"]) for r in index} == files
    assert not list(store.pending_dir.glob("*"))
    assert not [p for p in store.data_dir.rglob(".*.tmp")]


# ------------------------------------------------------------------------------------------ round trips


@settings(max_examples=25, deadline=None)
@given(obj=st.dictionaries(st.text(max_size=8), JSON, max_size=5))
def test_put_get_round_trip(obj: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp))
        oid = store.put_json("probe", obj)
        assert oid == content_id(obj)
        assert store.get_json("probe", oid) == obj
        assert store.has("probe", oid)
        assert store.find("probe", oid[:6]) == oid
        assert [row["id"] for row in store.list("probe")] == [oid]


def test_model_and_dict_are_one_object(store: Store) -> None:
    probe = Probe(cpu="EPYC", cores=64, bandwidth_gbs=310.5)
    oid = store.put_json("probe", probe)
    assert oid == content_id(probe) == store.put_json("probe", probe.model_dump())
    assert Probe.model_validate(store.get_json("probe", oid)) == probe
    [row] = store.list("probe")
    assert row["meta"] == {"model": "Probe"}
    assert Path(row["path"]) == store.data_dir / "objects" / "probe" / f"{oid}.json"


def test_objects_are_immutable(store: Store) -> None:
    oid = store.put_json("plan", {"a": 1}, key="p1", meta={"note": "first"})
    path = store.data_dir / "objects" / "plan" / "p1.json"
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    assert store.put_json("plan", {"a": 2}, key="p1") == oid == "p1"
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before
    assert store.get_json("plan", "p1") == {"a": 1}
    assert store.list("plan")[0]["meta"] == {"note": "first"}


def test_tables_round_trip_and_query(store: Store) -> None:
    t1 = pa.table({"tok_s": [10.5, 11.0], "candidate": ["a", "b"]})
    t2 = pa.table({"tok_s": [9.0], "error": ["oom"]})
    path = store.put_table("trials", t1, key="run1")
    assert path == store.data_dir / "tables" / "trials" / "run1.parquet"
    store.put_table("trials", t2, key="run2")
    assert store.get_table("trials", "run1").equals(t1)
    assert store.put_table("trials", t2, key="run1") == path  # first write wins
    assert store.get_table("trials", "run1").equals(t1)
    rows = store.query("SELECT tok_s, candidate, error FROM trials ORDER BY tok_s").to_pylist()
    assert rows == [
        {"tok_s": 9.0, "candidate": None, "error": "oom"},
        {"tok_s": 10.5, "candidate": "a", "error": None},
        {"tok_s": 11.0, "candidate": "b", "error": None},
    ]
    listed = store.list("trials")
    assert [(r["id"], r["format"], r["meta"]) for r in listed] == [
        ("run1", "parquet", {"rows": 2, "columns": 2}),
        ("run2", "parquet", {"rows": 1, "columns": 2}),
    ]
    assert store.has("trials", "run2") and not store.has("trials", "run3")


def test_query_objects_view_and_errors(store: Store) -> None:
    assert store.query("SELECT count(*) AS n FROM objects").to_pylist() == [{"n": 0}]
    oid = store.put_json("plan", {"x": 1}, meta={"model": "m.gguf"})
    rows = store.query("SELECT id, kind, format, meta FROM objects").to_pylist()
    assert rows == [{"id": oid, "kind": "plan", "format": "json", "meta": '{"model":"m.gguf"}'}]
    with pytest.raises(StoreError, match="query failed"):
        store.query("SELECT * FROM no_such_table")


def test_missing_objects_raise_not_found(store: Store) -> None:
    with pytest.raises(NotFound, match=r"no plan object 'abc' in .*Store.find"):
        store.get_json("plan", "abc")
    with pytest.raises(NotFound, match="no trials table"):
        store.get_table("trials", "abc")
    with pytest.raises(NotFound):
        store.get_json("plan", "../../etc/passwd")
    assert store.list("plan") == []
    assert not store.has("plan", "abc")


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda s: s.put_json("Plan", {}), "invalid kind"),
        (lambda s: s.put_json("plan", {}, key="../x"), "invalid key"),
        (lambda s: s.put_json("plan", {}, key=".hidden"), "invalid key"),
        (lambda s: s.put_json("plan", {"x": float("nan")}), "cannot store plan"),
        (lambda s: s.put_json("plan", {}, meta={"big": "x" * 5000}), "keep it small"),
        (lambda s: s.put_table("objects", pa.table({"a": [1]}), key="k"), "catalog's view"),
        (lambda s: s.put_table("trials", [1, 2], key="k"), "pyarrow.Table"),
    ],
)
def test_bad_writes_are_refused_before_anything_is_written(store: Store, call: Any, match: str) -> None:
    with pytest.raises(StoreError, match=match):
        call(store)
    assert not store.data_dir.exists()


# ------------------------------------------------------------------------------------------ prefixes


def test_find_resolves_unique_prefixes(store: Store) -> None:
    for key in ("abc1", "abc2", "abd", "ab"):
        store.put_json("plan", {"k": key}, key=key)
    assert store.find("plan", "abd") == "abd"
    assert store.find("plan", "abc1") == "abc1"
    assert store.find("plan", "ab") == "ab"  # exact id wins over longer ones
    with pytest.raises(AmbiguousId) as info:
        store.find("plan", "abc")
    assert info.value.candidates == ["abc1", "abc2"]
    assert isinstance(info.value, NotFound) and "abc1, abc2" in str(info.value)
    with pytest.raises(NotFound, match="no plan id starts with 'zz'"):
        store.find("plan", "zz")
    with pytest.raises(NotFound):
        store.find("plan", "")


@settings(max_examples=15, deadline=None)
@given(
    ids=st.sets(st.text("0123456789abcdef", min_size=1, max_size=5), min_size=1, max_size=5),
    prefix=st.text("0123456789abcdef", min_size=1, max_size=3),
)
def test_find_agrees_with_a_linear_scan(ids: set[str], prefix: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp))
        for oid in ids:
            store.put_json("plan", {"id": oid}, key=oid)
        matches = sorted(i for i in ids if i.startswith(prefix))
        if prefix in ids or len(matches) == 1:
            assert store.find("plan", prefix) == (prefix if prefix in ids else matches[0])
        elif matches:
            with pytest.raises(AmbiguousId) as info:
                store.find("plan", prefix)
            assert info.value.candidates == matches
        else:
            with pytest.raises(NotFound):
                store.find("plan", prefix)


# ------------------------------------------------------------------------------------------ migrations


def test_migrations_are_idempotent(tmp_path: Path) -> None:
    conn = duckdb.connect(str(tmp_path / "c.duckdb"))
    try:
        names = [name for name, _ in MIGRATIONS]
        assert names == sorted(names) and names[:2] == ["m001_init", "m002_objects_kind_created_at"]
        assert migrate(conn) == names
        assert migrate(conn) == []
        assert applied(conn) == names
        indexes = conn.execute("SELECT index_name FROM duckdb_indexes()").fetchall()
        assert ("objects_kind_created_at",) in indexes
    finally:
        conn.close()


def test_migrate_applies_only_the_missing_ones(tmp_path: Path) -> None:
    conn = duckdb.connect(str(tmp_path / "c.duckdb"))
    try:
        applied(conn)
        name, sql = MIGRATIONS[0]
        conn.execute(sql)
        conn.execute("INSERT INTO migrations (name) VALUES (?)", [name])
        assert migrate(conn) == [n for n, _ in MIGRATIONS[1:]]
        conn.execute("INSERT INTO migrations (name) VALUES ('m999_from_the_future')")
        with pytest.raises(StoreError, match="newer Flux"):
            migrate(conn)
    finally:
        conn.close()


# ------------------------------------------------------------------------------------------ reindex


def test_reindex_rebuilds_a_lost_catalog(store: Store) -> None:
    a = store.put_json("plan", {"a": 1})
    store.put_table("trials", pa.table({"x": [1, 2, 3]}), key="t1")
    store.catalog_path.unlink()
    report = store.reindex()
    assert (report.added, report.removed, report.total) == (2, 0, 2)
    _assert_consistent(store)
    meta = {r["id"]: r["meta"] for r in store.list("trials")}
    assert meta == {"t1": {"rows": 3, "columns": 1}}
    (store.data_dir / "objects" / "plan" / f"{a}.json").unlink()
    assert store.reindex().removed == 1
    _assert_consistent(store)
    assert store.reindex().model_dump() == {"added": 0, "removed": 0, "total": 1}


# ------------------------------------------------------------------------------------------ concurrency


def _writer(data_dir: str, proc: int, n: int, start: Any) -> None:
    """One writer process: objects shared with the others, its own objects, a shared and an own table."""
    store = Store(Path(data_dir), lock_timeout_s=60)
    start.wait(timeout=120)  # all writers begin together
    for i in range(n):
        store.put_json("shared", {"i": i})
        store.put_json("own", {"proc": proc, "i": i}, meta={"proc": proc})
    store.put_table("trials", pa.table({"proc": [proc], "v": [1.0]}), key=f"p{proc}")
    store.put_table("trials", pa.table({"proc": [-1], "v": [0.0]}), key="common")


def test_concurrent_writers_keep_store_consistent(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    n, procs = 8, 4
    start = ctx.Barrier(procs)
    workers = [ctx.Process(target=_writer, args=(str(tmp_path), p, n, start)) for p in range(procs)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=300)
    assert [w.exitcode for w in workers] == [0] * procs
    store = Store(tmp_path)
    assert sorted(store.get_json("shared", r["id"])["i"] for r in store.list("shared")) == list(range(n))
    own = [store.get_json("own", r["id"]) for r in store.list("own")]
    assert sorted((o["proc"], o["i"]) for o in own) == [(p, i) for p in range(procs) for i in range(n)]
    assert len(store.query("SELECT * FROM trials").to_pylist()) == procs + 1
    _assert_consistent(store)


def test_threads_of_one_process_share_the_catalog(store: Store) -> None:
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(5):
                store.put_json("own", {"t": t, "i": i})
                store.put_json("shared", {"i": i})
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert len(store.list("own")) == 15 and len(store.list("shared")) == 5
    _assert_consistent(store)


# ------------------------------------------------------------------------------------------ locked catalog

_HOLDER = """
import sys, duckdb
conn = duckdb.connect(sys.argv[1])
conn.execute("SELECT count(*) FROM objects").fetchall()
print("holding", flush=True)
sys.stdin.read()
conn.close()
"""


@pytest.fixture
def held(store: Store) -> Iterator[Store]:
    """A store whose catalog another process holds open read-write for the test's duration."""
    store.put_json("plan", {"before": True})
    store.put_table("trials", pa.table({"x": [1]}), key="t0")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(store.catalog_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        yield store
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)


def test_readers_work_while_another_process_holds_the_catalog(held: Store) -> None:
    with pytest.raises(duckdb.IOException):  # the premise: the file really is locked
        duckdb.connect(str(held.catalog_path), read_only=True)
    [row] = held.list("plan")
    oid = row["id"]
    assert held.get_json("plan", oid) == {"before": True}
    assert held.has("plan", oid) and held.find("plan", oid[:5]) == oid
    assert held.get_table("trials", "t0").to_pylist() == [{"x": 1}]
    assert held.query("SELECT count(*) AS n FROM objects").to_pylist() == [{"n": 2}]
    assert held.query("SELECT sum(x) AS s FROM trials").to_pylist() == [{"s": 1}]


def test_write_while_catalog_is_held_publishes_and_journals(held: Store) -> None:
    busy = Store(held.data_dir, lock_timeout_s=0.3)
    oid = busy.put_json("plan", {"during": True}, meta={"note": "journaled"})
    assert busy.get_json("plan", oid) == {"during": True}
    assert json.loads((busy.pending_dir / f"json-plan-{oid}.json").read_text())["meta"] == {
        "note": "journaled"
    }
    listed = {r["id"]: r["meta"] for r in busy.list("plan")}
    assert listed[oid] == {"note": "journaled"}
    with pytest.raises(CatalogBusy, match="stayed locked"):
        busy.reindex()


def test_journal_drains_once_the_catalog_is_free(store: Store) -> None:
    busy = Store(store.data_dir, lock_timeout_s=0.3)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    store.put_json("plan", {"first": 1})
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(store.catalog_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    late = busy.put_json("plan", {"late": 1}, meta={"note": "kept"})
    assert holder.stdin is not None
    holder.stdin.close()
    holder.wait(timeout=60)
    store.put_json("plan", {"after": 1})
    _assert_consistent(store)
    assert {r["id"]: r["meta"] for r in store.list("plan")}[late] == {"note": "kept"}


_FLOCK_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("holding", flush=True)
sys.stdin.read()
"""


def test_a_writer_waits_for_the_catalogs_lock_file_from_open_to_close(store: Store) -> None:
    """Writers hold ``catalog.duckdb.lock`` from before DuckDB opens the catalog until after it closes it (CI once
    saw a writer read the catalog while the last one was closing it). Another process holding it makes a write
    wait, then leave its row in pending/ with the lock file named; the next write records it."""
    from artifacts.migrations import CatalogBusy, open_catalog

    first = store.put_json("plan", {"before": True})
    lock = store.catalog_path.with_name("catalog.duckdb.lock")
    assert lock.exists(), "a write made the lock file beside the catalog"
    holder = subprocess.Popen([sys.executable, "-c", _FLOCK_HOLDER, str(lock)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        t0 = time.monotonic()
        with pytest.raises(CatalogBusy, match="catalog.duckdb.lock"), open_catalog(store.catalog_path, 0.5):
            pass
        assert time.monotonic() - t0 >= 0.2, "it waited for the lock (up to one backoff step short of 0.5 s)"
        quick = Store(store.data_dir, lock_timeout_s=0.3)
        oid = quick.put_json("plan", {"while": "locked"})
        assert quick.get_json("plan", oid) == {"while": "locked"}
        assert list((store.data_dir / "pending").rglob("*.json")), "its catalog row waits in pending/"
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)
    store.put_json("plan", {"after": True})
    assert not list((store.data_dir / "pending").rglob("*.json")), "the next write recorded it"
    assert {r["id"] for r in store.list("plan")} >= {first, oid}
