"""``python -m server <plan-id-prefix>`` (= ``flux serve``): check the plan, then serve it with uvicorn.

A plan that does not match this machine (or was edited) ends the process with exit code 2 and one line
saying which field differs and how to make a new plan.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from artifacts.config import Settings, load_settings
from artifacts.errors import FluxError
from artifacts.logs import setup_logging


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The serve flags (shared with ``flux serve``)."""
    p.add_argument("plan", help="a unique prefix of a plan id (`flux plans` lists them)")
    p.add_argument("--host", help="address to listen on (default [serve] host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default [serve] port, 8090)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 and /flux routes")


def serve(settings: Settings, args: argparse.Namespace) -> int:
    """Check the plan and serve it until interrupted.

    Raises:
        FluxError: no such plan, or it does not match this machine (PlanMismatch).
    """
    import uvicorn

    from server.app import create_app
    from server.plan_check import load_checked_plan

    plan = load_checked_plan(settings, args.plan)
    app = create_app(settings, plan, api_key=args.api_key)
    host = args.host or settings.serve.host
    port = settings.serve.port if args.port is None else args.port
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5, lifespan="on")
    server = uvicorn.Server(config)
    server.run()
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
