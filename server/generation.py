"""One generation: a task that drives the worker's ``generate`` stream and writes the request's journal.

The task is decoupled from the HTTP connection: a streaming response follows the journal (as a resuming
client does), a plain response awaits the task. The task owns an admission slot and gives it back only
when the worker has answered the generation's end, so the sequence is free in the worker by then.
Stop sequences are matched on the text here; on a match the worker is told to cancel and its remaining
output is dropped. A client that disconnects does not stop it: the reply runs on (to ``max_tokens`` at
most) into the journal, so a client that resumes gets all of it; a reply nobody has followed for
``orphan_s`` (the journal's TTL) is cancelled, and ``DELETE /v1/requests/{id}`` cancels at once. A worker
failure ends the request with an error event (streamed) or an error response (plain). With tools, the text after stop matching
goes through the format's call parser: content streams as it comes, each tool call once it is whole,
and a reply with calls ends with ``finish_reason: "tool_calls"``. When a grammar makes the whole reply
calls (``tool_choice`` ``required`` or a named function), each call streams as it is written: a first
``tool_calls`` delta with its id and name, then its arguments in pieces; one cut by ``max_tokens`` stays a
call (arguments as far as they got) and the reply's ``finish_reason`` is ``"length"``.

A request cancelled while it waited for a sequence never reaches the worker: :meth:`Generation.withdrawn`
ends it at once as a cancel ends a running one (no tokens), holding no admission slot. A cancelled reply's
reason is ``cancelled`` here and in the access log; its client reads OpenAI's ``length`` with
``flux.finish_reason: "cancelled"`` (:data:`server.formats.OPENAI_FINISH`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine_bridge import ops
from engine_bridge.errors import EngineError
from engine_bridge.gbnf import GrammarSpec
from engine_bridge.ops import TokenEvent
from engine_bridge.sampling import SamplingParams
from server.errors import ApiError, error_event
from server.formats import Builder, ToolCallBody, usage_body
from server.journal import Entry, Journal
from server.stats import Outcome
from server.stops import StopMatcher
from server.supervisor import Admission, WorkerSupervisor
from server.tools.formats import ToolFormat
from server.tools.parse import CallParser, Piece, PieceKind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenSpec:
    """What to generate, as admitted."""

    rid: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stops: list[str]
    logprobs: bool
    top_logprobs: int
    include_usage: bool
    echo: str = ""
    stream: bool = False
    arrived: float = field(default_factory=time.monotonic)  # when the request came in (before its queue wait)
    grammar: GrammarSpec | None = None
    tool_format: ToolFormat | None = None  # parse tool calls in this format
    forced_calls: tuple[str, ...] = ()  # the grammar makes the reply calls to these: stream them as written


@dataclass(frozen=True)
class GenContext:
    """The server parts a generation uses."""

    engine: WorkerSupervisor
    admission: Admission
    journal: Journal
    wait_s: float
    timeout_s: float
    on_tokens: Callable[[int], None]
    on_outcome: Callable[[Outcome], None]
    on_finish: Callable[[Generation], None] = lambda gen: None
    orphan_s: float = 600.0  # a reply nobody follows for this long is cancelled


@dataclass(frozen=True)
class FinishStats:
    """How a generation went, for metrics and the access log."""

    outcome: Outcome
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prefill_s: float  # the worker's prompt time
    decode_s: float  # the worker's generation time
    ttft_s: float | None  # from the request's arrival to its first token
    duration_s: float  # from the request's arrival to its end


@dataclass
class _Acc:
    text: list[str] = field(default_factory=list)
    tokens: list[TokenEvent] = field(default_factory=list)
    pending: list[TokenEvent] = field(default_factory=list)
    calls: list[ToolCallBody] = field(default_factory=list)
    n_tokens: int = 0


class Generation:
    """A running request; the journal entry holds its events."""

    def __init__(self, spec: GenSpec, builder: Builder, entry: Entry, ctx: GenContext,
                 holds_slot: bool = True) -> None:
        """Prepare; the caller already holds an admission slot for it (``holds_slot``), given back at its end."""
        self.spec = spec
        self.builder = builder
        self.entry = entry
        self.ctx = ctx
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] = usage_body(len(spec.prompt), 0, 0)
        self.error: EngineError | ApiError | None = None
        self._acc = _Acc()
        self._matcher = StopMatcher(spec.stops)
        self._parser = _call_parser(spec)
        self._holds_slot = holds_slot
        self._cancel_requested = False
        self._cancel_sent = False
        self._started = time.monotonic()
        self._first_token: float | None = None
        self._result: ops.GenerateResult | None = None
        self.stats: FinishStats | None = None
        self._task: asyncio.Task[None] | None = None
        self._side: set[asyncio.Task[None]] = set()  # cancel calls in flight (a reference keeps them alive)
        self._readers = 1  # its own client, until its response ends (see detach)
        self._orphan: asyncio.TimerHandle | None = None
        self._when_done: list[Callable[[], None]] = []

    @classmethod
    def withdrawn(cls, spec: GenSpec, builder: Builder, entry: Entry, ctx: GenContext) -> Generation:
        """A request cancelled before it got a sequence: it ends at once, as a cancel ends a running one (its
        stream opens and ends with the cancelled finish; no tokens), never reaching the worker."""
        gen = cls(spec, builder, entry, ctx, holds_slot=False)
        gen._cancel_requested = gen._cancel_sent = True  # nothing runs in the worker to be told
        return gen

    def start(self) -> None:
        """Run in the background."""
        self._task = asyncio.create_task(self._run(), name=f"generate-{self.spec.rid}")

    async def wait(self) -> None:
        """Until the generation has ended (its journal is complete)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    @property
    def done(self) -> bool:
        """True once ended."""
        return self._task is not None and self._task.done()

    def cancel(self) -> None:
        """Stop generating now (an explicit cancel, or nobody followed it): the worker frees the sequence."""
        if self.done or self._cancel_requested:
            return
        self._cancel_requested = True
        self._send_cancel()

    @property
    def orphaned(self) -> bool:
        """True while running with nobody following it (its client left and no resume reads it)."""
        return self._readers == 0 and not self.done and self._task is not None

    @property
    def cancelling(self) -> bool:
        """True once a cancel was asked for."""
        return self._cancel_requested

    def when_done(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the generation has ended (at once if it has)."""
        if self.done and self.stats is not None:
            fn()
        else:
            self._when_done.append(fn)

    def attach(self) -> None:
        """Another client follows the reply (a resume); the request's own client counts from the start."""
        self._readers += 1
        if self._orphan is not None:
            self._orphan.cancel()
            self._orphan = None

    def detach(self) -> None:
        """A client stopped following; with none left the reply runs on for ``orphan_s``, then is cancelled."""
        self._readers = max(0, self._readers - 1)
        if self._readers == 0 and not self.done and self._orphan is None:
            self._orphan = asyncio.get_running_loop().call_later(self.ctx.orphan_s, self._orphaned)

    def _orphaned(self) -> None:
        self._orphan = None
        if self._readers == 0 and not self.done:
            log.info("request %s: nobody followed it for %g s: cancelled", self.spec.rid, self.ctx.orphan_s)
            self.cancel()

    def response(self) -> dict[str, Any]:
        """The whole response (after :meth:`wait`)."""
        return self.builder.response("".join(self._acc.text), self._acc.tokens, self.finish_reason or "stop",
                                     self.usage, self._acc.calls or None)

    # -- the task -----------------------------------------------------------------------------------------
    def _emit(self, chunk: dict[str, Any] | None) -> None:
        if chunk is not None:
            self.ctx.journal.append(self.entry, json.dumps(chunk, ensure_ascii=False, separators=(",", ":")))

    def _send_cancel(self) -> None:
        if not self._cancel_sent:
            self._cancel_sent = True
            task = asyncio.get_running_loop().create_task(self.ctx.engine.cancel(self.spec.rid))
            self._side.add(task)
            task.add_done_callback(self._side.discard)

    async def _run(self) -> None:
        outcome: Outcome = "errored"
        try:
            self._emit(self.builder.first())
            if self.spec.echo:
                self.builder.echo_chars = len(self.spec.echo)
                self._text(self.spec.echo)
            result = await self._pump()
            # bytes of an incomplete UTF-8 character held by the worker's decoder come with the result
            self._text(self._matcher.feed(result.text_tail) + self._matcher.flush())
            self._end_text()
            self._result = result
            reason = "stop" if self._matcher.stopped else result.finish_reason
            self.finish_reason = "tool_calls" if self._acc.calls and reason == "stop" else reason
            outcome = "cancelled" if self.finish_reason == "cancelled" else "completed"
            self.usage = usage_body(result.prompt_tokens, self._acc.n_tokens, result.cached_tokens)
            self._emit(self.builder.finish(self.finish_reason))
            if self.spec.include_usage:
                self._emit(self.builder.usage_chunk(self.usage))
        except (EngineError, ApiError) as exc:
            self.error = exc
            log.warning("request %s failed: %s", self.spec.rid, exc)
            self._emit(error_event(exc))
        except asyncio.CancelledError:  # the server is shutting down
            self._emit({"error": {"message": "the server is shutting down", "type": "server_error",
                                  "param": None, "code": "shutdown"}})
            raise
        finally:
            self.ctx.journal.finish(self.entry)
            if self._holds_slot:
                self.ctx.admission.release(time.monotonic() - self._started)
            if self._orphan is not None:
                self._orphan.cancel()
            self.stats = self._finish_stats(outcome)
            self.ctx.on_outcome(outcome)
            self.ctx.on_finish(self)
            for fn in self._when_done:
                fn()

    def _finish_stats(self, outcome: Outcome) -> FinishStats:
        now, t0 = time.monotonic(), self.spec.arrived
        r = self._result or ops.GenerateResult(finish_reason="cancelled", prompt_tokens=len(self.spec.prompt))
        return FinishStats(outcome=outcome, prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                           completion_tokens=self._acc.n_tokens, prefill_s=r.prefill_ms / 1e3, decode_s=r.decode_ms / 1e3,
                           ttft_s=None if self._first_token is None else self._first_token - t0, duration_s=now - t0)

    def _args(self) -> ops.GenerateArgs:
        """The op's arguments, built unvalidated: the worker validates them once, so a long prompt is not checked
        twice on the way to its first token."""
        s = self.spec
        return ops.GenerateArgs.model_construct(
            rid=s.rid, prompt=s.prompt, max_tokens=s.max_tokens, sampling=s.sampling, logprobs=s.logprobs,
            top_logprobs=s.top_logprobs, grammar=s.grammar)

    async def _pump(self) -> ops.GenerateResult:
        """Consume the worker's events until its result; returns the result."""
        cancelled = ops.GenerateResult(finish_reason="cancelled", prompt_tokens=len(self.spec.prompt))
        if self._cancel_requested:
            return cancelled
        events = self.ctx.engine.generate(self._args(), self.ctx.wait_s, self.ctx.timeout_s)
        async with contextlib.aclosing(events):
            async for ev in events:
                if ev["type"] == "result":
                    return ev["result"]
                if ev["type"] != "token" or self._matcher.stopped:
                    continue  # tokens after a stop sequence, before the cancel lands: dropped
                self._token(ev)
                if self._matcher.stopped or self._cancel_requested:
                    self._send_cancel()
        return cancelled  # a stream that ends without a result (the engine went away) raised before this

    def _token(self, ev: TokenEvent) -> None:
        if self._first_token is None:
            self._first_token = time.monotonic()
        self._acc.n_tokens += 1
        self.ctx.on_tokens(1)
        if self.spec.logprobs:
            self._acc.pending.append(ev)
        out = self._matcher.feed(ev["text"])
        if out or (self._matcher.stopped and self._acc.pending):
            self._text(out)

    def _text(self, text: str) -> None:
        """Reply text after stop matching: content, or through the tool-call parser."""
        if self._parser is None:
            if text or self._acc.pending:
                self._piece(Piece("content", text))
            return
        for piece in self._parser.feed(text):
            self._piece(piece)

    def _end_text(self) -> None:
        """What the parser still holds, and logprobs of tokens no piece carried yet."""
        for piece in self._parser.finish() if self._parser is not None else []:
            self._piece(piece)
        if self._acc.pending:
            self._piece(Piece("content", ""))

    def _piece(self, piece: Piece) -> None:
        tokens, self._acc.pending = self._acc.pending, []
        self._acc.tokens.extend(tokens)
        self._PIECES[piece.kind](self, piece, tokens)

    def _content(self, piece: Piece, tokens: list[TokenEvent]) -> None:
        self._acc.text.append(piece.text)
        self._emit(self.builder.piece(piece.text, tokens))

    def _call(self, piece: Piece, tokens: list[TokenEvent]) -> None:
        """A whole call, or (``call_open``) the start of one whose arguments follow in pieces."""
        if piece.call is None:
            return
        call: ToolCallBody = {"id": f"call_{secrets.token_hex(12)}", "type": "function",
                              "function": {"name": piece.call.name, "arguments": piece.call.arguments}}
        self._acc.calls.append(call)
        self._emit(self.builder.tool_call(len(self._acc.calls) - 1, call, tokens))

    def _call_args(self, piece: Piece, tokens: list[TokenEvent]) -> None:
        """A piece of the open call's arguments: a delta with the call's index and the new text alone."""
        if not self._acc.calls:
            return
        self._acc.calls[-1]["function"]["arguments"] += piece.text
        self._emit(self.builder.tool_call(len(self._acc.calls) - 1, {"function": {"arguments": piece.text}}, tokens))

    _PIECES: dict[PieceKind, Callable[[Generation, Piece, list[TokenEvent]], None]] = {
        "content": _content, "call": _call, "call_open": _call, "call_args": _call_args}


def _call_parser(spec: GenSpec) -> CallParser | None:
    """The parser of the reply's tool calls: streamed as written when a grammar forces them, else whole."""
    if spec.tool_format is None:
        return None
    return spec.tool_format.forced_parser(spec.forced_calls) if spec.forced_calls else spec.tool_format.parser()
