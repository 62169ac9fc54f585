"""The arms of ``flux bench ttft`` (:mod:`tasks.bench.ttft`): the time to first token of the same prompts through
llama-cpp-python in its own process, through the plan's worker driven directly and through ``flux serve``.

Every arm reads each reply to its end before the next prompt, as a client that waits for its answer does.
Times are seconds.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from engine_bridge import ops
from engine_bridge.aclient import AsyncWorkerClient
from engine_bridge.sampling import GREEDY
from tasks.bench.context import BenchContext
from tasks.bench.errors import BenchError
from tasks.bench.http import FluxServe
from tasks.bench.inprocess import InProcess


def flux_server(ctx: BenchContext) -> FluxServe:
    """``flux serve`` of the plan (not started)."""
    return FluxServe(ctx.settings, ctx.plan.id, log_path=ctx.settings.logs_dir / "bench-ttft-serve.log",
                     start_timeout_s=ctx.timeout_s)


def in_process(ctx: BenchContext, prompts: list[str], max_tokens: int) -> list[float]:
    """TTFT of each prompt in llama-cpp-python's own process (streaming ``create_completion``)."""
    out = []
    with InProcess(ctx.model, ctx.params, log_path=ctx.settings.logs_dir / "bench-inprocess.log",
                   timeout_s=ctx.timeout_s) as llm:
        for text in prompts:
            got = llm.complete(text, max_tokens)
            if got.ttft_s is None:
                raise BenchError(f"in-process llama-cpp-python streamed no text for {text!r}")
            out.append(got.ttft_s)
    return out


async def started_worker(ctx: BenchContext) -> AsyncWorkerClient:
    """The plan's worker, started and serving the plan's model with its parameters."""
    w = AsyncWorkerClient(ctx.settings.logs_dir / "bench-ttft-worker.log", env=ctx.params.environment())
    await w.start()
    await w.request(ops.SERVE_LOAD, ops.ServeLoadArgs(model=str(ctx.model), params=ctx.params), timeout=ctx.timeout_s)
    return w


async def worker_first(w: AsyncWorkerClient, rid: str, text: str, max_tokens: int) -> tuple[float, float]:
    """(tokenize round trip, tokenize + generate to the first token event) of one prompt, read to its end."""
    t0 = time.perf_counter()
    ids = await w.tokenize(text, special=True, add_special=True, timeout=60)
    t1, first = time.perf_counter(), None
    args = ops.GenerateArgs.model_construct(rid=rid, prompt=ids, max_tokens=max_tokens, sampling=GREEDY)
    async for msg in w.generate(args, timeout=60):
        if msg["type"] == "token" and first is None:
            first = time.perf_counter()
    return t1 - t0, (first or time.perf_counter()) - t0


async def worker(ctx: BenchContext, prompts: list[str], max_tokens: int) -> tuple[list[float], list[float]]:
    """(tokenize round trips, TTFTs) of each prompt on the plan's worker driven directly."""
    w = await started_worker(ctx)
    tok, first = [], []
    try:
        for i, text in enumerate(prompts):
            t, f = await worker_first(w, f"r{i}", text, max_tokens)
            tok.append(t)
            first.append(f)
    finally:
        await w.close()
    return tok, first


def _has_text(line: str) -> bool:
    return line.startswith("data: {") and '"text":"' in line and '"text":""' not in line


async def http_first(c: httpx.AsyncClient, base: str, text: str, max_tokens: int) -> float:
    """TTFT of one streamed ``/v1/completions`` request through ``flux serve``, read to its end."""
    t0, first = time.perf_counter(), None
    body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    async with c.stream("POST", base + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():  # to the end: the next prompt must not find this one running
            if first is None and _has_text(line):
                first = time.perf_counter()
    if first is None:
        raise BenchError(f"flux serve streamed no text for {text!r}")
    return first - t0


async def http(ctx: BenchContext, prompts: list[str], max_tokens: int) -> list[float]:
    """TTFT of each prompt through ``flux serve`` over HTTP."""
    srv = flux_server(ctx)
    srv.start()
    try:
        async with httpx.AsyncClient(timeout=60) as c:
            return [await http_first(c, srv.base, text, max_tokens) for text in prompts]
    finally:
        srv.stop()


async def paired(ctx: BenchContext, prompts: list[str], rounds: int, max_tokens: int) -> tuple[list[float], list[float]]:
    """(worker TTFTs, HTTP TTFTs): one flux serve and one separate worker, each prompt of each round sent to both
    back to back, alternating which goes first; the last prompt warms both up."""
    srv = flux_server(ctx)
    srv.start()
    ws: list[float] = []
    hs: list[float] = []
    try:
        w = await started_worker(ctx)
        try:
            async with httpx.AsyncClient(timeout=60) as c:
                await http_first(c, srv.base, prompts[-1], max_tokens)
                await worker_first(w, "warm", prompts[-1], max_tokens)
                for r in range(rounds):
                    for i, text in enumerate(prompts[:-1]):
                        if (r + i) % 2:
                            hs.append(await http_first(c, srv.base, text, max_tokens))
                            ws.append((await worker_first(w, f"p{r}-{i}", text, max_tokens))[1])
                        else:
                            ws.append((await worker_first(w, f"p{r}-{i}", text, max_tokens))[1])
                            hs.append(await http_first(c, srv.base, text, max_tokens))
        finally:
            await w.close()
    finally:
        srv.stop()
    return ws, hs


async def busy(ctx: BenchContext, prompts: list[str], max_tokens: int) -> tuple[list[float], list[float]]:
    """(idle TTFTs, busy TTFTs): pairs of prompts, one on the idle server, the other while another reply decodes
    (two prompts: the second of one would find the first's cached prefix); the last prompt warms up."""
    srv = flux_server(ctx)
    srv.start()
    idle: list[float] = []
    loaded: list[float] = []
    long_body: dict[str, Any] = {"prompt": "Once upon a time", "max_tokens": 100000, "temperature": 0.0, "stream": True}
    try:
        async with httpx.AsyncClient(timeout=120) as c:
            await http_first(c, srv.base, prompts[-1], max_tokens)
            for t, u in zip(prompts[:-1:2], prompts[1:-1:2], strict=False):
                t, u = (t, u) if len(idle) % 2 else (u, t)
                idle.append(await http_first(c, srv.base, t, max_tokens))
                rid = f"bg-{len(loaded)}"
                async with c.stream("POST", srv.base + "/v1/completions", json=long_body,
                                    headers={"x-request-id": rid}) as bg:
                    lines = bg.aiter_lines()
                    while not (await lines.__anext__()).startswith('data: {"id'):
                        pass
                    loaded.append(await http_first(c, srv.base, u, max_tokens))
                await c.delete(srv.base + f"/v1/requests/{rid}")
    finally:
        srv.stop()
    return idle, loaded
