"""The server's one engine worker: start it, restart it when it dies, and admit generations to it.

:class:`WorkerSupervisor` owns an :class:`~engine_bridge.aclient.AsyncWorkerClient` running ``serve_load``. A watcher
awaits the worker's exit: a worker that dies (idle, or mid-request: the request's own stream raises
``WorkerDied`` and ends that request with an explicit error) is started again with backoff, and requests
arriving meanwhile wait for it up to the queue wait.

:class:`Admission` lets at most ``n_seq_max`` generations into the worker (it batches them); further
requests wait in a FIFO queue of at most ``queue_max`` (full: 429), each for at most ``queue_wait_s``
(then 503). Both carry a Retry-After estimate. A request holds a :class:`Ticket` from its arrival; a
cancel withdraws it, at once when it waits in the queue, and the request then never gets a slot.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import math
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from artifacts.drafting import Drafting
from artifacts.engine_params import EngineParams
from artifacts.engine_spec import EngineSpec
from engine_bridge import ops, rpc
from engine_bridge.aclient import AsyncWorkerClient, exit_detail
from engine_bridge.errors import EngineError, WorkerDied
from server.errors import QueueFull, Unavailable

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class LoadSpec:
    """What the worker loads: model, parameters, parking budget, and the timeouts it is held to."""

    model: str
    params: EngineParams
    park_bytes: int
    log_path: Path | None
    env: Mapping[str, str]
    hello_s: float
    load_s: float
    rpc_s: float
    write_s: float = 30.0
    engine: EngineSpec | None = None  # the plan's engine; None: the native worker
    drafting: Drafting | None = None  # how the native worker drafts greedy requests (the plan's draft)
    routing_every: int = 0  # the native worker counts a MoE model's picks on one decode step in this many (0: off)
    routing_window: int = 256  # sampled tokens of the worker's recent routing window

    def argv(self) -> tuple[str, ...]:
        """What runs behind the worker protocol: the native worker, or the host of the plan's engine."""
        if self.engine is None or self.engine.native:
            return ("-m", "engine_bridge.worker")
        return ("-m", "engine_bridge.engines", self.engine.model_dump_json())


@dataclass(frozen=True)
class EngineInfo:
    """What the loaded worker reported."""

    n_ctx: int
    n_seq_max: int
    n_vocab: int
    load_ms: float
    raw: Mapping[str, Any]


