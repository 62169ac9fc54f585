"""Client side of the worker protocol: spawn, talk with timeouts, kill.

Every call has a timeout; a worker that misses it is killed (its whole process group) and the call
raises :class:`WorkerTimeout`. A worker that exits mid-call raises :class:`WorkerDied`. Nothing here
imports llama_cpp: planning, benchmarks and the server all drive llama.cpp through this class.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from engine_bridge import ops
from engine_bridge.errors import EngineError, ProtocolMismatch, WorkerDied, WorkerTimeout, from_wire
from engine_bridge.procgroup import ManagedProcess, OwnsProcess
from engine_bridge.protocol import PROTOCOL_VERSION, decode, encode, generate_args, generate_event

A = TypeVar("A", bound=BaseModel)
R = TypeVar("R", bound=BaseModel)

REPO_ROOT = Path(__file__).resolve().parents[1]
# A worker environment in which llama.cpp sees no GPU (as ``-dev none`` would), so it holds no CUDA context.
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}
_EOF = object()


class WorkerClient(OwnsProcess):
    """One engine worker subprocess."""

    def __init__(self, log_path: Path | None = None, env: Mapping[str, str] | None = None,
                 hello_timeout_s: float = 30.0, python: str = sys.executable) -> None:
        self.log_path = log_path
        self.extra_env = dict(env or {})
        self.hello_timeout_s = hello_timeout_s
        self.python = python
        self.child: ManagedProcess | None = None
        self._ids = itertools.count(1)
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Spawn the worker and check its protocol version; returns its hello."""
        path = self.extra_env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        env = {**self.extra_env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), path]))}
        self.child = ManagedProcess([self.python, "-m", "engine_bridge.worker"], log_path=self.log_path, env=env,
                                    cwd=REPO_ROOT, pipes=True)
        proc = self.child.start()
        threading.Thread(target=self._read, args=(proc,), daemon=True, name="worker-reader").start()
        hello = self.call(ops.HELLO.name, timeout=self.hello_timeout_s)
        if hello.get("protocol") != PROTOCOL_VERSION:
            self.kill()
            raise ProtocolMismatch(PROTOCOL_VERSION, hello.get("protocol"))
        return hello

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        stdout = proc.stdout
        if stdout is None:
            return
        for line in stdout:
            try:
                self._inbox.put(decode(line))
            except ValueError:
                continue
        self._inbox.put(_EOF)

    def kill(self) -> None:
        """Kill the worker's process group at once."""
        if self.child is not None:
            self.child.kill()

    def close(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit; kill it if it does not."""
        if self.alive:
            try:
                self.call("shutdown", timeout=timeout)
                if self.child is not None:
                    self.child.wait(timeout)
            except EngineError:
                pass
        self.kill()

    def stop(self) -> None:
        """Ask the worker to exit; kill it if it does not (:meth:`close`, the way out of a with-block)."""
        self.close()

    # -- calls ------------------------------------------------------------------------------------
    def _send(self, op: str, args: Mapping[str, Any] | None) -> int:
        if self.proc is None or self.proc.stdin is None:
            raise WorkerDied(None, "not started")
        rid = next(self._ids)
        try:
            self.proc.stdin.write(encode({"id": rid, "op": op, "args": dict(args or {})}))
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise self._died() from exc
        return rid

    def _died(self) -> WorkerDied:
        """How the worker ended, with its last words: the assertion or error that ended it when it left one (a
        backtrace follows ggml's), else its last line."""
        if self.child is None:
            return WorkerDied(None, "")
        code = self.child.wait()
        self.child.close_log()
        return WorkerDied(code, self.child.last_words())

    def stream(self, op: str, args: Mapping[str, Any] | None = None,
               timeout: float = 120.0) -> Iterator[dict[str, Any]]:
        """Send a request; yield its events, then its result as ``{"result": ...}``.

        ``timeout`` bounds the wait for each message, not the whole call.
        """
        with self._lock:
            rid = self._send(op, args)
            while True:
                try:
                    msg = self._inbox.get(timeout=timeout)
                except queue.Empty:
                    self.kill()
                    raise WorkerTimeout(op, timeout) from None
                if msg is _EOF:
                    raise self._died()
                if msg.get("id") != rid:
                    continue
                if "event" in msg:
                    yield msg["event"]
                    continue
                if not msg.get("ok"):
                    err = msg.get("error") or {}
                    raise from_wire(err)
                yield {"result": msg.get("result") or {}}
                return

    def call(self, op: str, args: Mapping[str, Any] | None = None, timeout: float = 120.0) -> dict[str, Any]:
        """Send a request and return its result."""
        result: dict[str, Any] = {}
        for msg in self.stream(op, args, timeout):
            if "result" in msg:
                result = msg["result"]
        return result

    # -- typed ops (engine_bridge.ops) ---------------------------------------------------------------
    def request(self, spec: ops.OpSpec[A, R], args: A | None = None, timeout: float = 120.0) -> R:
        """Run one op: ``args`` (its argument model; None for ops without arguments) in, its result model out."""
        raw = args.model_dump(mode="json") if args is not None else {}
        return spec.result.model_validate(self.call(spec.name, raw, timeout))

    def tokenize(self, text: str, special: bool = True, add_special: bool = False, timeout: float = 120.0) -> list[int]:
        """Token ids of ``text`` in the loaded model or serving engine."""
        args = ops.TokenizeArgs(text=text, special=special, add_special=add_special)
        return self.request(ops.TOKENIZE, args, timeout).tokens

    def detokenize(self, tokens: list[int], special: bool = False, timeout: float = 120.0) -> str:
        """Text of ``tokens`` in the loaded model or serving engine."""
        return self.request(ops.DETOKENIZE, ops.DetokenizeArgs(tokens=tokens, special=special), timeout).text

    def generate(self, args: ops.GenerateArgs, timeout: float = 120.0) -> Iterator[ops.GenerateEvent]:
        """A ``generate`` stream of the serving engine: token (and prefill) events, then its
        :class:`~engine_bridge.ops.ResultEvent` (as :meth:`engine_bridge.aclient.AsyncWorkerClient.generate`)."""
        for msg in self.stream(ops.GENERATE.name, generate_args(args), timeout):
            event = generate_event(msg)
            if event is not None:
                yield event


@contextlib.contextmanager
def tokenizer(model: Path, log_path: Path | None = None, timeout: float = 300.0) -> Iterator[Callable[[str], list[int]]]:
    """Text → this model's token ids (control tokens parsed, no BOS), while the block runs: one worker holding
    ``model``'s vocabulary alone (a vocab-only load: no weights read, which took 12-14 s of every plan of a
    30B model on the H200; the GPUs stay untouched)."""
    from artifacts.engine_params import EngineParams

    params = EngineParams(n_ctx=256, n_batch=64, n_ubatch=64)
    with WorkerClient(log_path=log_path, env=HIDE_GPUS) as w:
        w.request(ops.LOAD, ops.LoadArgs(model=str(model), params=params, vocab_only=True), timeout)
        yield lambda text: w.tokenize(text, timeout=timeout)
