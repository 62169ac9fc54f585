"""AsyncWorkerClient over a real worker subprocess: multiplexing, cancellation, faults.

Each test runs its own event loop with ``asyncio.run`` (no pytest-asyncio). One llama.cpp thread: this
2-core box is shared (see test_batch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from artifacts.engine_params import EngineParams
from engine_bridge.aclient import AsyncWorkerClient
from engine_bridge.errors import EngineError, WorkerDied, WorkerTimeout
from engine_bridge.protocol import PROTOCOL_VERSION
from tests.engine_bridge.sinks import gen_args

PARAMS = EngineParams(n_ctx=4096, n_seq_max=4, n_batch=256, n_ubatch=256, n_threads=1, n_threads_batch=1)
Body = Callable[[AsyncWorkerClient], Awaitable[None]]


def with_worker(tmp_path: Path, model: Path | None, body: Body) -> None:
    """Run ``body`` against a started worker (serving ``model`` if given), then close it."""

    async def main() -> None:
        w = AsyncWorkerClient(tmp_path / "worker.log")
        await w.start()
        try:
            if model is not None:
                info = await w.call("serve_load", {"model": str(model), "params": PARAMS.model_dump(),
                                                   "park_bytes": 64 << 20})
                assert info["n_ctx"] == 4096 and info["n_seq_max"] == 4
            await body(w)
        finally:
            await w.close()

    asyncio.run(main())


async def collect(w: AsyncWorkerClient, args: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    events: list[dict[str, Any]] = []
    async for msg in w.stream("generate", args):
        if "result" in msg:
            return events, msg["result"]
        events.append(msg)
    raise AssertionError("no result")


async def wait_idle(w: AsyncWorkerClient, deadline_s: float = 2.0) -> dict[str, Any]:
    t0 = time.monotonic()
    while True:
        stats = await w.call("serve_stats")
        if stats["active"] == 0 or time.monotonic() - t0 > deadline_s:
            return stats
        await asyncio.sleep(0.01)


def test_concurrent_calls_are_multiplexed(tmp_path: Path, tiny_dense: Path) -> None:
    async def body(w: AsyncWorkerClient) -> None:
        prompt = (await w.call("tokenize", {"text": "Hello there, multiplexed world."}))["tokens"]
        streams = [asyncio.create_task(collect(w, gen_args(f"g{i}", prompt[i:], 600))) for i in range(3)]
        await asyncio.sleep(0)  # the generates are written first
        hello, tok, stats = await asyncio.gather(w.call("hello"), w.call("detokenize", {"tokens": prompt}),
                                                 w.call("serve_stats"))
        assert not all(s.done() for s in streams), "cheap calls are answered while generations run"
        assert hello["protocol"] == PROTOCOL_VERSION and tok["text"] == "Hello there, multiplexed world."
        assert stats["active"] >= 1
        for i, (events, result) in enumerate(await asyncio.gather(*streams)):
            assert result["finish_reason"] in ("length", "stop") and result["prompt_tokens"] == len(prompt) - i
            assert result["completion_tokens"] == len(events) > 0 and events[0]["type"] == "token"
        stats = await w.call("serve_stats")
        assert stats["max_batch_seqs"] >= 2 and stats["active"] == 0
        with pytest.raises(EngineError) as exc:
            await w.call("generate", gen_args("big", prompt, 5000))
        assert exc.value.code == "context_overflow"

    with_worker(tmp_path, tiny_dense, body)


def test_cancelling_the_consumer_cancels_the_generation(tmp_path: Path, tiny_dense: Path) -> None:
    async def body(w: AsyncWorkerClient) -> None:
        prompt = (await w.call("tokenize", {"text": "Cancel me soon."}))["tokens"]
        seen: list[dict[str, Any]] = []

        async def consume() -> None:
            async for ev in w.stream("generate", gen_args("c1", prompt, 3500)):
                seen.append(ev)

        task = asyncio.create_task(consume())
        while len(seen) < 3:
            await asyncio.sleep(0.001)
        task.cancel()  # e.g. the HTTP client went away
        with contextlib.suppress(asyncio.CancelledError):
            await task
        stats = await wait_idle(w)
        assert stats["active"] == 0 and stats["tokens_generated"] < 3500
        # closing a stream early (aclosing) cancels it too
        async with contextlib.aclosing(w.stream("generate", gen_args("c2", prompt, 3500))) as events:
            async for _ in events:
                break
        stats = await wait_idle(w)
        assert stats["active"] == 0 and stats["tokens_generated"] < 7000
        assert (await w.call("cancel", {"rid": "c2"}))["cancelled"] is False

    with_worker(tmp_path, tiny_dense, body)


def test_kill_during_stream_is_worker_died_promptly(tmp_path: Path, tiny_dense: Path) -> None:
    async def body(w: AsyncWorkerClient) -> None:
        prompt = (await w.call("tokenize", {"text": "Die while streaming."}))["tokens"]
        pid = w.pid
        assert pid
        other = asyncio.create_task(collect(w, gen_args("o", prompt, 3500)))
        t0 = 0.0
        with pytest.raises(WorkerDied) as exc:
            async for _ev in w.stream("generate", gen_args("k", prompt, 3500)):
                if not t0:
                    os.kill(pid, signal.SIGKILL)
                    t0 = time.monotonic()
        assert 0 < time.monotonic() - t0 < 1.0
        assert exc.value.returncode == -signal.SIGKILL
        with pytest.raises(WorkerDied):
            await other  # every pending call fails, not only the one that saw the death
        with pytest.raises(WorkerDied):
            await w.call("hello")  # and new calls fail at once
        assert await asyncio.wait_for(w.wait_exit(), 1.0) == -signal.SIGKILL and not w.alive

    with_worker(tmp_path, tiny_dense, body)


def test_timeout_kills_the_worker(tmp_path: Path) -> None:
    async def body(w: AsyncWorkerClient) -> None:
        pid = w.pid
        assert pid
        os.kill(pid, signal.SIGSTOP)  # a hung worker
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeout):
            await w.call("hello", timeout=0.5)
        assert await asyncio.wait_for(w.wait_exit(), 2.0) == -signal.SIGKILL
        assert time.monotonic() - t0 < 3 and not w.alive and w.returncode == -signal.SIGKILL

    with_worker(tmp_path, None, body)


def test_a_request_the_worker_does_not_take_times_out_on_write(tmp_path: Path) -> None:
    # [serve.worker_timeouts] write_s: a stopped worker stops reading its stdin; once the pipe and the
    # transport's buffer are full, the request cannot be delivered: kill the worker after write_s, even
    # though the answer's own timeout (60 s here) is far away.
    async def main() -> None:
        w = AsyncWorkerClient(tmp_path / "worker.log", write_timeout_s=1.0)
        await w.start()
        try:
            assert w.pid
            os.kill(w.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(WorkerTimeout) as exc:
                await w.call("tokenize", {"text": "x" * (4 << 20)}, timeout=60)
            assert "writing the request" in exc.value.message and exc.value.seconds == 1.0
            assert await asyncio.wait_for(w.wait_exit(), 2.0) == -signal.SIGKILL
            assert time.monotonic() - t0 < 5
        finally:
            await w.close()

    asyncio.run(main())


def test_wait_exit_and_clean_close(tmp_path: Path) -> None:
    async def main() -> None:
        w = AsyncWorkerClient(tmp_path / "worker.log")
        await w.start()
        waiter = asyncio.create_task(w.wait_exit())
        await asyncio.sleep(0.05)
        assert not waiter.done()
        w.kill()
        assert await asyncio.wait_for(waiter, 1.0) == -signal.SIGKILL
        await w.close()
        async with AsyncWorkerClient(tmp_path / "worker2.log") as w2:
            with pytest.raises(EngineError) as exc:
                await w2.call("serve_stats")
            assert exc.value.code == "not_loaded"
        assert w2.returncode == 0, "shutdown exits cleanly"

    asyncio.run(main())


def test_text_that_is_not_unicode_is_refused_before_it_is_sent(tmp_path: Path, tiny_moe: Path) -> None:
    """A lone surrogate cannot be UTF-8 encoded: a typed ``bad_request`` (the server's 400), nothing sent, the
    worker and the client's other calls unharmed."""

    async def body(w: AsyncWorkerClient) -> None:
        with pytest.raises(EngineError) as err:
            await w.tokenize("hello \ud800 there")
        assert err.value.code == "bad_request" and "surrogate" in err.value.message
        assert not w._pending, "no call left waiting for an answer"
        assert await w.tokenize("hello there") and w.alive

    with_worker(tmp_path, tiny_moe, body)
