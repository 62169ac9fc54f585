"""The servers ``flux bench serve`` starts: ``flux serve`` of the plan, and the peers given the plan's flags.

Each is a context manager that yields the server's base URL and stops it on the way out: ``flux serve``
(``python -m server <plan>``), llama-cpp-python's ``python -m llama_cpp.server`` (needs
``pip install -e '.[bench]'``) and llama.cpp's ``llama-server``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from artifacts.engine_params import EngineParams
from engine_bridge.llama_server import HOST, LlamaServer, free_port
from tasks.bench.context import BenchContext
from tasks.bench.errors import BenchError
from tasks.bench.http import FluxServe

PEERS = ("flux", "llama-cpp-python", "llama-server")


@contextmanager
def flux_serve(ctx: BenchContext) -> Iterator[str]:
    """A running ``python -m server <plan>`` (what ``flux serve`` runs); yields its base URL."""
    srv = FluxServe(ctx.settings, ctx.plan.id, log_path=ctx.settings.logs_dir / "bench-serve.log",
                    start_timeout_s=ctx.timeout_s)
    srv.start()
    try:
        yield srv.base
    finally:
        srv.stop()


@contextmanager
def llama_cpp_python_server(ctx: BenchContext, p: EngineParams) -> Iterator[str]:
    """``python -m llama_cpp.server`` with the plan's flags; yields its base URL.

    ``--interrupt_requests False``: by default a new request aborts the stream in progress (the server runs
    one at a time), which would make concurrent streams fail instead of wait their turn.

    Raises:
        BenchError: it exited (e.g. without the ``bench`` extra) or did not answer in time.
    """
    port = free_port()
    log_path = ctx.settings.logs_dir / "bench-serve-llama-cpp-python.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(ctx.model), "--n_ctx", str(p.n_ctx), "--n_batch",
           str(p.n_batch), "--n_ubatch", str(p.n_ubatch), "--n_threads", str(p.n_threads), "--n_threads_batch",
           str(p.n_threads_batch), "--flash_attn", str(p.flash_attn), "--n_gpu_layers", str(p.n_gpu_layers),
           "--interrupt_requests", "False", "--host", HOST, "--port", str(port)]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, **p.environment()})
        base = f"http://{HOST}:{port}"
        try:
            _wait_ready(proc, base, ctx.timeout_s, log_path.name)
            yield base
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


def _wait_ready(proc: subprocess.Popen[bytes], base: str, timeout_s: float, log_name: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"python -m llama_cpp.server exited with {proc.returncode} (`pip install -e "
                             f"'.[bench]'` installs it): see {log_name} in Flux's logs")
        try:
            if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.2)
    raise BenchError(f"python -m llama_cpp.server did not answer within {timeout_s:g} s: see {log_name}")


@contextmanager
def llama_server(ctx: BenchContext, p: EngineParams) -> Iterator[str]:
    """llama.cpp's llama-server with the plan's flags (``-c`` = ctx x slots); yields its base URL.

    Raises:
        BenchError: llama-server is not built.
    """
    args = p.server_args()
    srv = LlamaServer(ctx.need_llama_server(), ctx.model, args, log_path=ctx.settings.logs_dir /
                      "bench-serve-llama-server.log", env=p.environment(), start_timeout_s=ctx.timeout_s,
                      request_timeout_s=ctx.timeout_s)
    srv.start()
    try:
        yield f"http://{HOST}:{srv.port}"
    finally:
        srv.stop()
