"""Logging set-up for people: rich on a terminal, a filter from FLUX_LOG.

``FLUX_LOG`` is a comma-separated list of ``level`` or ``logger=level`` items, e.g. ``info`` or
``warning,tasks.measurement.rounds=debug``.
"""

from __future__ import annotations

import logging

from rich.console import Console
from rich.logging import RichHandler

_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
           "warning": logging.WARNING, "error": logging.ERROR, "off": logging.CRITICAL + 10}
FLUX_LOGGERS = ("flows", "tasks", "artifacts", "engine_bridge", "server")


def parse_filter(spec: str) -> tuple[int, dict[str, int]]:
    """Parse a FLUX_LOG filter into (default level, {logger: level}); unknown levels mean info."""
    default = logging.INFO
    per: dict[str, int] = {}
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        name, _, level = item.rpartition("=")
        value = _LEVELS.get(level.lower(), logging.INFO)
        if name:
            per[name] = value
        else:
            default = value
    return default, per


def setup_logging(spec: str, stderr: bool = True) -> None:
    """Route Flux's loggers through rich with the levels ``spec`` asks for."""
    default, per = parse_filter(spec)
    handler = RichHandler(console=Console(stderr=stderr), show_path=False, rich_tracebacks=False)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name in FLUX_LOGGERS:
        log = logging.getLogger(name)
        log.handlers[:] = [handler]
        log.setLevel(default)
        log.propagate = False
    for name, level in per.items():
        logging.getLogger(name).setLevel(level)


def console(stderr: bool = False) -> Console:
    """A rich console for command output; wide when not a terminal, so pipes and logs get whole lines."""
    c = Console(stderr=stderr, highlight=False)
    if not c.is_terminal:
        c = Console(stderr=stderr, highlight=False, width=200)
    return c
