"""``python -m server <plan-id-prefix>`` (= ``flux serve``): check the plan, then serve it with uvicorn.

Everything a person can get wrong ends the process with exit code 2 and one line saying what and how to
fix it, before the model is loaded: a bad flag, a port already in use, an empty or unreadable API key, a
plan that does not match this machine (or was edited), a ``--model`` file whose content is not the plan's, a
``--chat-template`` that names no built-in template, a ``--chat-template-file`` that cannot be read or rendered.

The API key comes from ``--api-key-file``, then ``FLUX_API_KEY``, then (visible to every user in ``ps``)
``--api-key``. Without one, every local process may use the server, including
``POST /flux/admission`` (which can make it refuse all work until restart).
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from artifacts.config import Settings, load_settings
from artifacts.errors import FluxError
from artifacts.logs import setup_logging

if TYPE_CHECKING:
    from server.chat import TemplateOverride

log = logging.getLogger(__name__)
# server.errors (Litestar, uvicorn) is imported where a serve error is raised: every `flux` command builds this
# module's flags, and importing Litestar cost them 0.2 s


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is outside 0-65535")
    return port


def _one_line_errors(p: argparse.ArgumentParser) -> None:
    """Flag errors as one line and exit code 2 (argparse's own print the usage first)."""

    def error(message: str) -> NoReturn:
        sys.stderr.write(f"error: {p.prog}: {message} (see --help)\n")
        sys.exit(2)

    p.error = error  # type: ignore[method-assign]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The serve flags (shared with ``flux serve``); a bad one is one line and exit code 2."""
    _one_line_errors(p)
    p.add_argument("plan", help="a unique prefix of a plan id (`flux plans` lists them)")
    p.add_argument("--host", help="address to listen on (default [serve] host, 127.0.0.1)")
    p.add_argument("--port", type=_port, help="port to listen on (default [serve] port, 8090)")
    p.add_argument("--api-key-file", type=Path, help="require 'Authorization: Bearer KEY' on /v1, /flux and "
                   "/metrics, KEY being this file's content (or set FLUX_API_KEY)")
    p.add_argument("--api-key", help="the key itself (visible to other users in `ps`: prefer --api-key-file or "
                   "FLUX_API_KEY)")
    p.add_argument("--model", type=Path, help="serve the plan's model from this file (another copy or path of "
                   "the same bytes: its content hash must match the plan's)")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat-template", metavar="NAME", type=_template_name,
                      help="render chat prompts with this llama.cpp built-in template instead of the GGUF's "
                           "(llama-server's names: chatml, llama2, llama3, gemma, mistral-v7, phi3, deepseek3, ...; "
                           "a wrong one lists them all)")
    chat.add_argument("--chat-template-file", metavar="PATH", type=Path,
                      help="render chat prompts with this Jinja template instead of the GGUF's")


def _template_name(text: str) -> str:
    from server.chat_templates import check_name  # light: no jinja2, no Litestar

    try:
        return check_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def chat_template(args: argparse.Namespace) -> TemplateOverride | None:
    """The chat template the flags ask for, or None for the GGUF's own (or its family's).

    Raises:
        ServeSetupError: the ``--chat-template-file`` cannot be read, does not compile or does not render.
    """
    from server.chat import TemplateOverride, template_file

    if getattr(args, "chat_template_file", None) is not None:
        return template_file(args.chat_template_file)
    name = getattr(args, "chat_template", None)
    return TemplateOverride(name) if name else None


def _read_key_file(path: Path, what: str) -> str:
    from server.errors import ServeSetupError

    try:
        text = path.expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ServeSetupError(f"{what} {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from exc
    return text.strip()


def api_key(settings: Settings, args: argparse.Namespace) -> str | None:
    """The API key to require, or None for an open server.

    Raises:
        ServeSetupError: the key given is empty or its file cannot be read.
    """
    from server.errors import ServeSetupError

    sources: list[tuple[str, str | None]] = []
    if args.api_key_file is not None:
        sources.append(("--api-key-file", _read_key_file(args.api_key_file, "--api-key-file")))
    if settings.api_key is not None:
        sources.append(("FLUX_API_KEY", settings.api_key.get_secret_value().strip()))
    if args.api_key is not None:
        sources.append(("--api-key", args.api_key.strip()))
    if not sources:
        return None
    name, key = sources[0]
    if not key:
        raise ServeSetupError(f"{name} gives an empty API key: give a non-empty one, or none to serve without a key")
    if name == "--api-key":
        log.warning("--api-key puts the key on the command line, where other users see it (`ps`): use "
                    "--api-key-file or FLUX_API_KEY")
    return key


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (uvicorn listens on it once the model is loaded).

    Raises:
        ServeSetupError: the address is in use or cannot be bound.
    """
    from server.errors import ServeSetupError

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ServeSetupError(f"--host {host}: cannot resolve it ({exc.strerror})") from exc
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        hint = "another server listens there: stop it or pass --port" if exc.errno == 98 else "pass another --host/--port"
        raise ServeSetupError(f"cannot listen on {host}:{port}: {exc.strerror}; {hint}") from exc
    return sock


def serve(settings: Settings, args: argparse.Namespace) -> int:
    """Check the plan, the key and the port, then serve until interrupted.

    Raises:
        FluxError: no such plan, it does not match this machine (PlanMismatch), or ServeSetupError.
    """
    from server.plan_check import load_checked_plan

    key = api_key(settings, args)
    template = chat_template(args)
    host = args.host or settings.serve.host
    port = settings.serve.port if args.port is None else args.port
    sock = bind(host, port)  # before loading anything: a busy port fails in a second, not after the load
    try:
        plan, model = load_checked_plan(settings, args.plan, args.model)
        # the app's imports (Litestar, uvicorn, the routes: a second or more of a 2-core machine) come once the plan
        # is known good: a plan refused here is said without them
        import uvicorn

        from server.app import create_app
        from server.transport import guarded_protocol

        app = create_app(settings, plan, api_key=key, model_path=model, chat_template=template)
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                                lifespan="on", timeout_keep_alive=int(max(1, settings.serve.keep_alive_s)),
                                http=guarded_protocol(settings.serve, app.state.flux.metrics.refused))
        server = uvicorn.Server(config)
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m server``."""
    parser = argparse.ArgumentParser(prog="python -m server",
                                     description="Serve a Flux plan behind an OpenAI-compatible API.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
        setup_logging(settings.log_filter)
        return serve(settings, args)
    except FluxError as exc:
        sys.stderr.write(f"error: {' '.join(str(exc).split())}\n")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
