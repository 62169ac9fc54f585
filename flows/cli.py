"""The ``flux`` command: a registry of subcommands, each in its own module.

Errors a person can fix (``FluxError``) end the process with exit code 2 and one line naming the file
and the problem; no traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from rich.markup import escape

from artifacts.config import load_settings
from artifacts.errors import FluxError
from artifacts.logs import console, setup_logging

Handler = Callable[[argparse.Namespace], int]
COMMAND_MODULES = ("flows.commands.models", "flows.commands.plan", "flows.commands.serve", "flows.commands.bench", "flows.commands.backend",
                   "flows.commands.sql", "flows.commands.rpc", "flows.commands.fetch", "flows.commands.convert")
# The module that registers each command: a command line naming one builds that module's parsers only, so that
# `flux plan` of a saved plan and `flux serve` do not import every other command's dependencies first (the bench
# suites, the synthesizer, the structure check's protocol: 0.5-1 s of a 2-core machine's start). `flux --help`, and
# a name that is none of these, build them all (tests/flows/test_cli_dispatch.py checks this against them).
COMMANDS: dict[str, str] = {
    "synth": "flows.commands.models", "inspect": "flows.commands.models",
    "plan": "flows.commands.plan", "plans": "flows.commands.plan", "show": "flows.commands.plan", "deploy": "flows.commands.plan",
    "serve": "flows.commands.serve", "bench": "flows.commands.bench",
    "version": "flows.commands.backend", "config": "flows.commands.backend", "devices": "flows.commands.backend",
    "generate": "flows.commands.backend", "sql": "flows.commands.sql", "rpc-server": "flows.commands.rpc",
    "fetch": "flows.commands.fetch", "convert": "flows.commands.convert",
}


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (what is wrong, where to look) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message}; see `{self.prog} --help`\n")


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser: every command module registers its subcommands; with ``argv`` naming a command,
    only the module that registers it does (:data:`COMMANDS`)."""
    parser = OneLineParser(
        prog="flux",
        description="Flux: measured execution plans for LLM inference on llama.cpp.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=OneLineParser)
    import importlib

    only = COMMANDS.get(argv[0], "") if argv else ""
    for name in (only,) if only in COMMAND_MODULES else COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``flux`` console script."""
    err = console(stderr=True)
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
        setup_logging(settings.log_filter)
        args.settings = settings
        handler: Handler = args.handler
        return handler(args)
    except FluxError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)  # a message may hold [brackets]
        return 2
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
