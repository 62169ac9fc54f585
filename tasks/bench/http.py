"""Talking to a `flux serve` subprocess as a client sees it: start/stop it, one HTTP exchange, SSE parsing.

Shared by the soak, arrivals, serve and ttft suites.
"""


from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

import httpx

from artifacts.config import Settings
from engine_bridge.llama_server import free_port
from tasks.bench.errors import BenchError

if TYPE_CHECKING:

    pass

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
# Benchmark clients open a connection per request. llama-server (cpp-httplib) sometimes drops a pooled
# connection after a streamed chat reply: the next request on it fails at once with "Server disconnected
# without sending a response". On this 2-core VM, under load, 8 of 80 two-turn chats beside five arrivals
# failed so with pooling (with idle connections dropped after 1 s, too), and 0 of 80 without. A localhost
# connect costs both engines the same fraction of a millisecond.


def client_limits(max_connections: int | None = None) -> httpx.Limits:
    """Connection limits for a benchmark client: at most ``max_connections`` at once, none kept for reuse."""
    return httpx.Limits(max_connections=max_connections, max_keepalive_connections=0)
START_ATTEMPTS = 3
Outcome = Literal["completed", "errored", "cancelled", "resumed", "hung", "lost"]
OUTCOMES: tuple[Outcome, ...] = ("completed", "errored", "cancelled", "resumed", "hung", "lost")
OnEvent = Callable[[int], Awaitable[None]]


# -- flux serve as a subprocess -----------------------------------------------------------------------
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, dict):  # an inline table
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))  # a JSON string is a TOML basic string


def serve_toml(settings: Settings) -> str:
    """A flux.toml that gives a server subprocess exactly these settings' locations and [serve] section."""
    lines = [f"{k} = {_toml_value(getattr(settings, k))}" for k in ("models_dir", "cache_dir", "data_dir",
                                                                      "host_reserve_percent")]
    # TOML has no null: a setting left at None (serve.kv_host_bytes) is left out, which gives it its default
    lines += ["", "[serve]"] + [f"{k} = {_toml_value(v)}" for k, v in
                                settings.serve.model_dump(exclude={"worker_timeouts"}).items() if v is not None]
    lines += ["", "[serve.worker_timeouts]"] + [f"{k} = {_toml_value(v)}" for k, v in
                                                settings.serve.worker_timeouts.model_dump().items()]
    return "\n".join(lines) + "\n"


