"""llama.cpp's own ``llama-server`` as an engine: launch it on a free loopback port, talk HTTP, stop it.

Benchmarks race Flux against it and check that both engines agree (``flux bench run``/``conformance``).
Only this package launches llama-server. The process runs in its own session, so stopping it stops
everything it started; its output goes to a log file, whose tail is quoted when it fails to start.

Timings come from the server's own ``timings`` object (``prompt_n``, ``prompt_ms``, ``predicted_n``,
``predicted_ms``), measured inside llama.cpp like the worker's perf counters, so HTTP overhead is not
charged to either engine. Every completion is sent with ``cache_prompt: false``: a cached prefix
would make a repeated prompt look fast.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict

from engine_bridge.engines.spec import HOST, llama_server_argv
from engine_bridge.errors import EngineError
from engine_bridge.procgroup import ManagedProcess, OwnsProcess, log_tail

log = logging.getLogger(__name__)
START_ATTEMPTS = 3  # a port picked free can be taken before the server binds it: try another


class LlamaServerError(EngineError):
    """llama-server did not start, died, or answered an HTTP error."""

    def __init__(self, message: str, status: int | None = None) -> None:
        self.status = status
        super().__init__("llama_server", message)


class ServerTimings(BaseModel):
    """llama-server's own timings of one completion (its ``timings`` object)."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    cache_n: int = 0


