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
COMMAND_MODULES = ("flows.cmd_models", "flows.cmd_plan", "flows.cmd_serve", "flows.cmd_bench", "flows.cmd_backend",
                   "flows.cmd_sql", "flows.cmd_rpc")


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (what is wrong, where to look) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser; every command module registers its subcommands."""
    parser = OneLineParser(
        prog="flux",
        description="Flux: measured execution plans for LLM inference on llama.cpp.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=OneLineParser)
    import importlib

    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``flux`` console script."""
    err = console(stderr=True)
    parser = build_parser()
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
