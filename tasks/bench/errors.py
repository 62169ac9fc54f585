"""The bench suites' typed errors."""

from __future__ import annotations

from artifacts.errors import FluxError


class BenchError(FluxError):
    """A benchmark cannot run as asked (missing model, engine, or data); the message says what to do."""
