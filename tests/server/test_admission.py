"""Admission (bounded concurrency + bounded wait queue) and the context check, without a worker."""

from __future__ import annotations

import asyncio

import pytest

from server.errors import ContextLengthExceeded, QueueFull, Unavailable
from server.prompts import reply_tokens
from server.supervisor import Admission, Ticket


def test_reply_room_is_min_of_max_tokens_and_min_reply() -> None:
    assert reply_tokens(100, None, 1024, 64) == 924  # no limit: the rest of the context
    assert reply_tokens(100, 50, 1024, 64) == 50
    assert reply_tokens(900, 5000, 1024, 64) == 124  # needs room for min(5000, 64); capped by what is left


def test_context_exceeded_names_both_numbers() -> None:
    with pytest.raises(ContextLengthExceeded) as exc:
        reply_tokens(1000, None, 1024, 64)
    assert exc.value.status == 400 and exc.value.code == "context_length_exceeded"
    assert "1024" in exc.value.message and "1000" in exc.value.message
    assert reply_tokens(1000, 24, 1024, 64) == 24  # a small max_tokens needs only its own room
    with pytest.raises(ContextLengthExceeded):
        reply_tokens(1024, 1, 1024, 64)


def test_queue_bounds_and_fifo() -> None:
    async def run() -> None:
        adm = Admission(slots=2, queue_max=2, wait_s=0.3)
        await adm.acquire()
        await adm.acquire()
        assert adm.active == 2
        order: list[int] = []

        async def waiter(i: int) -> None:
            await adm.acquire()
            order.append(i)

        w1 = asyncio.create_task(waiter(1))
        await asyncio.sleep(0)
        w2 = asyncio.create_task(waiter(2))
        await asyncio.sleep(0.01)
        assert adm.waiting == 2
        with pytest.raises(QueueFull) as full:
            await adm.acquire()
        assert full.value.status == 429 and "Retry-After" in full.value.headers
        adm.release(0.1)
        adm.release(0.1)
        await asyncio.gather(w1, w2)
        assert order == [1, 2] and adm.active == 2
        with pytest.raises(Unavailable) as late:
            await adm.acquire()
        assert late.value.status == 503 and late.value.code == "queue_timeout"
        assert adm.waiting == 0 and adm.active == 2
        adm.release(None)
        adm.release(None)
        assert adm.active == 0

    asyncio.run(run())


def test_cancelled_waiter_leaves_no_trace() -> None:
    async def run() -> None:
        adm = Admission(slots=1, queue_max=4, wait_s=5)
        await adm.acquire()
        t = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert adm.waiting == 0
        adm.release(None)
        assert adm.active == 0

    asyncio.run(run())


def test_a_withdrawn_ticket_leaves_the_queue_at_once_holding_nothing() -> None:
    async def run() -> None:
        adm = Admission(slots=1, queue_max=4, wait_s=5)
        assert await adm.acquire() is True
        first, second = Ticket(), Ticket()
        waits = [asyncio.create_task(adm.acquire(t)) for t in (first, second)]
        await asyncio.sleep(0.01)
        assert adm.waiting == 2
        first.withdraw()
        assert await asyncio.wait_for(waits[0], 1) is False, "out of the queue at once, not after wait_s"
        assert adm.waiting == 1
        adm.release(None)
        assert await waits[1] is True and adm.active == 1, "the slot went to the next in line"
        assert await adm.acquire(first) is False, "a withdrawn ticket never gets a slot"
        adm.release(None)
        assert adm.active == 0

    asyncio.run(run())


def test_a_ticket_withdrawn_as_its_slot_is_handed_over_gives_it_on() -> None:
    async def run() -> None:
        adm = Admission(slots=1, queue_max=4, wait_s=5)
        await adm.acquire()
        ticket = Ticket()
        wait = asyncio.create_task(adm.acquire(ticket))
        await asyncio.sleep(0.01)
        adm.release(None)  # hands the slot to the waiter ...
        ticket.withdraw()  # ... which is withdrawn before it resumes
        assert await wait is False and adm.active == 0

    asyncio.run(run())


def test_a_task_cancelled_while_its_ticket_waits_is_still_cancelled() -> None:
    async def run() -> None:
        adm = Admission(slots=1, queue_max=4, wait_s=5)
        await adm.acquire()
        ticket = Ticket()
        wait = asyncio.create_task(adm.acquire(ticket))
        await asyncio.sleep(0.01)
        ticket.withdraw()
        wait.cancel()  # a shutdown as well: the task's own cancel wins
        with pytest.raises(asyncio.CancelledError):
            await wait
        assert adm.waiting == 0

    asyncio.run(run())

