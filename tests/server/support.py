"""Server test support: an isolated Flux environment and a real `python -m server` in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from artifacts.config import Settings, load_settings

REPO = Path(__file__).resolve().parents[2]

# Small limits so the tests can reach them quickly; everything else at its default.
SERVE_TOML = """
[serve]
min_reply = 64
queue_max = 8
queue_wait_s = 3.0
journal_ttl_s = 600.0
"""


@dataclass
class ServeEnv:
    """An isolated Flux environment (config, data, cache) and its settings."""

    env: dict[str, str]
    settings: Settings
    root: Path


def serve_env(root: Path, toml: str = SERVE_TOML) -> ServeEnv:
    """Environment variables and settings of an isolated Flux installation under ``root``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLUX_", "XDG_"))}
    config = root / "flux.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(toml)
    (root / "home").mkdir(exist_ok=True)  # Prefect keeps its database under $HOME/.prefect: a flow needs it
    env.update({"HOME": str(root / "home"), "XDG_DATA_HOME": str(root / "data"),
                "XDG_CACHE_HOME": str(root / "cache"), "XDG_CONFIG_HOME": str(root / "config"),
                "FLUX_CONFIG": str(config), "PYTHONPATH": str(REPO), "FLUX_LOG": "warning"})
    return ServeEnv(env=env, settings=load_settings(env), root=root)


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A running `python -m server` subprocess."""

    proc: subprocess.Popen[str]
    base: str
    log: Path

    def stats(self) -> dict[str, Any]:
        """GET /flux/stats."""
        out: dict[str, Any] = httpx.get(f"{self.base}/flux/stats", timeout=30).json()
        return out

    def worker_pid(self) -> int:
        """The engine worker's pid, once it is up."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            h = httpx.get(f"{self.base}/health", timeout=10).json()
            if h["worker"]["alive"] and h["worker"]["pid"]:
                return int(h["worker"]["pid"])
            time.sleep(0.1)
        raise TimeoutError("the worker did not come up")


def start_server(senv: ServeEnv, plan_id: str, *args: str) -> Server:
    """Start the server and wait until /health answers."""
    port = free_port()
    log = senv.root / f"server-{port}.log"
    proc = subprocess.Popen([sys.executable, "-m", "server", plan_id[:12], "--port", str(port), *args],
                            env=senv.env, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return Server(proc, base, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"server did not start: {log.read_text()[-3000:]}")


def stop_server(server: Server) -> None:
    """SIGINT, then kill."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)
        try:
            server.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


def sse_events(lines: list[str]) -> list[tuple[int | None, str]]:
    """(id, data) of each SSE event in the raw lines."""
    out: list[tuple[int | None, str]] = []
    eid: int | None = None
    for line in lines:
        if line.startswith("id: "):
            eid = int(line[4:])
        elif line.startswith("data: "):
            out.append((eid, line[6:]))
            eid = None
    return out


def chunk_json(data: str) -> dict[str, Any]:
    """One SSE data payload as JSON."""
    out: dict[str, Any] = json.loads(data)
    return out


def with_chat_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of the GGUF ``src`` at ``dst`` whose ``tokenizer.chat_template`` is ``template`` (same weights)."""
    import struct

    from artifacts.gguf_header import read_header

    h = read_header(src)
    raw = src.read_bytes()
    key = b"tokenizer.chat_template"

    def kv(text: str) -> bytes:
        value = text.encode()
        return struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, len(value)) + value

    old = kv(str(h.metadata["tokenizer.chat_template"]))
    meta = raw[:h.metadata_end]
    assert meta.count(old) == 1, "the template's key/value is in the header once"
    infos_end = h.metadata_end + sum(8 + len(t.name.encode()) + 4 + 8 * len(t.shape) + 4 + 8 for t in h.tensors)
    head = meta.replace(old, kv(template)) + raw[h.metadata_end:infos_end]
    head += b"\0" * (-len(head) % h.alignment)
    dst.write_bytes(head + raw[h.data_offset:])
    return dst
