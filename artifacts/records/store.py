"""The typed store: records put and read by their declared kind (:mod:`artifacts.records.kinds`).

``Records(store).get(PLAN, id)`` returns a :class:`~artifacts.records.plan.Plan`; ``find_by_prefix(PLAN, "3f2a")``
resolves the prefix a person typed (``flux show 3f2a``) and names the command that lists plans when none or
several match. The bytes are :class:`artifacts.store.Store`'s: a record is stored as its model's canonical JSON
under its content id (or the key given), exactly as an untyped ``put_json`` of the same model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from artifacts.errors import StoreError
from artifacts.records.kinds import Kind
from artifacts.store import Store

M = TypeVar("M", bound=BaseModel)


class Records:
    """The JSON records of one store, typed by kind."""

    def __init__(self, store: Store) -> None:
        """Read and write the records of ``store``."""
        self.store = store

    @classmethod
    def at(cls, data_dir: Path) -> Records:
        """The records of the store rooted at ``data_dir``."""
        return cls(Store(data_dir))

    def put(self, kind: Kind[M], obj: M, key: str | None = None, meta: dict[str, Any] | None = None) -> str:
        """Store ``obj`` as a ``kind`` record and return its id (its content id unless ``key`` is given).

        Raises:
            StoreError: ``obj`` is not the kind's model; the store could not write it.
        """
        if not isinstance(obj, kind.model):
            raise StoreError(f"a {kind.name} record is a {kind.model.__name__}, not a {type(obj).__name__}")
        return self.store.put_json(kind.name, obj, key=key, meta=meta)

    def has(self, kind: Kind[Any], oid: str) -> bool:
        """Whether a ``kind`` record is stored under id ``oid``."""
        return self.store.has(kind.name, oid)

    def get(self, kind: Kind[M], oid: str, check: Callable[[dict[str, Any]], None] | None = None) -> M:
        """The ``kind`` record stored under id ``oid``.

        Args:
            check: called with the stored JSON before it is parsed (the server checks a plan's integrity there).

        Raises:
            NotFound: no such record.
            StoreError: the stored JSON is not a valid record of the kind's model.
        """
        raw = self.store.get_json(kind.name, oid)
        if check is not None:
            check(raw)
        try:
            return kind.model.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "the record"
            raise StoreError(
                f"{kind.name} {oid} in {self.store.data_dir} is not a {kind.model.__name__} ({where}: {first['msg']}): "
                "it was written by another version of Flux or by hand; make it again (`--replan` for a plan)"
            ) from exc

    def resolve(self, kind: Kind[Any], prefix: str) -> str:
        """The one stored ``kind`` id that starts with ``prefix`` (an exact id wins).

        Raises:
            NotFound: none does; the message names the command that lists them.
            AmbiguousId: several do; ``candidates`` lists them.
        """
        return self.store.find(kind.name, prefix, listed_by=kind.listing())

    def find_by_prefix(self, kind: Kind[M], prefix: str,
                       check: Callable[[dict[str, Any]], None] | None = None) -> M:
        """The one stored ``kind`` record whose id starts with ``prefix`` (see :meth:`resolve` and :meth:`get`)."""
        return self.get(kind, self.resolve(kind, prefix), check)

    def rows(self, kind: Kind[Any]) -> list[dict[str, Any]]:
        """The catalog's rows of ``kind``, oldest first (``id``, ``created_at``, ``meta``, ...: ``Store.list``)."""
        return self.store.list(kind.name)

    def all(self, kind: Kind[M]) -> list[M]:
        """Every stored ``kind`` record, oldest first.

        Raises:
            StoreError: one of them is not a valid record (:meth:`readable` lists the others).
        """
        return [self.get(kind, row["id"]) for row in self.rows(kind)]

    def readable(self, kind: Kind[M]) -> tuple[list[M], list[tuple[str, str]]]:
        """Every stored ``kind`` record that this version of Flux reads, oldest first, and (id, why) of each one
        it does not (written by another version or by hand): a listing shows the others and names these."""
        good: list[M] = []
        bad: list[tuple[str, str]] = []
        for row in self.rows(kind):
            try:
                good.append(self.get(kind, row["id"]))
            except StoreError as exc:
                bad.append((str(row["id"]), str(exc)))
        return good, bad
