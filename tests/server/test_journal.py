"""The journal: resume yields each later event exactly once; the byte budget and TTL evict completed requests."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from server.journal import EVENT_OVERHEAD_BYTES, Journal, RequestIdInUse


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _collect(j: Journal, rid: str, after: int) -> list[tuple[int, str]]:
    entry = j.get(rid)
    assert entry is not None and entry.done

    async def run() -> list[tuple[int, str]]:
        return [x async for ready in j.follow(entry, after) for x in ready]

    return asyncio.run(run())


@given(events=st.lists(st.text(max_size=20), max_size=30), after=st.integers(min_value=0, max_value=40))
@settings(max_examples=60, deadline=None, database=None)
def test_follow_after_n_yields_each_later_event_once(events: list[str], after: int) -> None:
    j = Journal(max_bytes=10**9, ttl_s=60)
    e = j.open("r")
    for data in events:
        j.append(e, data)
    j.finish(e)
    got = _collect(j, "r", after)
    assert got == [(i, d) for i, d in enumerate(events, start=1) if i > after]


Op = tuple[str, int, int]


@given(ops=st.lists(st.tuples(st.sampled_from(["open", "append", "finish", "tick"]), st.integers(0, 5),
                              st.integers(0, 300)), max_size=60),
       max_bytes=st.integers(0, 3000))
@settings(max_examples=80, deadline=None, database=None)
def test_budget_evicts_only_completed_oldest_first(ops: list[Op], max_bytes: int) -> None:
    clock = Clock()
    j = Journal(max_bytes=max_bytes, ttl_s=50, clock=clock)
    running: dict[str, object] = {}
    finished_order: list[str] = []
    for op, k, n in ops:
        rid = f"r{k}"
        if op == "open" and rid not in running:
            running[rid] = j.open(rid)
            if rid in finished_order:
                finished_order.remove(rid)
        elif op == "append" and rid in running:
            j.append(running[rid], "x" * n)  # type: ignore[arg-type]
        elif op == "finish" and rid in running:
            j.finish(running.pop(rid))  # type: ignore[arg-type]
            finished_order.append(rid)
        elif op == "tick":
            clock.t += n / 10
            j.sweep()
        for r in running:  # running requests are never evicted
            assert j.get(r) is running[r]
        kept = [r for r in finished_order if j.get(r) is not None]
        # what is kept is a suffix of the completion order (oldest evicted first)
        assert kept == finished_order[len(finished_order) - len(kept):]
        live = sum(e.nbytes for e in (j.get(r) for r in list(running) + kept) if e is not None)
        assert j.nbytes == live
        if kept:
            assert j.nbytes <= max_bytes or not kept


def test_ttl_expires_completed_requests() -> None:
    clock = Clock()
    j = Journal(max_bytes=10**6, ttl_s=5, clock=clock)
    e = j.open("a")
    j.append(e, "{}")
    clock.t = 100  # running: kept however old
    assert j.get("a") is e
    j.finish(e)
    clock.t = 104
    assert j.get("a") is e
    clock.t = 105.5
    assert j.get("a") is None
    assert j.nbytes == 0


def test_pressure_shortens_ttl_and_ids_are_exclusive_while_running() -> None:
    clock = Clock()
    j = Journal(max_bytes=10**6, ttl_s=600, clock=clock)
    e = j.open("a")
    try:
        j.open("a")
        raise AssertionError("a running id was reused")
    except RequestIdInUse:
        pass
    j.append(e, "abc")
    assert j.nbytes == 3 + EVENT_OVERHEAD_BYTES
    j.finish(e)
    clock.t = 11
    j.sweep(pressure=False)
    assert j.get("a") is not None
    j.sweep(pressure=True)
    assert j.get("a") is None
    assert j.open("a") is not e  # a completed id can be used again


def test_follow_is_live_until_finish() -> None:
    async def run() -> list[tuple[int, str]]:
        j = Journal(max_bytes=10**6, ttl_s=60)
        e = j.open("r")
        j.append(e, "one")
        got: list[tuple[int, str]] = []

        async def reader() -> None:
            async for ready in j.follow(e, 0):
                got.extend(ready)
                writes.append(len(ready))

        writes: list[int] = []
        task = asyncio.create_task(reader())
        await asyncio.sleep(0.01)
        j.append(e, "two")
        await asyncio.sleep(0.01)
        j.append(e, "three")
        j.append(e, "four")  # two events before the follower wakes: one write carries both
        j.finish(e)
        await asyncio.wait_for(task, 1)
        assert writes == [1, 1, 2], writes
        return got

    assert asyncio.run(run()) == [(1, "one"), (2, "two"), (3, "three"), (4, "four")]
