"""The serving service: one plan, one engine, admission, the journal and the counters.

Routes stay thin: they parse a request and call :meth:`FluxService.chat` / :meth:`FluxService.text`,
which render and tokenize the prompt, check that it fits the context with room for the reply (400
``context_length_exceeded`` before anything runs), take an admission slot (429/503) and start a
:class:`~server.generation.Generation`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from artifacts.config import Settings
from artifacts.model_info import model_info
from artifacts.records.plan import Plan
from engine_bridge import rpc
from engine_bridge.errors import EngineError
from server import access
from server.chat import ChatTemplate, TemplateInfo
from server.errors import (
    ApiError,
    Conflict,
    ContextLengthExceeded,
    InvalidRequest,
    NotFound,
    PagesExhausted,
    Unavailable,
    from_engine,
)
from server.formats import BUILDERS, Kind
from server.generation import GenContext, Generation, GenSpec
from server.journal import Journal, RequestIdInUse
from server.kv_pages import (
    PARK_MAX_BYTES,
    HostRam,
    PageBudget,
    PageLedger,
    kv_page_bytes,
    memlock_warning,
    page_budget,
    park_budget,
)
from server.metrics import Metrics, Snapshot
from server.prompts import prompt_tokens, reply_room, reply_tokens
from server.routing_watch import RoutingWatch, counts_routing
from server.schemas import ChatRequest, CompletionRequest, Sampling, parse_body
from server.stats import Counters, memory_by_use
from server.supervisor import Admission, EngineInfo, LoadSpec, Ticket, WorkerSupervisor
from server.tools.formats import detect_format
from server.tools.plan import ReplyPlan, ReplyPlanner
from server.transport import Refusal

log = logging.getLogger(__name__)

__all__ = ["PARK_MAX_BYTES", "FluxService", "load_spec", "park_budget"]
_RID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def load_spec(settings: Settings, plan: Plan, model_path: Path | None = None) -> LoadSpec:
    """How the plan's worker is started and loaded (n_seq_max = the concurrency the plan was made for; a MoE
    model's picks counted on the native worker, :mod:`server.routing_watch`)."""
    params = plan.candidate.params.model_copy(update={"n_seq_max": plan.sequences})
    t = settings.serve.worker_timeouts
    path = model_path or Path(plan.model_path)
    watch = settings.serve.routing
    every = watch.sample_every if counts_routing(plan, path, watch.count) else 0
    return LoadSpec(model=str(path), params=params, park_bytes=park_budget(settings.host_reserve_percent),
                    log_path=settings.logs_dir / "serve-worker.log", env=params.environment(),
                    hello_s=t.hello_s, load_s=t.load_s, rpc_s=t.rpc_s, write_s=t.write_s, engine=plan.engine,
                    drafting=plan.candidate.draft, routing_every=every, routing_window=watch.window_tokens)


