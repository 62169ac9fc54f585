"""asyncio client of the worker protocol: many calls and streams in flight over one worker process.

The Litestar server owns one :class:`AsyncWorkerClient` in its lifespan. Every request gets a protocol id; a
reader task routes each worker line to the queue of its id, so calls and ``generate`` streams run
concurrently. A worker that exits fails every pending call with :class:`WorkerDied` at once (saying how it
exited, never what it wrote on stderr: that reaches the server's clients; :meth:`AsyncWorkerClient.last_words`
gives the log's tail for the log); a call that
misses its timeout raises :class:`WorkerTimeout` and kills the worker (like :mod:`engine_bridge.client`).
So does a request the worker does not take off its stdin within ``write_timeout_s`` (a worker that is
stopped or wedged outside llama.cpp stops reading, and its pipe fills).

Streams and cancellation: ``stream("generate", {"rid": ..., ...})`` yields token events, then
``{"result": {...}}`` (:meth:`AsyncWorkerClient.generate` yields them typed). If its consumer goes away first (the task is cancelled, e.g. the HTTP client
disconnected, or the generator is closed early), the stream sends ``cancel {"rid": args["rid"]}`` so
the worker frees the sequence at once. Close early streams promptly with ``contextlib.aclosing``; a
generator left to the garbage collector cancels only when it is collected.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sys
from collections.abc import AsyncGenerator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from engine_bridge import ops
from engine_bridge.errors import EngineError, ProtocolMismatch, WorkerDied, WorkerTimeout, from_wire
from engine_bridge.protocol import PROTOCOL_VERSION, decode, encode, generate_args, generate_event
from engine_bridge.worker_log import last_words

A = TypeVar("A", bound=BaseModel)
R = TypeVar("R", bound=BaseModel)

REPO_ROOT = Path(__file__).resolve().parents[1]
# ops whose streams are cancelled by a follow-up op naming the stream's args["rid"]
CANCEL_OPS = {ops.GENERATE.name: ops.CANCEL.name}
_LINE_LIMIT = 1 << 26  # a tokenize result of a long text is one long line
_DIED = object()


class AsyncWorkerClient:
    """One engine worker subprocess driven from asyncio."""

    def __init__(self, log_path: Path | None, env: Mapping[str, str] | None = None,
                 hello_timeout_s: float = 30.0, python: str = sys.executable, write_timeout_s: float = 30.0,
                 argv: Sequence[str] = ("-m", "engine_bridge.worker")) -> None:
        self.log_path = log_path
        self.extra_env = dict(env or {})
        self.hello_timeout_s = hello_timeout_s
        self.write_timeout_s = write_timeout_s
        self.python = python
        self.argv = tuple(argv)  # what runs behind the protocol: the worker, or an engine's host
        self.proc: asyncio.subprocess.Process | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Queue[Any]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._eof = False
        self._log_start = 0  # the log is shared by successive workers: this one's words start here

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> dict[str, Any]:
        """Spawn the worker and check its protocol version; returns its hello.

        Raises:
            ProtocolMismatch: the worker speaks another protocol version (it is killed).
            WorkerDied, WorkerTimeout: it exited or did not answer within ``hello_timeout_s``.
        """
        env = {**os.environ, **self.extra_env}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
        log = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = self.log_path.open("ab")
            self._log_start = log.tell()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                self.python, *self.argv, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=log if log is not None else asyncio.subprocess.DEVNULL,
                env=env, cwd=str(REPO_ROOT), start_new_session=True, limit=_LINE_LIMIT)
        finally:
            if log is not None:
                log.close()  # the child holds its own descriptor
        self._eof = False
        self._reader = asyncio.create_task(self._read(self.proc), name=f"worker-{self.proc.pid}-reader")
        hello = await self.call(ops.HELLO.name, timeout=self.hello_timeout_s)
        if hello.get("protocol") != PROTOCOL_VERSION:
            self.kill()
            raise ProtocolMismatch(PROTOCOL_VERSION, hello.get("protocol"))
        return hello

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        """Route every worker line to its caller; on EOF wake every pending caller with _DIED."""
        stdout = proc.stdout
        try:
            while stdout is not None:
                line = await stdout.readline()
                if not line:
                    break
                try:
                    msg = decode(line)
                except ValueError:
                    continue
                q = self._pending.get(msg["id"])
                if q is not None:
                    q.put_nowait(msg)
        except (ValueError, asyncio.LimitOverrunError, ConnectionError):
            self.kill()  # an unreadable stream: the worker is unusable
        finally:
            self._eof = True  # from now on new requests fail at once
            try:
                await asyncio.wait_for(proc.wait(), 2.0)
            except TimeoutError:  # it closed its stdout but lives on: it cannot answer anyway
                self.kill()
                await proc.wait()
            for q in self._pending.values():
                q.put_nowait(_DIED)

    @property
    def alive(self) -> bool:
        """True while the worker process runs."""
        return self.proc is not None and self.proc.returncode is None

    @property
    def pid(self) -> int | None:
        """The worker's process id."""
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self) -> int | None:
        """The worker's exit status once it has exited (negative: killed by that signal)."""
        return self.proc.returncode if self.proc is not None else None

    def kill(self) -> None:
        """SIGKILL the worker's process group now (pending calls then raise WorkerDied)."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def wait_exit(self) -> int:
        """Wait until the worker process exits; its return code."""
        if self.proc is None:
            raise WorkerDied(None, "not started")
        return await self.proc.wait()

    async def close(self, timeout: float = 10.0) -> None:
        """Ask the worker to shut down; kill it if it does not exit within ``timeout``."""
        if self.alive:
            with contextlib.suppress(EngineError):
                await self.call("shutdown", timeout=timeout)
            if self.proc is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.proc.wait(), timeout)
        self.kill()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await self._reader

    async def __aenter__(self) -> AsyncWorkerClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- calls ------------------------------------------------------------------------------------
    def _died(self) -> WorkerDied:
        """How the worker exited, in words for a client (its stderr stays in its log: see :meth:`last_words`)."""
        return WorkerDied(self.returncode, exit_detail(self.returncode))

    def last_words(self) -> str:
        """This worker's last words in its log: the assertion or error that ended it when it left one, else its
        last line ("" without a log). For the server's log, not for a client's error."""
        return last_words(self.log_path, self._log_start)

    def _send(self, rid: int, op: str, args: Mapping[str, Any] | None) -> None:
        """Write one request (no await: small writes go to the transport's buffer at once).

        Raises:
            EngineError: ``bad_request`` when the request cannot be encoded (text that is not Unicode).
            WorkerDied: the worker is gone.
        """
        self._write(encode({"id": rid, "op": op, "args": dict(args or {})}))

    def _write(self, line: bytes) -> None:
        if self.proc is None or self.proc.stdin is None:
            raise WorkerDied(None, "not started")
        if self._eof or not self.alive or self.proc.stdin.is_closing():
            raise self._died()
        try:
            self.proc.stdin.write(line)
        except (BrokenPipeError, ConnectionError, RuntimeError) as exc:
            raise self._died() from exc

    async def _drain(self, op: str) -> None:
        """Wait until the worker has taken the request off its pipe; kill it after ``write_timeout_s``."""
        stdin = self.proc.stdin if self.proc is not None else None
        if stdin is None or stdin.is_closing():
            return
        try:
            await asyncio.wait_for(stdin.drain(), self.write_timeout_s)
        except TimeoutError:
            self.kill()
            raise WorkerTimeout(f"{op} (writing the request)", self.write_timeout_s) from None
        except (BrokenPipeError, ConnectionError) as exc:
            raise self._died() from exc

    async def stream(self, op: str, args: Mapping[str, Any] | None = None,
                     timeout: float = 120.0) -> AsyncGenerator[dict[str, Any], None]:
        """Send a request; yield its events, then its result as ``{"result": ...}``.

        ``timeout`` bounds the wait for each message, not the whole call. A ``generate`` stream whose
        consumer stops early sends ``cancel {"rid": args["rid"]}`` (see the module docstring).

        Raises:
            EngineError: the worker refused the request (its ``code`` and ``message``), or it could not be sent
                (``bad_request``: text that is not Unicode).
            WorkerDied: the worker exited before the answer.
            WorkerTimeout: no message within ``timeout``; the worker has been killed.
        """
        rid = next(self._ids)
        line = encode({"id": rid, "op": op, "args": dict(args or {})})  # a request that cannot be sent starts nothing
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._pending[rid] = q
        finished = False
        try:
            self._write(line)
            await self._drain(op)
            while True:
                try:
                    msg = await asyncio.wait_for(q.get(), timeout)
                except TimeoutError:
                    self.kill()
                    raise WorkerTimeout(op, timeout) from None
                if msg is _DIED:
                    finished = True
                    raise self._died()
                if "event" in msg:
                    yield msg["event"]
                    continue
                finished = True
                if not msg.get("ok"):
                    err = msg.get("error") or {}
                    raise from_wire(err)
                yield {"result": msg.get("result") or {}}
                return
        finally:
            self._pending.pop(rid, None)
            if not finished:
                self._cancel_remote(op, args)

    def _cancel_remote(self, op: str, args: Mapping[str, Any] | None) -> None:
        """Tell the worker to stop an abandoned stream (fire and forget: its answer is dropped)."""
        cancel_op = CANCEL_OPS.get(op)
        if cancel_op is None or not args or "rid" not in args or not self.alive:
            return
        with contextlib.suppress(EngineError):
            self._send(next(self._ids), cancel_op, {"rid": args["rid"]})

    async def call(self, op: str, args: Mapping[str, Any] | None = None, timeout: float = 120.0) -> dict[str, Any]:
        """Send a request and return its result (events, if any, are dropped).

        Raises:
            EngineError, WorkerDied, WorkerTimeout: as :meth:`stream`.
        """
        result: dict[str, Any] = {}
        async with contextlib.aclosing(self.stream(op, args, timeout)) as events:
            async for msg in events:
                if "result" in msg:
                    result = msg["result"]
        return result

    # -- typed ops (engine_bridge.ops) ---------------------------------------------------------------
    async def request(self, spec: ops.OpSpec[A, R], args: A | None = None, timeout: float = 120.0) -> R:
        """Run one op: ``args`` (its argument model; None for ops without arguments) in, its result model out."""
        raw = args.model_dump(mode="json") if args is not None else {}
        return spec.result.model_validate(await self.call(spec.name, raw, timeout))

    async def tokenize(self, text: str, special: bool = True, add_special: bool = False,
                       timeout: float = 120.0) -> list[int]:
        """Token ids of ``text`` in the serving engine."""
        args = ops.TokenizeArgs(text=text, special=special, add_special=add_special)
        return (await self.request(ops.TOKENIZE, args, timeout)).tokens

    async def generate(self, args: ops.GenerateArgs,
                       timeout: float = 120.0) -> AsyncGenerator[ops.GenerateEvent, None]:
        """A ``generate`` stream: token (and prefill) events, then its :class:`~engine_bridge.ops.ResultEvent`.
        Its arguments go as they are, the prompt packed (:func:`~engine_bridge.protocol.generate_args`): build them
        with ``model_construct`` and a long prompt is not validated twice on the way to its first token (the
        worker validates them), nor written as JSON integers. Closing it early cancels the generation.

        Raises:
            EngineError: ``bad_request``: a prompt token id that does not fit 32 bits (nothing was sent); as
                :meth:`stream` otherwise.
        """
        raw = generate_args(args)
        async with contextlib.aclosing(self.stream(ops.GENERATE.name, raw, timeout)) as msgs:
            async for msg in msgs:
                event = generate_event(msg)
                if event is not None:
                    yield event


def exit_detail(returncode: int | None) -> str:
    """How a process ended beyond its exit status: "killed by SIGKILL" for a signal, else ""."""
    if returncode is None or returncode >= 0:
        return ""
    with contextlib.suppress(ValueError):
        return f"killed by {signal.Signals(-returncode).name}"
    return f"killed by signal {-returncode}"
