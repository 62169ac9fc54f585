"""``flux plan --routing-from``: plans re-fitted to the routing a server saw, and the way back from the old plan.

``--routing-from`` names a served plan (the trace ``flux serve`` saved for it, :mod:`server.routing_watch`) or a
trace file (``GET /flux/routing``). :func:`resolve_routing_from` reads it, refuses a trace of another model, layer
or expert count in one line (exit 2), stores it as a routing table and puts its store id in the request: the
route stage then takes its counts instead of tracing the bundled workload (:mod:`tasks.probing.route`), and the
plan is keyed by that id. :func:`refits_of` finds the plans re-fitted from a plan's served trace (``flux show``).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from artifacts.config import Settings
from artifacts.errors import NotFound
from artifacts.filehash import model_hash
from artifacts.ids import content_id
from artifacts.model_info import ModelInfo
from artifacts.records.kinds import PLAN, ROUTING_TABLE
from artifacts.records.plan import Plan, PlanRequest
from artifacts.records.store import Records
from artifacts.store import Store
from engine_bridge.errors import RoutingMismatch
from engine_bridge.routing_trace import check_routing_table
from engine_bridge.serve_trace import read_trace, served_trace_path, trace_meta
from flows.request import BadPlanFlag


def _table(settings: Settings, given: str) -> pa.Table:
    """The trace ``given`` names: a stored trace id, a trace file, or a plan whose server saved one."""
    store = Store(settings.data_dir)
    if store.has(ROUTING_TABLE, given):
        return store.get_table(ROUTING_TABLE, given)
    path = Path(given).expanduser()
    if not path.is_file():
        try:
            plan = Records.at(settings.data_dir).find_by_prefix(PLAN, given)
        except NotFound:
            raise BadPlanFlag(f"--routing-from {given}: neither a trace file nor a saved plan's id") from None
        path = served_trace_path(settings.data_dir, plan.id)
        if not path.is_file():
            raise BadPlanFlag(f"--routing-from {given}: `flux serve {plan.id[:12]}` has counted no expert picks "
                              f"yet (no {path}): serve it, or pass a trace file from GET /flux/routing")
    try:
        return read_trace(path)
    except (OSError, pa.ArrowException) as exc:
        raise BadPlanFlag(f"--routing-from {given}: {path} is not a routing trace (Parquet): {exc}") from None


def resolve_routing_from(req: PlanRequest, settings: Settings, info: ModelInfo) -> PlanRequest:
    """``req`` with ``routing_from`` replaced by the store id of the trace it names (unchanged without one).

    Raises:
        BadPlanFlag: no such trace, or a trace of another model, layer count or expert count.
    """
    if req.routing_from is None:
        return req
    given = req.routing_from
    table = _table(settings, given)
    mh = model_hash([Path(s) for s in info.shards], settings.cache_dir)
    try:
        counts = check_routing_table(table, mh, info.n_layer, info.n_expert)
    except RoutingMismatch as exc:
        raise BadPlanFlag(f"--routing-from {given}: the trace is of another model: its {exc.what} is {exc.got}, "
                          f"this model's is {exc.expected}; pass a trace `flux serve` counted for this model") from None
    meta = trace_meta(table)
    tid = content_id({"served_routing": counts.tolist(), "meta": meta})
    Store(settings.data_dir).put_table(ROUTING_TABLE, table, key=tid, meta={
        "source": meta.get("source", "file"), "plan_id": meta.get("plan_id"), "n_tokens": meta.get("n_tokens")})
    return req.model_copy(update={"routing_from": tid})


def refits_of(settings: Settings, plan: Plan) -> list[tuple[Plan, str]]:
    """The saved plans made from ``plan``'s served trace, each with the tokens that trace held, oldest first."""
    plans, _ = Records.at(settings.data_dir).readable(PLAN)
    store = Store(settings.data_dir)
    out = []
    for p in plans:
        tid = p.request.routing_from
        if tid is None or p.id == plan.id or not store.has(ROUTING_TABLE, tid):
            continue
        meta = trace_meta(store.get_table(ROUTING_TABLE, tid))
        if meta.get("plan_id") == plan.id:
            out.append((p, meta.get("n_tokens", "?")))
    return sorted(out, key=lambda t: t[0].created_at)