class FluxService:
    """Everything the routes need, owned by the app's lifespan."""

    def __init__(self, settings: Settings, plan: Plan, model_path: Path | None = None) -> None:
        """Prepare (the worker starts in :meth:`start`); ``model_path`` serves the plan's model from another
        file (already checked to hold the same bytes)."""
        self.settings = settings
        self.plan = plan
        self.model_path = model_path or Path(plan.model_path)
        serve = settings.serve
        self.journal = Journal(serve.journal_max_bytes, serve.journal_ttl_s)
        self.counters = Counters()
        self.metrics = Metrics(on_refused=self._refused)
        self.running: dict[str, Generation] = {}  # by request id, from admission to the end
        self._claimed: dict[str, Ticket] = {}  # request ids being parsed, tokenized or queued
        self.host_reserve_percent = settings.host_reserve_percent
        self.template = TemplateInfo(self.model_path)
        self.tool_format = detect_format(self.template.source)
        self._set_template(ChatTemplate(self.template.source, self.template.bos_text or "",
                                        self.template.eos_text or ""))
        self.engine = WorkerSupervisor(load_spec(settings, plan, self.model_path))
        # KV pages (server.kv_pages): the host's RAM is read now, before the worker loads the weights
        self._host_ram = HostRam.now(plan, settings.host_reserve_percent, serve.kv_host_bytes)
        p = plan.candidate.params
        self._page_bytes = kv_page_bytes(model_info(self.model_path), p.type_k, p.type_v)
        self.pages = PageLedger(self.page_budget(p.n_ctx, plan.sequences))
        self.routing = RoutingWatch(settings.serve.routing, plan, settings.data_dir, self.model_path,
                                    self.engine.spec.routing_every)
        self._routing_task: asyncio.Task[None] | None = None
        self.admission = Admission(plan.sequences, serve.queue_max, serve.queue_wait_s)
        self.started = time.time()
        self.model_id = plan.model_name
        self.fingerprint = f"flux-{plan.id[:12]}"

    async def start(self) -> EngineInfo:
        """Start the worker and load the model."""
        info = await self.engine.start()
        self.admission = Admission(info.n_seq_max, self.settings.serve.queue_max, self.settings.serve.queue_wait_s)
        self.pages = PageLedger(self.page_budget(info.n_ctx, info.n_seq_max))
        if (pinned := memlock_warning(self.pages.budget)) is not None:
            log.warning(pinned)
        if self.template.bos_text is None or self.template.eos_text is None:  # vocabulary too long for the header
            bos = await self._token_text(info.raw.get("bos", self.template.bos_id))
            eos = await self._token_text(info.raw.get("eos", self.template.eos_id))
            self._set_template(ChatTemplate(self.template.source, bos, eos))
        log.info("chat template: %s tool calls; %s", self.tool_format.name, self.chat_template.caps)
        if self.routing.every:
            self.routing.resume()
            self._routing_task = asyncio.create_task(self.routing.run(self.engine), name="routing-watch")
        return info

    def _set_template(self, template: ChatTemplate) -> None:
        self.chat_template = template
        self.planner = ReplyPlanner(self.tool_format, template.caps)

    async def _token_text(self, tid: object) -> str:
        if not isinstance(tid, int) or tid < 0:
            return ""
        return await self.engine.detokenize([tid], self.settings.serve.queue_wait_s, special=True)

    async def close(self) -> None:
        """Save the served routing trace, then stop the worker."""
        if self._routing_task is not None:
            self._routing_task.cancel()
            with contextlib.suppress(Exception):  # the trace is a report: stopping goes on without it
                await self.routing.look(self.engine)
        await self.engine.close()

    # -- limits ---------------------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        """Tokens per sequence, prompt plus reply."""
        return self.engine.info.n_ctx

    @property
    def min_reply(self) -> int:
        """``serve.min_reply``, at most half the context (else no request without max_tokens could run)."""
        return max(1, min(self.settings.serve.min_reply, self.n_ctx // 2))

    def page_budget(self, n_ctx: int, n_seq: int) -> PageBudget:
        """The KV page pools of a context of ``n_seq`` sequences of ``n_ctx`` tokens under the plan's placement."""
        return page_budget(self.plan.candidate.kv_bytes, n_ctx, n_seq, self._page_bytes, self._host_ram.kv_bytes,
                           window=self.plan.candidate.params.kv_vram_cells)

    def check_model(self, model: str | None) -> None:
        """Accept no model, this model's name, file name, or plan id (prefix of 8+); else 404."""
        if not model:
            return
        path, recorded = self.model_path, Path(self.plan.model_path)
        names = {self.model_id, path.name, path.stem, recorded.name, recorded.stem, self.plan.id}
        if model in names or (len(model) >= 8 and self.plan.id.startswith(model)):
            return
        raise NotFound(f"The model '{model}' does not exist: this server serves '{self.model_id}' "
                       "(GET /v1/models)", code="model_not_found", param="model")

    def request_id(self, header: str | None, kind: Kind) -> str:
        """The client's x-request-id, or a new ``chatcmpl-...`` / ``cmpl-...`` id."""
        if header is None or header == "":
            return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{secrets.token_hex(12)}"
        if not _RID.fullmatch(header):
            raise InvalidRequest("x-request-id must be 1-128 characters of letters, digits and ._:- "
                                 "(starting with a letter or digit)", param="x-request-id")
        return header

    # -- admission --------------------------------------------------------------------------------------
    async def _tokens(self, text: str, add_special: bool = False) -> list[int]:
        """Tokens of a prompt, refused early when it cannot fit (see :func:`server.prompts.prompt_tokens`)."""
        return await prompt_tokens(self.engine, text, self.n_ctx, self.settings.serve.queue_wait_s, add_special)

    def _check_host_memory(self) -> None:
        """Refuse new work while available RAM is below the host reserve (503); shrink the journal too."""
        vm = psutil.virtual_memory()
        low = vm.available < vm.total * self.host_reserve_percent / 100
        self.journal.sweep(pressure=low)
        if low:
            raise Unavailable(f"host memory is below the reserve ({self.host_reserve_percent:g}% of RAM)",
                              code="host_memory_low", retry_after_s=5)

    @contextlib.contextmanager
    def _counting(self, rid: str) -> Iterator[None]:
        """Hold ``rid`` while the request is parsed, tokenized and queued (a second request with a running or
        waiting request's id is a 409 at once); count a request refused before it runs (by the status it
        gets), or failed unexpectedly (a 500: errored)."""
        if rid in self._claimed or rid in self.running:
            self.counters.rejected(409)
            raise Conflict(f"request id {rid!r} belongs to a request that is still running (cancel it with "
                           f"DELETE /v1/requests/{rid}, or use another id)", code="request_id_in_use",
                           param="x-request-id")
        self._claimed[rid] = Ticket()
        try:
            yield
        except ApiError as exc:
            self.counters.rejected(exc.status)
            raise
        except EngineError as exc:
            self.counters.rejected(from_engine(exc).status)
            raise
        except Exception:
            self.counters.outcome("errored")
            raise
        finally:
            self._claimed.pop(rid, None)

    async def chat(self, rid: str, body: bytes, arrived: float | None = None) -> Generation:
        """Parse, admit and start a chat completion.

        Raises:
            ApiError: invalid (400), unknown model (404), context exceeded (400), queue full (429) or timed
                out (503), host memory low (503).
            EngineError: the worker failed while tokenizing.
        """
        with self._counting(rid):
            req = parse_body(body, ChatRequest)
            self.check_model(req.model)
            reply = self.planner.plan(req)
            messages, tools = self.planner.messages([m.for_template() for m in req.messages], reply.tools)
            tokens = await self._tokens(self.chat_template.render(messages, tools))
            top = req.top_logprobs or 0
            return await self._submit(rid, "chat", req, tokens, req.reply_limit(), bool(req.logprobs) or top > 0,
                                      top, reply=reply, arrived=arrived)

    async def text(self, rid: str, body: bytes, arrived: float | None = None) -> Generation:
        """Parse, admit and start a text completion (raises as :meth:`chat`)."""
        with self._counting(rid):
            req = parse_body(body, CompletionRequest)
            self.check_model(req.model)
            try:
                tokens, echo = await self._text_prompt(req)
            except ContextLengthExceeded as exc:
                exc.param = "prompt"
                raise
            lp = req.logprobs
            return await self._submit(rid, "text", req, tokens, req.reply_limit(), lp is not None, lp or 0, echo,
                                      arrived=arrived)

    async def _text_prompt(self, req: CompletionRequest) -> tuple[list[int], str]:
        """Tokens of a completion prompt (text, or token ids checked against the vocabulary), and its echo."""
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], int):
            ids = [int(t) for t in p]
            n_vocab = self.engine.info.n_vocab
            if n_vocab and any(t >= n_vocab for t in ids):
                raise InvalidRequest(f"prompt: token ids must be below the vocabulary size {n_vocab}", param="prompt")
            echo = await self.engine.detokenize(ids, self.settings.serve.queue_wait_s) if req.echo else ""
            return ids, echo
        text = p if isinstance(p, str) else str(p[0])
        tokens = await self._tokens(text, add_special=True)  # a plain prompt gets the BOS the model wants
        if not tokens:
            raise InvalidRequest("prompt: the prompt is empty", param="prompt")
        return tokens, text if req.echo else ""

    async def _submit(self, rid: str, kind: Kind, req: Sampling, prompt: list[int], requested: int | None,
                      logprobs: bool, top_logprobs: int, echo: str = "", reply: ReplyPlan | None = None,
                      arrived: float | None = None) -> Generation:
        arrived = time.monotonic() if arrived is None else arrived
        try:
            max_tokens = reply_tokens(len(prompt), requested, self.n_ctx, self.min_reply)
        except ContextLengthExceeded as exc:
            exc.param = "messages" if kind == "chat" else "prompt"
            raise
        self._check_host_memory()
        admitted = await self._admit(rid)
        try:
            max_tokens = self._reserve(rid, kind, len(prompt), requested, max_tokens) if admitted else max_tokens
            entry = self.journal.open(rid)
        except (PagesExhausted, RequestIdInUse) as exc:
            if admitted:
                self.admission.release(None)
                self.pages.release(rid)
            if isinstance(exc, RequestIdInUse):
                raise Conflict(str(exc), code="request_id_in_use", param="x-request-id") from exc
            raise
        spec = GenSpec(rid=rid, prompt=prompt, max_tokens=max_tokens, sampling=req.sampling(), stops=req.stops(),
                       logprobs=logprobs, top_logprobs=top_logprobs, include_usage=req.include_usage() or not req.stream,
                       echo=echo, stream=bool(req.stream), arrived=arrived, grammar=reply.grammar if reply else None,
                       tool_format=self.tool_format if reply and reply.parse_tools else None,
                       forced_calls=reply.forced if reply else ())
        builder = BUILDERS[kind](rid, self.model_id, self.fingerprint, logprobs, top_logprobs)
        serve = self.settings.serve
        ctx = GenContext(engine=self.engine, admission=self.admission, journal=self.journal, wait_s=serve.queue_wait_s,
                         timeout_s=max(serve.prefill_timeout_s, serve.decode_timeout_s),
                         on_tokens=self.counters.tokens, on_outcome=self.counters.outcome, on_finish=self._finished,
                         orphan_s=max(serve.journal_ttl_s, 1.0))
        gen = Generation(spec, builder, entry, ctx) if admitted else Generation.withdrawn(spec, builder, entry, ctx)
        self.running[rid] = gen
        gen.start()
        return gen

    def _reserve(self, rid: str, kind: Kind, n_prompt: int, requested: int | None, max_tokens: int) -> int:
        """Hold KV pages for the prompt and its reply (:mod:`server.kv_pages`); the reply limit they cover."""
        try:
            held = self.pages.reserve(rid, n_prompt, n_prompt + reply_room(requested, self.min_reply),
                                      n_prompt + max_tokens)
        except PagesExhausted as exc:
            exc.param = "messages" if kind == "chat" else "prompt"
            raise
        return held.reply_tokens

    async def _admit(self, rid: str) -> bool:
        """Take a sequence for ``rid``, waiting in the queue if need be; False when the request was cancelled
        (``DELETE``) before it got one: it then holds none and never starts (raises as :meth:`Admission.acquire`)."""
        ticket = self._claimed.get(rid) or Ticket()
        if ticket.withdrawn:
            return False
        self._preempt_orphan()
        return await self.admission.acquire(ticket)

    def _preempt_orphan(self) -> None:
        """With every sequence taken, cancel the oldest reply nobody follows: a live request comes first (an
        agent that aborted a request and sent the next must not wait for the old reply to run out)."""
        if self.admission.active < self.admission.slots:
            return
        orphans = [g for g in self.running.values() if g.orphaned and not g.cancelling]
        if orphans:
            victim = min(orphans, key=lambda g: g.spec.arrived)
            log.info("request %s: nobody follows it and a new request needs its sequence: cancelled",
                     victim.spec.rid)
            victim.cancel()

    def _finished(self, gen: Generation) -> None:
        if self.running.get(gen.spec.rid) is gen:  # however it ended: its pages return
            del self.running[gen.spec.rid]
            self.pages.release(gen.spec.rid)
        if gen.stats is not None:
            self.metrics.finished(gen.stats)

    def _refused(self, refusal: Refusal) -> None:
        """A connection the transport answered before any request reached the app (a header timeout, malformed
        headers, the connection limit): count its error response and give it its access line, as a request's."""
        if refusal.status is not None and not refusal.in_request:
            self.counters.error_response(refusal.status)
            access.log_refusal(refusal)

    def cancel(self, rid: str) -> dict[str, Any]:
        """``DELETE /v1/requests/{rid}``: stop a running request now (its journal keeps what it wrote), or one
        not running yet (parsed, tokenized or waiting for a sequence): it never starts, and its client gets
        the cancelled ending.

        Raises:
            NotFound: no running, waiting or journaled request has this id.
        """
        gen = self.running.get(rid)  # first: a request just started is running and still holds its claim
        if gen is not None and not gen.done:
            gen.cancel()
            return {"id": rid, "object": "request", "status": "cancelling", "cancelled": True}
        ticket = self._claimed.get(rid)
        if ticket is not None:
            ticket.withdraw()
            return {"id": rid, "object": "request", "status": "cancelling", "cancelled": True}
        if self.journal.get(rid) is None:
            raise NotFound(f"request '{rid}' is not running and its journal expired (or it never existed)",
                           code="request_not_found", param="rid")
        return {"id": rid, "object": "request", "status": "completed", "cancelled": False}

    # -- reports --------------------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        """``GET /v1/models``."""
        p = self.plan
        meta = {"n_ctx": self.n_ctx, "n_seq_max": self.engine.info.n_seq_max, "n_vocab": self.engine.info.n_vocab,
                "min_reply": self.min_reply, "plan_id": p.id, "model_path": str(self.model_path),
                "model_hash": p.model_hash, "tool_call_format": self.tool_format.name,
                "backend_build": p.backend_build, "quality_profile": p.quality_profile, "kv": p.request.kv,
                # what the plan's conversations get: its KV cache per device (committed at load) and the RAM for
                # parked conversations taken when the server started (`flux show` prints the same)
                "page_budgets": {"kv_bytes": dict(p.candidate.kv_bytes), "park_bytes": self.engine.spec.park_bytes,
                                 "kv_pages": {u.name: u.pages_total for u in self.pages.report()},
                                 "page_tokens": self.pages.budget.page_tokens}}
        card = {"id": self.model_id, "object": "model", "created": int(self.started), "owned_by": "flux",
                "context_length": self.n_ctx, "max_model_len": self.n_ctx, "meta": meta}
        return {"object": "list", "data": [card]}

    def health(self) -> dict[str, Any]:
        """``/health``."""
        body: dict[str, Any] = {
            "status": "ok" if self.engine.alive else "unavailable", "plan_id": self.plan.id,
            "worker": {"alive": self.engine.alive, "pid": self.engine.pid, "restarts": self.engine.restarts}}
        servers = self.plan.candidate.params.rpc_servers
        if servers:  # a TCP connect each: a server busy with this plan's worker still accepts one
            up = {e: rpc.reachable(e, timeout_s=0.5) for e in servers}
            body["rpc_servers"] = {e: "up" if ok else "down" for e, ok in up.items()}
            if not all(up.values()):
                body["status"] = "unavailable"
        return body

    async def stats(self) -> dict[str, Any]:
        """``/flux/stats``."""
        worker = await self.engine.stats()
        vm = psutil.virtual_memory()
        reserve = int(vm.total * self.host_reserve_percent / 100)
        self.journal.sweep(pressure=vm.available < reserve)
        c = self.candidate_bytes()
        serve = self.settings.serve
        await self.routing.look(self.engine)
        return {
            "plan_id": self.plan.id, "model": self.model_id, "uptime_s": round(time.time() - self.started, 1),
            "memory": memory_by_use(c["weights"], c["kv"], worker, self.journal.nbytes),
            "requests": dict(self.counters.requests), "error_responses": dict(self.counters.errors),
            "tokens_total": self.counters.tokens_total,
            "tokens_per_s": round(self.counters.tokens_per_s(), 2),
            "active": self.admission.active,
            "queue": {"length": self.admission.waiting, "max": serve.queue_max, "wait_s": serve.queue_wait_s},
            "host_reserve_percent": self.host_reserve_percent,
            "host": {"ram_total": vm.total, "ram_available": vm.available, "reserve_bytes": reserve},
            "journal": {"requests": len(self.journal), "bytes": self.journal.nbytes, "max_bytes": self.journal.max_bytes,
                        "ttl_s": self.journal.ttl_s, "evicted": self.journal.evicted},
            "worker": {"alive": self.engine.alive, "pid": self.engine.pid, "restarts": self.engine.restarts,
                       "last_exit": self.engine.last_exit, "serve_stats": worker},
            "n_ctx": self.n_ctx, "min_reply": self.min_reply, "routing": self.routing.report(),
            "kv_pages": self.pages.summary(),
        }

    async def metrics_text(self) -> bytes:
        """``GET /metrics``: Prometheus text."""
        worker = await self.engine.stats()
        await self.routing.look(self.engine)
        return self.metrics.render(Snapshot(
            processing=self.admission.active, deferred=self.admission.waiting, worker_up=self.engine.alive,
            restarts=self.engine.restarts, journal_bytes=self.journal.nbytes, journal_requests=len(self.journal),
            requests=dict(self.counters.requests), errors=dict(self.counters.errors), worker=worker,
            routing=self.routing.report(), pages=self.pages.report()))

    def candidate_bytes(self) -> dict[str, dict[str, int]]:
        """Weights and KV per device as the plan measured them."""
        return {"weights": dict(self.plan.candidate.weights_bytes), "kv": dict(self.plan.candidate.kv_bytes)}
