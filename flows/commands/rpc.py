"""``flux rpc-server``: llama.cpp's rpc-server from this Flux build, so other machines' plans can use this one's
devices (``flux plan --rpc HOST:PORT``).

The server answers Flux's build-id command with this build's id: a client of another build refuses it at plan
and serve time, naming both ids. The protocol has no authentication: the server binds 127.0.0.1 unless told
otherwise, and then warns (reach it through an SSH tunnel or a private network; docs/rpc.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from artifacts.errors import FluxError
from artifacts.logs import console
from artifacts.native_switches import BUILD_ID
from engine_bridge.backend import backend_info, llama_server_path

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``flux rpc-server`` to the ``flux`` parser."""
    p = sub.add_parser("rpc-server", help="serve this machine's devices to other Flux machines (llama.cpp RPC)",
                       description="Runs llama.cpp's rpc-server from this Flux build until interrupted. Other "
                                   "machines plan with `flux plan --rpc HOST:PORT`. The protocol has no "
                                   "authentication: keep it on 127.0.0.1 behind an SSH tunnel or on a private "
                                   "network.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50052, help="TCP port (default 50052)")
    p.add_argument("--devices", default=None, help="devices to serve, e.g. CUDA0,CPU (default: every device)")
    p.add_argument("--threads", type=int, default=None, help="threads of the CPU device")
    p.add_argument("--cache", action="store_true", help="keep received weights in a local file cache")
    p.set_defaults(handler=cmd_rpc_server)


def rpc_server_path(cache_dir: Path) -> Path:
    """The rpc-server built beside this build's llama-server.

    Raises:
        FluxError: the installed build has none (built before RPC support).
    """
    server = llama_server_path(cache_dir)
    exe = server.with_name("rpc-server") if server else None
    if exe is None or not exe.is_file():
        raise FluxError("this backend build has no rpc-server: rebuild it with scripts/build-backend.sh")
    return exe


def cmd_rpc_server(args: argparse.Namespace) -> int:
    """Become rpc-server, in the foreground, with this build's id (its exit code is this command's)."""
    if not 0 < args.port < 65536:
        raise FluxError(f"--port {args.port}: expected 1-65535")
    if args.threads is not None and args.threads < 1:
        raise FluxError(f"--threads {args.threads}: expected 1 or more")
    exe = rpc_server_path(args.settings.cache_dir)
    build = backend_info(args.settings.cache_dir).build_id
    err = console(stderr=True)
    if args.host not in LOOPBACK:
        err.print(f"[bold yellow]warning:[/] binding {args.host}: the RPC protocol has no authentication, anyone who "
                  f"reaches {args.host}:{args.port} can use this machine's devices and memory; prefer 127.0.0.1 "
                  "with an SSH tunnel, or a private network (docs/rpc.md)")
    cmd = [str(exe), "--host", args.host, "--port", str(args.port)]
    if args.devices:
        cmd += ["--device", args.devices]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.cache:
        cmd.append("--cache")
    err.print(f"flux rpc-server: build {build} on {args.host}:{args.port} (Ctrl-C stops it)")
    sys.stderr.flush()
    # the server replaces this process: a signal (Ctrl-C, SIGTERM from a supervisor) reaches it, not a wrapper
    os.execve(exe, cmd, {**os.environ, **BUILD_ID.env(build)})
