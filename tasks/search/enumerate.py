"""The enumerate stage: the memory-feasible search space, with per-expert placements when a routing trace is
given."""

from __future__ import annotations

from typing import Any

from artifacts.ids import content_id
from artifacts.records.hardware import HardwareReport
from artifacts.records.kinds import SPACE
from artifacts.records.routing import RoutingProfile
from artifacts.records.search import PlacementSpace
from tasks.search.space import enumerate_placements
from tasks.stage import PlanContext, Stage

# The request's fields that shape the space (the rest shape measuring, validating or nothing).
SPACE_FLAGS = {"ctx", "concurrency", "kv", "gpu_mem_budget_gib", "allow_storage_streaming", "seed",
               "host_mem_budget_gib", "rpc", "rpc_mem_budget_gib"}


def _key(ctx: PlanContext, hw: HardwareReport, routing: RoutingProfile | None = None) -> dict[str, Any]:
    flags = {k: v for k, v in ctx.req.model_dump(include=SPACE_FLAGS).items()
             if v is not None or k not in ("host_mem_budget_gib", "rpc", "rpc_mem_budget_gib")}
    key = {"stage": "enumerate", "probe": content_id(hw), "model": ctx.model_hash, "flags": flags,
           "reserve": ctx.settings.host_reserve_percent, "code": STAGE.code()}
    return {**key, "routing": routing.trace_id} if routing is not None else key


def _run(ctx: PlanContext, log: Any, hw: HardwareReport, routing: RoutingProfile | None = None) -> PlacementSpace:
    shares = routing.shares() if routing is not None else None
    return enumerate_placements(ctx.info, hw, ctx.req, ctx.settings.host_reserve_percent, shares)


STAGE: Stage[PlacementSpace] = Stage(
    name="enumerate", version=1, result=PlacementSpace, run=_run, kind=SPACE, key=_key,
    inputs=("probe report", "model hash", "request's space flags", "host reserve", "routing trace", "code"))
