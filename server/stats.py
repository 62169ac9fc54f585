"""Counters and rates for ``/flux/stats``: requests by outcome, recent tokens per second, memory by use."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Outcome = Literal["completed", "errored", "cancelled", "rejected_400", "rejected_409", "rejected_429", "rejected_503"]
OUTCOMES: tuple[Outcome, ...] = ("completed", "errored", "cancelled", "rejected_400", "rejected_409", "rejected_429",
                                 "rejected_503")
_REJECTED: dict[int, Outcome] = {409: "rejected_409", 429: "rejected_429", 503: "rejected_503"}
RATE_WINDOW_S = 10.0


@dataclass
class Counters:
    """Requests by outcome, error responses by HTTP status, and generated tokens, with a sliding window for
    the recent token rate."""

    clock: Callable[[], float] = time.monotonic
    requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    errors: dict[str, int] = field(default_factory=dict)  # error responses by status ("500": 2)
    tokens_total: int = 0
    _recent: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)

    def outcome(self, what: Outcome) -> None:
        """Count one request's outcome."""
        self.requests[what] = self.requests.get(what, 0) + 1

    def rejected(self, status: int) -> None:
        """Count a request refused before it ran: 409, 429 and 503 by name, other 4xx as rejected_400, other
        5xx as errored."""
        self.requests[_REJECTED.get(status, "rejected_400" if 400 <= status < 500 else "errored")] += 1

    def error_response(self, status: int) -> None:
        """Count an error response the server sent (any route, any cause: a 500 from a bug included)."""
        self.errors[str(status)] = self.errors.get(str(status), 0) + 1

    def tokens(self, n: int) -> None:
        """Count generated tokens."""
        now = self.clock()
        self.tokens_total += n
        if self._recent and now - self._recent[-1][0] < 0.05:  # coalesce: one bucket per 50 ms
            t, k = self._recent[-1]
            self._recent[-1] = (t, k + n)
        else:
            self._recent.append((now, n))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()

    def tokens_per_s(self) -> float:
        """Generated tokens per second over the last RATE_WINDOW_S seconds."""
        now = self.clock()
        self._trim(now)
        return sum(n for _, n in self._recent) / RATE_WINDOW_S


def memory_by_use(weights: Mapping[str, int], kv_reserved: Mapping[str, int], worker: Mapping[str, Any] | None,
                  journal_bytes: int) -> dict[str, Any]:
    """Bytes by use: weights and reserved KV per device (from the plan), KV in use and parked states (from the
    worker, None while it is down), and the journal."""
    parked = (worker or {}).get("parked") or {}
    return {
        "weights": dict(weights),
        "kv_reserved": dict(kv_reserved),
        "kv": (worker or {}).get("kv_bytes"),
        "parked": parked.get("bytes"),
        "parked_limit": parked.get("limit"),
        "parked_count": parked.get("count"),
        "journal": journal_bytes,
    }