class WorkerSupervisor:
    """One supervised worker with the model loaded for serving."""

    def __init__(self, spec: LoadSpec) -> None:
        """Prepare (nothing starts before :meth:`start`)."""
        self.spec = spec
        self.restarts = 0
        self.last_exit: int | None = None
        self._worker: AsyncWorkerClient | None = None
        self._info: EngineInfo | None = None
        self._ready = asyncio.Event()
        self._closing = False
        self._watcher: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> EngineInfo:
        """Start the worker and load the model; then watch it.

        Raises:
            EngineError: the worker could not start or load the model (the server does not start).
        """
        info = await self._spawn()
        self._watcher = asyncio.create_task(self._watch(), name="engine-watcher")
        return info

    async def _spawn(self) -> EngineInfo:
        """A fresh worker with the model loaded; made current only once loaded."""
        s = self.spec
        worker = AsyncWorkerClient(s.log_path, env=dict(s.env), hello_timeout_s=s.hello_s, write_timeout_s=s.write_s,
                                   argv=s.argv())
        try:
            await worker.start()
            got = await worker.request(ops.SERVE_LOAD, ops.ServeLoadArgs(
                model=s.model, params=s.params, park_bytes=s.park_bytes, drafting=s.drafting,
                routing_every=s.routing_every, routing_window=s.routing_window), timeout=s.load_s)
        except BaseException as exc:
            worker.kill()
            if isinstance(exc, WorkerDied):  # its stderr is for this log, not for the error's message
                log.error("engine worker %s exited while starting (%s); its last words: %s", worker.pid,
                          exc.message, worker.last_words() or "(none)")
            raise
        info = EngineInfo(n_ctx=got.n_ctx, n_seq_max=got.n_seq_max, n_vocab=got.n_vocab, load_ms=got.load_ms,
                          raw=got.model_dump())
        self._worker, self._info = worker, info
        self._ready.set()
        log.info("engine worker %s ready: n_ctx %d per sequence, %d sequences, loaded in %.0f ms", worker.pid,
                 info.n_ctx, info.n_seq_max, info.load_ms)
        return info

    async def _watch(self) -> None:
        """Restart the worker whenever it exits, until the engine closes."""
        while not self._closing:
            worker = self._worker
            if worker is None:
                return
            code = await worker.wait_exit()
            if self._closing:
                return
            self._ready.clear()
            self.last_exit = code
            how = f" ({exit_detail(code)})" if exit_detail(code) else ""
            # its stderr goes to this log, never into a client's error (which says only how it exited)
            log.warning("engine worker %s exited with code %s%s: restarting it; its last words: %s (see %s)",
                        worker.pid, code, how, worker.last_words() or "(none)", self.spec.log_path)
            await self._restart()

    async def _restart(self) -> None:
        """Start a new worker, backing off after failures; gives up only when the engine closes."""
        for attempt in itertools.count():
            await asyncio.sleep(RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)])
            if self._closing:
                return
            try:
                await self._spawn()
                self.restarts += 1
                return
            except Exception as exc:  # noqa: BLE001 - whatever failed, keep trying: the server must not die
                log.error("engine worker restart %d failed: %s: %s", attempt + 1, type(exc).__name__, exc)

    async def close(self) -> None:
        """Stop watching and shut the worker down."""
        self._closing = True
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        if self._worker is not None:
            await self._worker.close(timeout=5)

    # -- state ------------------------------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        """The loaded model's limits (from the first successful load)."""
        if self._info is None:
            raise EngineError("not_loaded", "the engine has not been started")
        return self._info

    @property
    def alive(self) -> bool:
        """True while a loaded worker runs."""
        return self._ready.is_set() and self._worker is not None and self._worker.alive

    @property
    def pid(self) -> int | None:
        """The current worker's process id."""
        return self._worker.pid if self._worker is not None else None

    async def ready(self, timeout: float) -> AsyncWorkerClient:
        """The loaded worker, waiting up to ``timeout`` while it restarts.

        Raises:
            Unavailable: it did not come back in time.
        """
        if self._ready.is_set() and self._worker is not None and _exited(self._worker.pid):
            self._ready.clear()  # killed, not yet reaped: wait for the watcher's restart, don't hand it out
        if not self._ready.is_set():
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except TimeoutError:
                raise Unavailable("the engine worker is restarting", code="worker_restarting",
                                  retry_after_s=max(1, math.ceil(timeout))) from None
        if self._worker is None:
            raise Unavailable("the engine worker is not running", code="worker_restarting", retry_after_s=1)
        return self._worker

    # -- calls ------------------------------------------------------------------------------------------
    async def tokenize(self, text: str, wait_s: float, add_special: bool = False) -> list[int]:
        """Tokens of ``text`` with special tokens parsed (templates and prompts carry them); ``add_special``
        adds the BOS the model asks for."""
        worker = await self.ready(wait_s)
        return await worker.tokenize(text, special=True, add_special=add_special, timeout=self.spec.rpc_s)

    async def detokenize(self, tokens: list[int], wait_s: float, special: bool = False) -> str:
        """Text of ``tokens`` (control tokens rendered only with ``special``)."""
        worker = await self.ready(wait_s)
        got = await worker.request(ops.DETOKENIZE, ops.DetokenizeArgs(tokens=tokens, special=special),
                                   timeout=self.spec.rpc_s)
        return got.text

    async def generate(self, args: ops.GenerateArgs, wait_s: float,
                       timeout: float) -> AsyncGenerator[ops.GenerateEvent, None]:
        """Events of one generation, then its result event (the worker batches concurrent ones)."""
        worker = await self.ready(wait_s)
        try:
            async with contextlib.aclosing(worker.generate(args, timeout=timeout)) as events:
                async for msg in events:
                    yield msg
        except WorkerDied as exc:
            raise self._named_rpc_loss(exc) from None

    def _named_rpc_loss(self, exc: WorkerDied) -> WorkerDied:
        """A worker of a plan over RPC servers dies when one of them goes (llama.cpp aborts on a broken link):
        name the servers that no longer answer in the request's error (the worker restarts, and loads again
        once they are back)."""
        down = [e for e in self.spec.params.rpc_servers if not rpc.reachable(e, timeout_s=0.5)]
        if not down:
            return exc
        return WorkerDied(exc.returncode, f"RPC server {', '.join(down)} does not answer (lost mid-request); "
                                          "the worker loads again once it is back")

    async def cancel(self, rid: str) -> None:
        """Stop a running generation at once (its stream then ends with finish_reason 'cancelled')."""
        worker = self._worker
        if worker is None or not worker.alive:
            return
        with contextlib.suppress(EngineError):
            await worker.request(ops.CANCEL, ops.CancelArgs(rid=rid), timeout=self.spec.rpc_s)

    async def routing(self) -> ops.ServeRouting | None:
        """The picks the worker counted (``serve_routing``); None while it is down or when it counts none."""
        if not self.spec.routing_every or not self.alive or self._worker is None:
            return None
        try:
            return await self._worker.request(ops.SERVE_ROUTING, timeout=self.spec.rpc_s)
        except EngineError as exc:
            log.warning("serve_routing failed: %s", exc)
            return None

    async def stats(self) -> dict[str, Any] | None:
        """The worker's serve_stats; None while it is down."""
        if not self.alive or self._worker is None:
            return None
        try:
            return (await self._worker.request(ops.SERVE_STATS, timeout=self.spec.rpc_s)).model_dump()
        except EngineError as exc:
            log.debug("serve_stats failed: %s", exc)
            return None