class FluxServe:
    """``python -m server <plan>`` (what ``flux serve`` runs) on a free loopback port."""

    def __init__(self, settings: Settings, plan_id: str, *, log_path: Path, start_timeout_s: float = 300.0) -> None:
        """Describe the server; nothing starts before :meth:`start`."""
        self.settings, self.plan_id, self.log_path = settings, plan_id, log_path
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.base = ""
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> float:
        """Start the server and wait until ``/health`` answers 200; returns the seconds that took.

        Raises:
            BenchError: the server exited (its last log lines say why, e.g. a plan mismatch) or stayed unhealthy.
        """
        self._dir = tempfile.TemporaryDirectory(prefix="flux-bench-serve-")
        config = Path(self._dir.name) / "flux.toml"
        config.write_text(serve_toml(self.settings))
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLUX_")}
        env.update({"FLUX_CONFIG": str(config), "FLUX_LOG": self.settings.log_filter,
                    "FLUX_NATIVE_LOG": self.settings.native_log})
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        t0 = time.monotonic()
        for _attempt in range(START_ATTEMPTS):  # a port picked free can be taken before the server binds it
            port = free_port()
            self.base = f"http://{HOST}:{port}"
            proc = self.proc = subprocess.Popen(
                [sys.executable, "-m", "server", self.plan_id, "--host", HOST, "--port", str(port)], cwd=REPO_ROOT,
                env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
            if self._healthy(t0):
                return time.monotonic() - t0
            if proc.poll() is None or "address already in use" not in self._tail().lower():
                break
        why = (f"exited with code {proc.returncode}" if proc.poll() is not None
               else f"was not healthy within {self.start_timeout_s:g} s")
        tail = self._tail()
        self.stop()
        raise BenchError(f"flux serve {why}: {tail}")

    def _healthy(self, t0: float) -> bool:
        """Poll /health until 200; False when the process exits or the start timeout passes."""
        while time.monotonic() - t0 < self.start_timeout_s and self.proc is not None and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.base}/health", timeout=2.0).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.1)
        return False

    def _tail(self, n_bytes: int = 2000) -> str:
        """The last lines of the server's log, as one line."""
        if self._log is not None:
            self._log.flush()
        if not self.log_path.is_file():
            return f"see {self.log_path}"
        with self.log_path.open("rb") as f:
            f.seek(max(0, self.log_path.stat().st_size - n_bytes))
            text = f.read().decode("utf-8", errors="replace")
        return " | ".join(line.strip() for line in text.splitlines()[-3:] if line.strip()) or f"see {self.log_path}"

    @property
    def alive(self) -> bool:
        """True while the server process runs."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGINT (the lifespan stops the worker), then SIGKILL of the process group."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not None:
            self._log.close()
        if self._dir is not None:
            self._dir.cleanup()
        self._log = self._dir = None


# -- one HTTP exchange, as the client saw it ----------------------------------------------------------
@dataclass
class Exchange:
    """What one request got: status, SSE events (id, data) with the times they were read, or a body."""

    t0: float
    status: int | None = None
    retry_after: str | None = None
    sse: bool = False
    body: str = ""
    events: list[tuple[int | None, str]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    done: bool = False
    hung: bool = False
    transport: str | None = None

    @property
    def max_gap_s(self) -> float | None:
        """Longest wait for an event (from the request for the first)."""
        ts = [self.t0, *self.times]
        return max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=None)


async def exchange(client: httpx.AsyncClient, method: str, url: str, *, body: dict[str, Any] | None = None,
                   headers: dict[str, str] | None = None, params: dict[str, Any] | None = None,
                   stop_after: int | None = None, read_delay_s: float = 0.0, on_event: OnEvent | None = None,
                   ) -> Exchange:
    """Send one request and read its answer; a stream is read event by event.

    ``stop_after`` closes the connection after that many events (the server sees the client leave);
    ``read_delay_s`` sleeps after each event (a slow reader); ``on_event(n)`` runs after the n-th event.
    The client's read timeout is the hang timeout: no byte for that long marks the exchange ``hung``.
    """
    ex = Exchange(t0=time.perf_counter())
    try:
        async with client.stream(method, url, json=body, headers=headers, params=params) as r:
            ex.status, ex.retry_after = r.status_code, r.headers.get("retry-after")
            ex.sse = r.headers.get("content-type", "").startswith("text/event-stream")
            if not ex.sse:
                ex.body = (await r.aread()).decode("utf-8", "replace")
                return ex
            eid: int | None = None
            async for line in r.aiter_lines():
                if line.startswith("id:"):
                    eid = int(line[3:].strip()) if line[3:].strip().isdigit() else None
                elif line.startswith("data:"):
                    data, eid_now, eid = line[5:].strip(), eid, None
                    if data == "[DONE]":
                        ex.done = True
                        continue
                    ex.events.append((eid_now, data))
                    ex.times.append(time.perf_counter())
                    if on_event is not None:
                        await on_event(len(ex.events))
                    if stop_after is not None and len(ex.events) >= stop_after:
                        break
                    if read_delay_s > 0:
                        await asyncio.sleep(read_delay_s)
    except httpx.TimeoutException:
        ex.hung = True
    except httpx.HTTPError as exc:
        ex.transport = f"{type(exc).__name__}: {exc}"[:200]
    return ex


def json_object(data: str) -> dict[str, Any]:
    """``data`` parsed as a JSON object; {} when it is not one."""
    try:
        value = json.loads(data)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def error_body(ex: Exchange) -> dict[str, Any] | None:
    """The OpenAI error object of an answer (body) or of a stream's last event; None when there is none."""
    doc = json_object(ex.body) if not ex.sse else (json_object(ex.events[-1][1]) if ex.events else {})
    err = doc.get("error")
    return err if isinstance(err, dict) and "message" in err else None


def finish_reason(events: list[tuple[int | None, str]]) -> str | None:
    """The last finish_reason in a stream's events; Flux's own (``flux.finish_reason``, e.g. "cancelled", which
    OpenAI's field cannot carry) first."""
    for _, data in reversed(events):
        for choice in json_object(data).get("choices") or []:
            own = (choice.get("flux") or {}).get("finish_reason")
            if own or choice.get("finish_reason"):
                return str(own or choice["finish_reason"])
    return None
