"""The routing watch: the share of a MoE model's expert picks that the plan's GPU copies serve, live.

The native worker counts the picks of one decode step in ``[serve.routing] sample_every``
(:mod:`engine_bridge.worker.serve_routing`). Every ``check_s`` seconds, and on each ``/flux/stats`` or ``/metrics``,
the service asks it for the counts (``serve_routing``): the live share beside the plan's (the mean over layers of
each layer's share of picks on its hot experts, as the plan's ``Candidate.hot_share`` records it on the planning
trace), the recent share over the last ``window_tokens`` sampled tokens, and the counts in all. Once that window is
full and its share is ``warn_points`` or more below the plan's, the server logs one warning naming
``flux plan <model> --routing-from <plan>``. A plan without per-expert copies (a dense model, whole expert
tensors) has no share to watch: it reports ``not applicable``, and counts a MoE model's picks (whose trace can
re-fit a plan) only with ``[serve.routing] count = "moe"``: the eval callback, even asking for nothing, costs every
decode step a Python call per graph node (scripts/bench_serve_routing.py). Counting is off by default
(``count = "off"``) until its cost on a GPU is measured: there the callback also makes llama.cpp's scheduler run
each split as views and wait for it, and a CUDA build's callback once crashed a tracing worker reading ids
computed on the GPU (tasks/probing/trace.py); ``count = "split"`` turns the watch on.

The trace (counts over every worker this server started, and over earlier runs of the same plan) is saved on each
look that found new picks and when the server stops, to ``<data_dir>/served-routing/<plan id>.parquet``
(:mod:`engine_bridge.serve_trace`); ``GET /flux/routing`` returns it.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from artifacts.config import RoutingWatch as WatchSettings
from artifacts.model_info import model_info
from artifacts.records.plan import Plan
from engine_bridge.errors import RoutingMismatch
from engine_bridge.ops import ServeRouting
from engine_bridge.routing_trace import check_routing_table
from engine_bridge.serve_trace import read_trace, served_table, served_trace_path, trace_meta, write_trace

if TYPE_CHECKING:
    from server.supervisor import WorkerSupervisor

log = logging.getLogger(__name__)

NOT_APPLICABLE = "not applicable: the plan keeps no per-expert GPU copies"


def counts_routing(plan: Plan, model_path: Path, count: str = "off") -> bool:
    """The server counts picks for a MoE model served by the native worker (another engine has no such op): with
    ``count`` ``split`` only where the plan keeps per-expert GPU copies, with ``moe`` for every MoE plan, with
    ``off`` never."""
    if plan.engine is not None and not plan.engine.native:
        return False
    if count == "off" or (count == "split" and plan.candidate.params.expert_split is None):
        return False
    try:
        return model_info(model_path).is_moe
    except Exception as exc:  # noqa: BLE001 - the plan check has read this header; counting is only a report
        log.warning("routing watch off: cannot read %s: %s", model_path, exc)
        return False


def plan_hot_share(plan: Plan) -> float | None:
    """The share of the planning trace's picks on the plan's GPU copies; None without per-expert copies."""
    c = plan.candidate
    if c.params.expert_split is None or not c.hot_share:
        return None
    return sum(c.hot_share) / len(c.hot_share)


def hot_share(counts: NDArray[np.int64], hot: NDArray[np.bool_]) -> float | None:
    """Mean over layers of each layer's share of picks on its hot experts (None before any pick)."""
    totals = counts.sum(axis=1)
    if not totals.any():
        return None
    return float(np.mean(np.divide((counts * hot).sum(axis=1), np.maximum(totals, 1))))


