"""The in-process baseline: llama-cpp-python's own ``Llama`` with the plan's parameters, in a process of its own.

``python -m engine_bridge.worker.inprocess`` (only the worker side links llama.cpp) loads the model with the
plan's parameters and times each streamed completion where it runs, from the call to its first and last text
chunk: what a user of llama-cpp-python sees in their own process, with no server and no pipe in the timing.
``flux bench serve`` (overhead) and ``flux bench ttft`` race it.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from artifacts.engine_params import EngineParams
from tasks.bench.errors import BenchError
from tasks.bench.http import REPO_ROOT


@dataclass(frozen=True)
class Completion:
    """One streamed completion as the in-process caller saw it (seconds from the call)."""

    ttft_s: float | None
    last_s: float | None
    pieces: int
    finish_reason: str | None

    def tokens(self, max_tokens: int) -> int:
        """Tokens generated: all that were asked for when the reply hit the limit, else one per text piece."""
        return max_tokens if self.finish_reason == "length" else self.pieces

    def decode_tps(self, max_tokens: int) -> float | None:
        """Tokens after the first over the time from the first text piece to the last."""
        n = self.tokens(max_tokens)
        if self.ttft_s is None or self.last_s is None or self.last_s <= self.ttft_s or n < 2:
            return None
        return (n - 1) / (self.last_s - self.ttft_s)


class InProcess:
    """llama-cpp-python in its own process: :meth:`start` loads, :meth:`complete` times one prompt."""

    def __init__(self, model: Path, params: EngineParams, *, log_path: Path, timeout_s: float) -> None:
        """Describe the process; nothing starts before :meth:`start`."""
        self.model, self.params, self.log_path, self.timeout_s = model, params, log_path, timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> float:
        """Start the process and load the model; the seconds the load took (as the process measured it).

        Raises:
            BenchError: the process exited or did not answer in time (its log says why).
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        env = {**os.environ, **self.params.environment()}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "engine_bridge.worker.inprocess"], cwd=REPO_ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     start_new_session=True)
        got = self._ask({"model": str(self.model), "params": self.params.model_dump(mode="json")})
        return float(got["load_s"])

    def complete(self, prompt: str, max_tokens: int) -> Completion:
        """One greedy streamed completion of ``prompt``, timed inside the process."""
        got = self._ask({"prompt": prompt, "max_tokens": max_tokens})
        return Completion(ttft_s=got["ttft_s"], last_s=got["last_s"], pieces=int(got["pieces"]),
                          finish_reason=got["finish_reason"])

    def _ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        proc = self.proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            raise BenchError("the in-process baseline is used before start()")
        try:
            proc.stdin.write((json.dumps(msg) + "\n").encode())
            proc.stdin.flush()
        except BrokenPipeError:
            raise BenchError(f"the in-process baseline (llama-cpp-python) exited: see {self.log_path}") from None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if not sel.select(self.timeout_s):
                raise BenchError(f"the in-process baseline (llama-cpp-python) did not answer within "
                                 f"{self.timeout_s:g} s: see {self.log_path}")
        line = proc.stdout.readline()
        if not line:
            raise BenchError(f"the in-process baseline (llama-cpp-python) exited with code {proc.wait()}: "
                             f"see {self.log_path}")
        out: dict[str, Any] = json.loads(line)
        return out

    def stop(self) -> None:
        """Close its stdin (it exits), then kill it if it lingers."""
        if self.proc is not None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        if self._log is not None:
            self._log.close()
        self.proc = self._log = None

    def __enter__(self) -> InProcess:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

