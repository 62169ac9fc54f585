"""Routing traces: per-layer expert selection counts of a model on a workload, as the planner stores them.

The worker op ``routing_counts`` (:data:`engine_bridge.ops.ROUTING_COUNTS`) loads a model with a
plan's :class:`~artifacts.engine_params.EngineParams`, prefills and greedily decodes the workload's prompts, and
counts which experts llama.cpp's router selected in every layer (see :mod:`engine_bridge.worker.routing`).
:func:`routing_table` turns the counts into the store's table (columns ``layer``, ``expert``, ``count``, with the
model's identity in the schema metadata) and :func:`check_routing_table` refuses a table recorded for another
model. Nothing here imports llama_cpp.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from engine_bridge.errors import RoutingMismatch
from engine_bridge.ops import RoutingCounts

ROUTING_SCHEMA = pa.schema([("layer", pa.int32()), ("expert", pa.int32()), ("count", pa.int64())])
# Schema metadata keys of a routing table (bytes, as Parquet keeps them).
_META_KEYS = ("model_hash", "architecture", "n_layer", "n_expert", "n_expert_used", "n_tokens")


def routing_table(counts: RoutingCounts, model_hash: str) -> pa.Table:
    """The store's form of a trace: one row per (layer, expert), the model's identity in the schema metadata."""
    arr = counts.array()
    layer, expert = np.divmod(np.arange(arr.size, dtype=np.int32), np.int32(counts.n_expert))
    meta = {"model_hash": model_hash, "architecture": counts.architecture, "n_layer": counts.n_layer,
            "n_expert": counts.n_expert, "n_expert_used": counts.n_expert_used, "n_tokens": counts.n_tokens}
    schema = ROUTING_SCHEMA.with_metadata({k: str(v) for k, v in meta.items()})
    return pa.table([pa.array(layer), pa.array(expert), pa.array(arr.ravel())], schema=schema)


def check_routing_table(table: pa.Table, model_hash: str, n_layer: int, n_expert: int) -> NDArray[np.int64]:
    """The counts [n_layer, n_expert] of a stored trace, after checking it belongs to this model.

    Raises:
        RoutingMismatch: the trace names another model hash, layer count or expert count, or its rows do not
            cover every (layer, expert) once.
    """
    meta = _metadata(table)
    for key, what, expected in (("model_hash", "model hash", model_hash), ("n_layer", "layer count", str(n_layer)),
                                ("n_expert", "expert count", str(n_expert))):
        if meta.get(key) != expected:
            raise RoutingMismatch(what, expected, meta.get(key))
    layer = table.column("layer").to_numpy()
    expert = table.column("expert").to_numpy()
    if table.num_rows != n_layer * n_expert or layer.min(initial=0) < 0 or expert.min(initial=0) < 0 \
            or layer.max(initial=0) >= n_layer or expert.max(initial=0) >= n_expert:
        raise RoutingMismatch("(layer, expert) rows", n_layer * n_expert, table.num_rows)
    out = np.full((n_layer, n_expert), -1, dtype=np.int64)
    out[layer, expert] = table.column("count").to_numpy()
    if (out < 0).any():
        raise RoutingMismatch("(layer, expert) rows", "each once", "some missing or repeated")
    return out


def _metadata(table: pa.Table) -> Mapping[str, str]:
    raw = table.schema.metadata or {}
    return {k.decode(): v.decode() for k, v in raw.items() if k.decode() in _META_KEYS}