class RoutingWatch:
    """Counts, shares and the warning of one served plan (owned by the service)."""

    def __init__(self, settings: WatchSettings, plan: Plan, data_dir: Path, model_path: Path, every: int) -> None:
        """``every``: the worker counts one decode step in this many (its load spec's; 0: it counts nothing)."""
        self.settings, self.plan, self.model_path, self.every = settings, plan, model_path, every
        self.plan_share = plan_hot_share(plan)
        self.path = served_trace_path(data_dir, plan.id)
        self.warned = False
        self.last: ServeRouting | None = None  # the current worker's latest report
        self._restarts = 0
        self._base: NDArray[np.int64] | None = None  # earlier workers' and earlier runs' counts
        self._base_tokens = self._base_steps = 0
        self._saved_tokens = -1
        self._arch, self._n_used = "", 0

    def resume(self) -> None:
        """Start from the trace an earlier run of this plan saved (one of another model or shape is left alone)."""
        if not self.path.is_file():
            return
        try:
            table = read_trace(self.path)
            meta = trace_meta(table)
            counts = check_routing_table(table, self.plan.model_hash, int(meta["n_layer"]), int(meta["n_expert"]))
        except (OSError, pa.ArrowException, RoutingMismatch, KeyError, ValueError) as exc:
            log.warning("routing watch: %s is not this plan's trace (%s); it will be replaced", self.path, exc)
            return
        self._base, self._base_tokens = counts, int(meta.get("n_tokens", 0))
        self._base_steps = int(meta.get("steps", 0))
        self._arch, self._n_used = meta.get("architecture", ""), int(meta.get("n_expert_used", 0))
        self._saved_tokens = self._base_tokens

    async def look(self, engine: WorkerSupervisor) -> None:
        """Ask the worker for its counts, check the warning's rule and save new picks."""
        if not self.every:
            return
        self.update(await engine.routing(), engine.restarts)
        self.check()
        self.save()

    async def run(self, engine: WorkerSupervisor) -> None:
        """Look every ``check_s`` seconds until cancelled (the service's lifespan owns the task)."""
        while True:
            await asyncio.sleep(self.settings.check_s)
            try:
                await self.look(engine)
            except Exception:  # a report must not end the watch: the next look tries again
                log.exception("routing watch: a look at the counts failed")

    def update(self, got: ServeRouting | None, restarts: int) -> None:
        """Take the worker's latest counts (a restarted worker counts from zero: the old one's join the base)."""
        if restarts != self._restarts and self.last is not None:
            self._fold(self.last)
        self._restarts = restarts
        if got is not None and got.n_expert:
            if got.error and (self.last is None or not self.last.error):
                log.warning("routing watch: the worker stopped counting: %s", got.error)
            self.last, self._arch, self._n_used = got, got.architecture, got.n_expert_used

    def _fold(self, got: ServeRouting) -> None:
        counts = np.asarray(got.counts, dtype=np.int64).reshape(got.n_layer, got.n_expert)
        if self._base is not None and self._base.shape != counts.shape:
            self._base = None
        self._base = counts if self._base is None else self._base + counts
        self._base_tokens += got.tokens
        self._base_steps += got.steps
        self.last = None

    def counts(self) -> NDArray[np.int64] | None:
        """Every pick counted for this plan, [n_layer, n_expert]; None before any."""
        cur = None
        if self.last is not None:
            cur = np.asarray(self.last.counts, dtype=np.int64).reshape(self.last.n_layer, self.last.n_expert)
        if self._base is None or (cur is not None and cur.shape != self._base.shape):
            return cur
        return self._base + cur if cur is not None else self._base

    def tokens(self) -> int:
        """Sampled tokens behind :meth:`counts`."""
        return self._base_tokens + (self.last.tokens if self.last else 0)

    def window_share(self) -> float | None:
        """The current worker's share over its last ``window_tokens`` sampled tokens (None: no picks yet)."""
        w = self.last
        return w.window_hot / w.window_picks if w is not None and w.window_picks else None

    def check(self) -> bool:
        """Log the warning once when the full window's share is ``warn_points`` below the plan's; True if it did."""
        w, plan = self.last, self.plan_share
        share = self.window_share()
        if self.warned or w is None or plan is None or share is None or w.window_tokens < self.settings.window_tokens:
            return False
        points = 100 * (plan - share)
        if points < self.settings.warn_points:
            return False
        self.warned = True
        log.warning("routing: the plan's GPU expert copies served %.0f%% of the picks of the last %d sampled tokens, "
                    "%.0f points below the %.0f%% of its planning trace: the traffic routes to other experts; re-plan "
                    "from what this server saw with `flux plan %s --routing-from %s`", 100 * share, w.window_tokens,
                    points, 100 * plan, self.model_path, self.plan.id[:12])
        return True

    def table(self) -> pa.Table | None:
        """The served trace (every pick counted for this plan); None before any."""
        counts = self.counts()
        if counts is None:
            return None
        steps = self._base_steps + (self.last.steps if self.last else 0)
        return served_table(counts, architecture=self._arch, n_expert_used=self._n_used, tokens=self.tokens(),
                            steps=steps, sample_every=self.every, model_hash=self.plan.model_hash,
                            plan_id=self.plan.id)

    def save(self) -> Path | None:
        """Write the trace when it holds picks not saved yet; the path written, else None."""
        if self.tokens() <= max(0, self._saved_tokens):
            return None
        table = self.table()
        if table is None:
            return None
        try:
            write_trace(table, self.path)
        except OSError as exc:
            log.warning("routing watch: cannot save the served trace to %s: %s", self.path, exc)
            return None
        self._saved_tokens = self.tokens()
        return self.path

    def report(self) -> dict[str, Any]:
        """``/flux/stats``'s ``routing``."""
        counts = self.counts()
        hot = self._hot_mask(counts)
        live = hot_share(counts, hot) if counts is not None and hot is not None else None
        return {"plan_share": self.plan_share if self.plan_share is not None else NOT_APPLICABLE,
                "live_share": live if self.plan_share is not None else NOT_APPLICABLE,
                "window_share": self.window_share() if self.plan_share is not None else NOT_APPLICABLE,
                "window_tokens": self.last.window_tokens if self.last else 0,
                "sampled_tokens": self.tokens(), "sample_every": self.every,
                "warn_points": self.settings.warn_points, "warned": self.warned,
                "trace": str(self.path) if self.path.is_file() else None,
                "error": self.last.error if self.last else None}

    def _hot_mask(self, counts: NDArray[np.int64] | None) -> NDArray[np.bool_] | None:
        split = self.plan.candidate.params.expert_split
        if counts is None or split is None:
            return None
        mask = np.zeros(counts.shape, dtype=bool)
        for h in split.layers:
            if h.layer < counts.shape[0]:
                mask[h.layer, [e for e in h.experts if e < counts.shape[1]]] = True
        return mask