@dataclass
class Ticket:
    """A request's claim on a slot, from its arrival until it gets one: :meth:`withdraw` (a cancel) makes it
    leave the queue at once, or never enter it."""

    withdrawn: bool = False
    queued: asyncio.Future[None] | None = field(default=None, repr=False)  # its place in the queue, while there

    def withdraw(self) -> None:
        """Give up the claim: a wait in the queue ends now, and :meth:`Admission.acquire` answers False."""
        self.withdrawn = True
        if self.queued is not None and not self.queued.done():
            self.queued.cancel()


class Admission:
    """At most ``slots`` generations at once; a bounded FIFO queue of waiters with a wait limit."""

    def __init__(self, slots: int, queue_max: int, wait_s: float) -> None:
        """``slots`` concurrent holders, ``queue_max`` waiters, each waiting at most ``wait_s``."""
        self.slots = slots
        self.queue_max = queue_max
        self.wait_s = wait_s
        self._free = slots
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._durations: collections.deque[float] = collections.deque(maxlen=32)

    @property
    def active(self) -> int:
        """Slots held now."""
        return self.slots - self._free

    @property
    def waiting(self) -> int:
        """Requests in the queue."""
        return sum(1 for f in self._waiters if not f.done())

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: mean recent hold time x queue depth per slot, 1..60."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return max(1, min(60, math.ceil(mean * (self.waiting / max(self.slots, 1) + 1))))

    async def acquire(self, ticket: Ticket | None = None) -> bool:
        """Take a slot, waiting in line if none is free; False (holding none) when ``ticket`` was withdrawn
        before or while it waited.

        Raises:
            QueueFull: ``queue_max`` requests already wait.
            Unavailable: no slot came free within ``wait_s``.
        """
        ticket = ticket or Ticket()
        if ticket.withdrawn:
            return False
        if self._free > 0 and not self.waiting:
            self._free -= 1
            return True
        if self.waiting >= self.queue_max:
            raise QueueFull(self.waiting, self.retry_after())
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        ticket.queued = fut
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.wait_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if fut.done() and not fut.cancelled():
                self.release(None)  # handed a slot in the same instant: give it on
            else:
                fut.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(fut)
            if isinstance(exc, TimeoutError):
                raise Unavailable(f"no sequence came free within {self.wait_s:g} s", code="queue_timeout",
                                  retry_after_s=self.retry_after()) from None
            task = asyncio.current_task()
            if ticket.withdrawn and not (task is not None and task.cancelling()):
                return False  # the ticket's wait was cancelled, not this task (a shutdown)
            raise
        finally:
            ticket.queued = None
        if ticket.withdrawn:  # withdrawn as the slot was handed over, before this resumed: give it on
            self.release(None)
            return False
        return True

    def release(self, held_s: float | None) -> None:
        """Give a slot back (to the longest waiter, if any); ``held_s`` feeds the Retry-After estimate."""
        if held_s is not None:
            self._durations.append(held_s)
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self._free = min(self.slots, self._free + 1)


def _exited(pid: int | None) -> bool:
    """True when the process is gone or a zombie (killed, but asyncio has not reaped it yet)."""
    if pid is None:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")
