"""``flux bench soak``: hit a real ``flux serve`` with overload, cancellations, disconnects, resumes and faults.

The suite starts the plan's server as a subprocess (``python -m server <plan>``, the same process
``flux serve`` runs, with this process's settings) and sends ``--requests`` chat requests in waves of
``--concurrency-factor`` x the plan's concurrency at once, for at most ``--seconds``. Each request acts
out one client behavior (:data:`BEHAVIORS`): read the stream, ask for a whole response, cancel (close
the stream early), disconnect and resume (``GET /v1/requests/{id}/events?after=N``), or read slowly.
Unless faults are off, the worker is killed with SIGKILL once while idle (it must come back on its own)
and once in the middle of a long request (that request must end with an explicit error).

Every request ends in one outcome (:func:`classify`): ``completed``, ``errored`` (an OpenAI error body
or an SSE error event; a 429/503 must carry Retry-After), ``cancelled`` (closed early by the client; the
server confirmed the end), ``resumed`` (every later event arrived exactly once after a reconnect),
``hung`` (no byte for longer than the hang timeout) or ``lost`` (dropped with no explicit error and not
resumable). The verdict is pass iff nothing hung or was lost, every 429/503 said when to retry, the
server is still up and every sequence slot is free at the end.

:class:`FluxServe` (the server subprocess) and :func:`exchange` (one HTTP exchange as a client sees it)
are shared with ``flux bench arrivals``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import httpx
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from artifacts.corpus import load_prompts
from tasks.bench.context import BenchContext, Progress
from tasks.bench.errors import BenchError
from tasks.bench.host import load_avg
from tasks.bench.http import (  # noqa: F401 - some are re-exported for tests
    OUTCOMES,
    Exchange,
    FluxServe,
    OnEvent,
    Outcome,
    client_limits,
    error_body,
    exchange,
    finish_reason,
    json_object,
    serve_toml,
)
from tasks.bench.record import BenchRun, SummaryRow
from tasks.bench.registry import Suite
from tasks.bench.soak_outcomes import Fault, classify, fault_row

if TYPE_CHECKING:

    pass

log = logging.getLogger(__name__)



# -- the workload ---------------------------------------------------------------------------------------
BehaviorName = Literal["stream", "plain", "cancel", "disconnect", "slow", "victim"]


@dataclass(frozen=True)
class Behavior:
    """How a client treats its request: stream or not, close early, come back, read slowly."""

    weight: int
    stream: bool = True
    stop_after: int | None = None  # close the connection after this many events
    cancel: bool = False  # closing means "stop": only check that the server ended it
    slow: bool = False


BEHAVIORS: dict[BehaviorName, Behavior] = {
    "stream": Behavior(4), "plain": Behavior(1, stream=False), "cancel": Behavior(1, stop_after=2, cancel=True),
    "disconnect": Behavior(2, stop_after=3), "slow": Behavior(1, slow=True),
    "victim": Behavior(0),  # the long request the worker is killed under (faults only)
}


class SoakOptions(BaseModel):
    """How ``flux bench soak`` loads the server."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    requests: int = Field(40, ge=1, le=100_000)
    seconds: float = Field(90.0, gt=0, description="no new wave starts after this long")
    concurrency_factor: float = Field(3.0, ge=1.0, le=100.0, description="requests at once per sequence")
    faults: bool = True
    max_tokens: int = Field(32, ge=1)
    victim_tokens: int = Field(512, ge=8, description="reply length of the request the worker dies under")
    prompt_chars: int = Field(300, ge=1)
    slow_read_s: float = Field(0.1, ge=0, description="pause of the slow reader after each event")
    hang_s: float | None = Field(None, gt=0, description="default: 2 x [serve] queue_wait_s + 30")
    seed: int = 0


@dataclass(frozen=True)
class SoakRequest:
    """One request of the soak."""

    index: int
    wave: int
    behavior: BehaviorName
    prompt: str
    max_tokens: int

    @property
    def rid(self) -> str:
        """Its x-request-id."""
        return f"soak-{self.index:05d}"