def free_port() -> int:
    """A loopback TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def answers(base: str, paths: Sequence[str] = ("/health",)) -> Callable[[], bool]:
    """A readiness check of a server at ``base``: True once one of ``paths`` answers 200 (False while it does not
    listen yet, or answers 503 while it loads)."""
    def ready() -> bool:
        for path in paths:
            try:
                if httpx.get(base + path, timeout=2.0).status_code == 200:
                    return True
            except httpx.HTTPError:
                continue
        return False

    return ready


class LlamaServer(OwnsProcess):
    """One llama-server subprocess serving one model on 127.0.0.1."""

    def __init__(self, exe: Path, model: Path, args: Sequence[str] = (), *, log_path: Path | None = None,
                 env: Mapping[str, str] | None = None, start_timeout_s: float = 120.0,
                 request_timeout_s: float = 300.0) -> None:
        """Describe the server; nothing starts before :meth:`start`.

        Args:
            exe: The llama-server binary (``engine_bridge.backend.llama_server_path``).
            model: The GGUF file (``-m``).
            args: Extra llama-server flags (``-c``, ``-np``, ...); never ``--host``/``--port``.
            log_path: Where the server's stdout and stderr go (appended); None discards them.
            env: Extra environment variables (e.g. ``GGML_OP_OFFLOAD_MIN_BATCH``).
            start_timeout_s: Longest wait for ``/health`` to answer 200 (model load included).
            request_timeout_s: Longest wait for one HTTP answer.
        """
        self.exe, self.model, self.args = exe, model, list(args)
        self.log_path, self.extra_env = log_path, dict(env or {})
        self.start_timeout_s, self.request_timeout_s = start_timeout_s, request_timeout_s
        self.child: ManagedProcess | None = None
        self.port: int | None = None
        self._http: httpx.Client | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> float:
        """Launch the server and wait until it is healthy; returns the seconds that took.

        Raises:
            LlamaServerError: the binary or model is missing, or the server exited or stayed unhealthy.
        """
        if not self.exe.is_file():
            raise LlamaServerError(f"llama-server not found at {self.exe}: run scripts/build-backend.sh")
        if not self.model.is_file():
            raise LlamaServerError(f"{self.model}: no such model file")
        t0 = time.monotonic()
        for attempt in range(START_ATTEMPTS):
            self._launch(free_port())
            if self._wait_healthy(t0):
                log.debug("llama-server on port %s healthy after %.1f s", self.port, time.monotonic() - t0)
                return time.monotonic() - t0
            if attempt + 1 < START_ATTEMPTS and self._port_taken():
                continue
            break
        raise LlamaServerError(f"llama-server did not start: {self._failure()}")

    def _launch(self, port: int) -> None:
        """Spawn the process on ``port`` in its own session."""
        self.stop()
        self.port = port
        cmd = llama_server_argv((str(self.exe),), str(self.model), self.args, port)
        log.debug("starting %s", " ".join(cmd))
        self.child = ManagedProcess(cmd, log_path=self.log_path, env=self.extra_env)
        self.child.start()
        self._http = httpx.Client(base_url=f"http://{HOST}:{port}", timeout=self.request_timeout_s)

    def _wait_healthy(self, t0: float) -> bool:
        """Poll /health until 200; False when the process exits or the start timeout passes."""
        return self.child is not None and self.child.wait_ready(
            answers(f"http://{HOST}:{self.port}"), self.start_timeout_s, since=t0) == "ready"

    def _port_taken(self) -> bool:
        """Whether the last start failed because another process had bound the port."""
        return "bind" in self.log_tail().lower() or "address already in use" in self.log_tail().lower()

    def _failure(self) -> str:
        """Why the last start failed, for the error message."""
        child = self.child
        code = child.returncode if child is not None else None
        what = f"exited with code {code}" if code is not None else f"not healthy within {self.start_timeout_s:g} s"
        self.stop()
        return what + (child.log_note(600, 4) if child is not None else "")

    def log_tail(self, n_bytes: int = 600) -> str:
        """The last bytes of the server's log, as one line."""
        return log_tail(self.log_path, n_bytes, 4)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server's process group: SIGTERM, then SIGKILL after ``timeout_s``."""
        if self._http is not None:
            self._http.close()
            self._http = None
        if self.child is not None:
            self.child.stop(timeout_s)
        self.child = None

    # -- HTTP -------------------------------------------------------------------------------------
    @property
    def http(self) -> httpx.Client:
        """The HTTP client of the running server."""
        if self._http is None:
            raise LlamaServerError("llama-server is not running: call start() first")
        return self._http

    def request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """One JSON request; a non-2xx answer or a dead server is a :class:`LlamaServerError`."""
        try:
            resp = self.http.request(method, path, json=dict(body) if body is not None else None)
        except httpx.HTTPError as exc:
            dead = "" if self.alive else f" (server exited; log: {self.log_tail()})"
            raise LlamaServerError(f"{method} {path} failed: {type(exc).__name__}: {exc}{dead}") from exc
        if resp.status_code >= 300:
            raise LlamaServerError(f"{method} {path} answered {resp.status_code}: {resp.text[:300]}",
                                   status=resp.status_code)
        value = resp.json()
        if not isinstance(value, dict):
            raise LlamaServerError(f"{method} {path} answered {type(value).__name__}, not a JSON object")
        return value

    def completion(self, prompt: Sequence[int] | str, n_predict: int, **extra: Any) -> dict[str, Any]:
        """``POST /completion`` (greedy unless ``extra`` sets a temperature; prompt cache off)."""
        body = {"prompt": list(prompt) if not isinstance(prompt, str) else prompt, "n_predict": n_predict,
                "temperature": 0.0, "cache_prompt": False, **extra}
        return self.request("POST", "/completion", body)

    def timed_completion(self, prompt: Sequence[int], n_predict: int) -> ServerTimings:
        """Prefill ``prompt`` and decode exactly ``n_predict`` greedy tokens; the server's own timings."""
        got = self.completion(prompt, n_predict, ignore_eos=True)
        if not isinstance(got.get("timings"), dict):
            raise LlamaServerError("/completion answered without a timings object")
        return ServerTimings.model_validate(got["timings"])

    def chat(self, messages: Sequence[Mapping[str, Any]], max_tokens: int, **extra: Any) -> dict[str, Any]:
        """``POST /v1/chat/completions`` (greedy unless ``extra`` sets a temperature; prompt cache off)."""
        body = {"messages": [dict(m) for m in messages], "max_tokens": max_tokens, "temperature": 0.0,
                "cache_prompt": False, **extra}
        return self.request("POST", "/v1/chat/completions", body)

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """``POST /tokenize``: token ids of ``text``."""
        got = self.request("POST", "/tokenize", {"content": text, "add_special": add_special,
                                                 "parse_special": parse_special})
        return [int(t) for t in got.get("tokens", [])]

    def detokenize(self, tokens: Sequence[int]) -> str:
        """``POST /detokenize``: text of ``tokens`` (special tokens rendered)."""
        return str(self.request("POST", "/detokenize", {"tokens": [int(t) for t in tokens]}).get("content", ""))

    def apply_template(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """``POST /apply-template``: the prompt the server's chat template renders for ``messages``."""
        return str(self.request("POST", "/apply-template", {"messages": [dict(m) for m in messages]})["prompt"])

    def props(self) -> dict[str, Any]:
        """``GET /props``: the server's settings, template and special tokens."""
        return self.request("GET", "/props")
