"""``flux serve <plan-id-prefix>``: the OpenAI-compatible server (same as ``python -m server``)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``serve`` to the ``flux`` parser."""
    from server.__main__ import add_arguments

    p = sub.add_parser("serve", help="serve a plan behind an OpenAI-compatible API",
                       description="Checks the plan against this machine (model hashes, hardware, backend build, "
                                   "driver; exit 2 on a mismatch), starts the engine worker and serves /v1 on "
                                   "127.0.0.1:8090 by default.")
    add_arguments(p)
    p.set_defaults(handler=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the plan until interrupted."""
    from server.__main__ import serve

    return serve(args.settings, args)
