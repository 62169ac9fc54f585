"""CPU threads that follow a file: work that shares the host's cores with another stage's (a routing trace beside
a noise-floor pass) reads the count it may use from a file its planner rewrites, before each unit of work, and
takes all the cores once the other is done instead of keeping half of them idle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llama_cpp


class SharedThreads:
    """``apply(ctx)`` sets the context's threads (decode and batch) to the file's count when it changed; a file
    that is missing or unreadable leaves them as they are."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self.now = 0

    def read(self) -> int:
        """The count the file holds, 0 when there is none."""
        if self.path is None:
            return 0
        try:
            return max(0, int(self.path.read_text().strip() or 0))
        except (OSError, ValueError):
            return 0

    def apply(self, ctx: Any) -> int:
        """Follow the file; the threads now in use (0: never set here)."""
        n = self.read()
        if n and n != self.now:
            llama_cpp.llama_set_n_threads(ctx, n, n)
            self.now = n
        return self.now
