"""The host's cores, shared by the CPU-heavy work of stages that run at once in a plan's first run.

The routing trace and the reference's CPU noise floor both run a big model on the CPU, beside each other (the
flow starts the reference right after the probe). Each takes an equal share of the physical cores while the
other is busy and all of them once it is done: their workers read their count from one file before each unit
of work (a traced batch, a scored sequence; :mod:`engine_bridge.worker.threads`), which :class:`CoreShare`
rewrites whenever one of them starts or ends. A fixed half each left half the cores idle for as long as the
longer of the two ran on alone (the H200 host, run 19: the trace ended 60 s before the floor).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

log = logging.getLogger(__name__)


class CoreShare:
    """Who is using the cores now, and the file that tells their workers how many threads each may run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: dict[str, int] = {}  # name -> how many uses are under way
        self._cores = 1
        # written while someone is busy, removed when no one is (a worker that finds no file keeps its threads)
        self.path = Path(tempfile.gettempdir()) / f"flux-cores-{os.getpid()}-{id(self):x}.txt"

    def threads(self) -> int:
        """Each busy user's share of the cores (all of them for one alone)."""
        with self._lock:
            return self._share()

    def _share(self) -> int:
        return max(1, self._cores // max(1, len(self._busy)))

    def _write(self) -> None:
        """Tell the workers; a file that cannot be written leaves them with the threads they have."""
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(str(self._share()))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("cores: cannot write %s (%s): the workers keep their threads", self.path, exc)

    @contextmanager
    def busy(self, name: str, cores: int) -> Iterator[CoreShare]:
        """``name`` uses the CPU for the block, on ``cores`` physical cores shared with the others busy."""
        with self._lock:
            self._cores = max(1, cores)
            self._busy[name] = self._busy.get(name, 0) + 1
            self._write()
        try:
            yield self
        finally:
            with self._lock:
                self._busy[name] -= 1
                if not self._busy[name]:
                    del self._busy[name]
                if self._busy:
                    self._write()
                else:
                    with suppress(OSError):
                        self.path.unlink(missing_ok=True)
