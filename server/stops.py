"""Stop sequences matched on the generated text, across token boundaries.

Text that might be the start of a stop sequence is held back until the next piece decides it, so a client
never sees part of a stop sequence. The reply ends right before the stop sequence that is complete first, as
the text grows character by character (of two that complete at once, the longer), so how the text was split
into tokens never changes where it ends: with stops ``|`` and ``a|<``, ``a|<`` ends as ``a`` in one piece or in
three.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed generated text piece by piece; get back the text safe to emit."""

    def __init__(self, stops: Sequence[str]) -> None:
        """Match ``stops`` (non-empty strings); none means every piece passes through at once."""
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._buf = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add a piece; return the text now safe to emit (nothing once a stop sequence matched)."""
        if self.stopped:
            return ""
        buf = self._buf + text
        hits = [(i + len(s), i) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self.stopped = True
            self._buf = ""
            return buf[: min(hits)[1]]
        keep = self._held_suffix(buf)
        self._buf = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back text, at the end of generation (it did not become a stop sequence)."""
        out, self._buf = ("" if self.stopped else self._buf), ""
        return out

    def _held_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that starts some stop sequence."""
        for k in range(min(len(buf), self._hold), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