def plan_waves(opts: SoakOptions, concurrency: int, n_ctx: int) -> list[list[SoakRequest]]:
    """The requests, in waves of ``concurrency_factor x concurrency`` (seeded); the last wave leads with the victim.

    Behaviors come from shuffled decks holding each behavior ``weight`` times, so every behavior occurs
    once in each ``sum(weights)`` requests.
    """
    rng = random.Random(opts.seed)
    size = max(concurrency + 1, math.ceil(opts.concurrency_factor * concurrency))
    texts = [p.text[: opts.prompt_chars] for p in load_prompts()]
    deck = [n for n, b in BEHAVIORS.items() for _ in range(b.weight)]
    behaviors: list[BehaviorName] = []
    while len(behaviors) < opts.requests:  # shuffled decks: every behavior once per sum(weights) requests
        rng.shuffle(deck)
        behaviors += deck
    reqs = [SoakRequest(i, i // size, behaviors[i], rng.choice(texts),
                        rng.randint(max(1, opts.max_tokens // 4), opts.max_tokens)) for i in range(opts.requests)]
    waves = [reqs[i:i + size] for i in range(0, len(reqs), size)]
    if opts.faults:
        v = waves[-1][0]
        waves[-1][0] = SoakRequest(v.index, v.wave, "victim", v.prompt, min(opts.victim_tokens, n_ctx // 2))
    return waves


# -- the soak -------------------------------------------------------------------------------------------
RAW_SCHEMA = pa.schema([
    ("index", pa.int32()), ("rid", pa.string()), ("wave", pa.int32()), ("behavior", pa.string()),
    ("max_tokens", pa.int32()), ("outcome", pa.string()), ("detail", pa.string()), ("status", pa.int32()),
    ("error_code", pa.string()), ("retry_after", pa.string()), ("events", pa.int32()),
    ("resumed_events", pa.int32()), ("finish_reason", pa.string()), ("first_event_ms", pa.float64()),
    ("total_ms", pa.float64()), ("max_gap_ms", pa.float64()),
])


class _Soak:
    """The soak's client side: waves of requests, the faults, and the end-of-run checks."""

    def __init__(self, srv: FluxServe, opts: SoakOptions, hang_s: float, progress: Progress | None) -> None:
        self.srv, self.opts, self.hang_s, self.progress = srv, opts, hang_s, progress
        self.rows: list[dict[str, Any]] = []
        self.faults: list[Fault] = []
        self.end: dict[str, Any] = {}
        self.skipped = 0
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        """The HTTP client of the running soak."""
        if self._client is None:
            raise BenchError("the soak's HTTP client is used outside run()")
        return self._client

    async def run(self, waves: list[list[SoakRequest]]) -> None:
        """Every wave (until the time is up), faults between and within them, then the checks."""
        deadline = time.monotonic() + self.opts.seconds
        limits = client_limits(max_connections=3 * len(waves[0]) + 8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.hang_s, connect=10.0), limits=limits) as client:
            self._client = client
            for w, wave in enumerate(waves):
                if time.monotonic() > deadline:
                    self.skipped = sum(len(x) for x in waves[w:])
                    break
                if self.opts.faults and w == min(1, len(waves) - 1):
                    await self._kill("kill-idle", w, wait_idle=True)
                if self.opts.faults and w == len(waves) - 1 and w > 0:
                    await self._recovered()  # the victim's wave starts with a live worker to kill under it
                if self.progress:
                    self.progress(f"soak: wave {w + 1}/{len(waves)}: {len(wave)} requests at once")
                cap = self.opts.seconds + 3 * self.hang_s
                self.rows += await asyncio.gather(*(self._bounded(r, cap) for r in wave))
            await self._recovered()
            self.end = await self._end_checks()

    async def _recovered(self) -> None:
        """Until every injected fault's worker came back (or its watcher gave up)."""
        for f in self.faults:
            if f.watcher is not None:
                await f.watcher

    async def _bounded(self, req: SoakRequest, cap: float) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            return await asyncio.wait_for(self._request(req), cap)
        except TimeoutError:
            return {"index": req.index, "rid": req.rid, "wave": req.wave, "behavior": req.behavior,
                    "max_tokens": req.max_tokens, "outcome": "hung", "detail": f"did not end within {cap:g} s",
                    "total_ms": (time.perf_counter() - t0) * 1e3}

    async def _request(self, req: SoakRequest) -> dict[str, Any]:
        """Send one request, act out its behavior, resume it if it ended early; its row."""
        b = BEHAVIORS[req.behavior]
        body = {"messages": [{"role": "user", "content": req.prompt}], "max_tokens": req.max_tokens,
                "seed": req.index, "stream": b.stream}
        hook = self._victim_hook(req.wave) if req.behavior == "victim" else None
        first = await exchange(self.client, "POST", f"{self.srv.base}/v1/chat/completions", body=body,
                               headers={"x-request-id": req.rid}, stop_after=b.stop_after,
                               read_delay_s=self.opts.slow_read_s if b.slow else 0.0, on_event=hook)
        resume = replay = None
        dropped = first.transport is not None and first.status in (None, 200)
        if not first.hung and ((first.sse and not first.done) or dropped):
            url = f"{self.srv.base}/v1/requests/{req.rid}/events"
            resume = await exchange(self.client, "GET", url, params={"after": len(first.events)})
            if resume.status == 200 and resume.done:
                replay = await exchange(self.client, "GET", url, params={"after": 0})
        outcome, detail = classify(first, resume, replay, b.cancel)
        err = (error_body(resume) if resume is not None and resume.status == 200 else None) or error_body(first)
        gap = first.max_gap_s
        return {"index": req.index, "rid": req.rid, "wave": req.wave, "behavior": req.behavior,
                "max_tokens": req.max_tokens, "outcome": outcome, "detail": detail, "status": first.status,
                "error_code": err.get("code") if err else None, "retry_after": first.retry_after,
                "events": len(first.events), "resumed_events": len(resume.events) if resume is not None else None,
                "finish_reason": finish_reason(first.events + (resume.events if resume is not None else [])),
                "first_event_ms": (first.times[0] - first.t0) * 1e3 if first.times else None,
                "total_ms": (time.perf_counter() - first.t0) * 1e3, "max_gap_ms": gap * 1e3 if gap is not None else None}

    def _victim_hook(self, wave: int) -> OnEvent:
        async def on_event(n: int) -> None:
            if n == 3:  # role chunk + two pieces of text: the generation is running
                await self._kill("kill-mid", wave, wait_idle=False)
        return on_event

    # -- faults ---------------------------------------------------------------------------------------
    async def _health(self) -> dict[str, Any]:
        try:
            return json_object((await self.client.get(f"{self.srv.base}/health", timeout=10.0)).text)
        except httpx.HTTPError:
            return {}

    async def _kill(self, kind: Literal["kill-idle", "kill-mid"], wave: int, wait_idle: bool) -> None:
        """SIGKILL the current worker (after the server went idle, if asked) and watch for its successor."""
        fault = Fault(kind=kind, wave=wave)
        self.faults.append(fault)
        if wait_idle and not await self._settle(self.hang_s):
            log.warning("soak: the server was not idle before %s", kind)
        fault.pid = (await self._health()).get("worker", {}).get("pid")
        if fault.pid is None:
            fault.error = "/health named no worker pid"
            return
        if self.progress:
            self.progress(f"soak: {kind}: SIGKILL worker {fault.pid}")
        try:
            os.kill(int(fault.pid), signal.SIGKILL)
        except ProcessLookupError as exc:
            fault.error = f"could not kill worker {fault.pid}: {exc}"
            return
        fault.watcher = asyncio.create_task(self._recovery(fault, time.perf_counter()))

    async def _recovery(self, fault: Fault, t_kill: float) -> None:
        """Wait for /health to report a live worker with another pid."""
        while time.perf_counter() - t_kill < 2 * self.hang_s:
            worker = (await self._health()).get("worker", {})
            if worker.get("alive") and worker.get("pid") not in (None, fault.pid):
                fault.new_pid, fault.recover_s = int(worker["pid"]), time.perf_counter() - t_kill
                return
            await asyncio.sleep(0.1)

    # -- end-of-run checks ----------------------------------------------------------------------------
    async def _stats(self) -> dict[str, Any]:
        try:
            return json_object((await self.client.get(f"{self.srv.base}/flux/stats", timeout=30.0)).text)
        except httpx.HTTPError:
            return {}

    async def _settle(self, timeout_s: float) -> bool:
        """Until no sequence is held and nothing waits (server and worker agree); False on timeout."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            s = await self._stats()
            worker = (s.get("worker") or {}).get("serve_stats") or {}
            if s and s.get("active") == 0 and (s.get("queue") or {}).get("length") == 0 and not worker.get("active"):
                return True
            await asyncio.sleep(0.1)
        return False

    async def _end_checks(self) -> dict[str, Any]:
        freed = await self._settle(min(self.hang_s, 30.0))
        health = await self._health()
        stats = await self._stats()
        return {"slots_freed": freed, "server_alive": self.srv.alive and health.get("status") == "ok",
                "requests": stats.get("requests"), "worker": {k: v for k, v in (stats.get("worker") or {}).items()
                                                              if k != "serve_stats"}}


# -- results --------------------------------------------------------------------------------------------
def _main_row(rows: list[dict[str, Any]], end: dict[str, Any], common: dict[str, Any]) -> SummaryRow:
    """The soak's verdict: pass iff nothing hung or was lost, every 429/503 had Retry-After, server up, slots free."""
    counts = Counter(str(r["outcome"]) for r in rows)
    no_retry = [r["index"] for r in rows if r.get("status") in (429, 503) and not r.get("retry_after")]
    problems = [f"{counts[o]} {o}" for o in ("hung", "lost") if counts[o]]
    problems += [f"429/503 without Retry-After: requests {no_retry}"] if no_retry else []
    problems += [] if end.get("server_alive") else ["the server is down after the soak"]
    problems += [] if end.get("slots_freed") else ["sequence slots still held (or requests queued) after the soak"]
    detail = ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts[o]) + (f"; FAIL: {'; '.join(problems)}"
                                                                            if problems else "")
    metrics = {**common, "outcomes": {o: counts[o] for o in OUTCOMES}, "end": end,
               "by_behavior": {b: dict(Counter(str(r["outcome"]) for r in rows if r["behavior"] == b))
                               for b in BEHAVIORS},
               "statuses": dict(Counter(str(r.get("status")) for r in rows)),
               "error_codes": dict(Counter(str(r["error_code"]) for r in rows if r.get("error_code")))}
    return SummaryRow(baseline="flux-serve", verdict="fail" if problems else "pass", detail=detail,
                      n_samples=len(rows), metrics=metrics)


def _fault_rows(soak: _Soak, common: dict[str, Any]) -> list[SummaryRow]:
    rows = [fault_row(f, soak.rows, common) for f in soak.faults]
    for kind in ("kill-idle", "kill-mid"):
        if soak.opts.faults and not any(f.kind == kind for f in soak.faults):
            why = "the soak ended before its wave (raise --seconds)" if soak.skipped else \
                "the request it waits for never streamed (see its row)"
            rows.append(SummaryRow(baseline=f"fault:{kind}", verdict="info", detail=f"not injected: {why}",
                                   metrics=common))
    return rows


def _n_ctx(srv: FluxServe) -> int:
    meta = httpx.get(f"{srv.base}/v1/models", timeout=30.0).json()["data"][0]["meta"]
    return int(meta["n_ctx"])


def bench_soak(ctx: BenchContext, opts: SoakOptions, progress: Progress | None = None) -> BenchRun:
    """Soak the plan's server; one row per request, a verdict row and one row per injected fault.

    Raises:
        BenchError: the server did not start (e.g. the plan does not match this machine).
    """
    serve = ctx.settings.serve
    hang_s = opts.hang_s or 2 * serve.queue_wait_s + 30.0
    srv = FluxServe(ctx.settings, ctx.plan.id, log_path=ctx.settings.logs_dir / "bench-serve.log",
                    start_timeout_s=ctx.timeout_s)
    load0, t0 = load_avg(), time.monotonic()
    start_s = srv.start()
    try:
        concurrency = ctx.plan.sequences
        waves = plan_waves(opts, concurrency, _n_ctx(srv))
        soak = _Soak(srv, opts, hang_s, progress)
        asyncio.run(soak.run(waves))
    finally:
        srv.stop()
    common = {"options": opts.model_dump(mode="json"), "concurrency": concurrency, "wave_size": len(waves[0]),
              "waves": len(waves), "hang_s": hang_s, "start_s": start_s, "seconds": time.monotonic() - t0,
              "not_sent": soak.skipped, "serve": {"queue_max": serve.queue_max, "queue_wait_s": serve.queue_wait_s},
              "load_avg_start": load0, "load_avg_end": load_avg(), "server_log": str(srv.log_path)}
    table = pa.Table.from_pylist([{f.name: r.get(f.name) for f in RAW_SCHEMA} for r in soak.rows], schema=RAW_SCHEMA)
    return BenchRun(suite="soak", ctx=ctx, rows=[_main_row(soak.rows, soak.end, common), *_fault_rows(soak, common)],
                    raw=table)


# -- flux bench soak ------------------------------------------------------------------------------------
SUITE = Suite(
    name="soak", help="hit flux serve with overload, cancellations, disconnects, resumes and injected faults",
    description="Starts the plan's server and sends waves of concurrency-factor x its concurrency requests at "
                "once: streams, whole responses, early closes, disconnects resumed with "
                "/v1/requests/{id}/events?after=N, slow readers; kills the worker while idle and mid-request. "
                "Each request is completed, errored (explicitly), cancelled, resumed, hung or lost; pass iff none "
                "hung or was lost, every 429/503 had Retry-After, and the server ends up with every slot free. "
                "Exit 1 on fail.",
    options=SoakOptions, run=bench_soak, flags=("requests", "seconds", "concurrency_factor", "faults", "seed"),
    help_text={"requests": "requests to send", "faults": "do not kill the worker"})
