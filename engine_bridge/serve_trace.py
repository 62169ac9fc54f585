"""Served routing traces: the expert picks ``flux serve`` counted, in the routing trace's table form.

A served trace is :func:`engine_bridge.routing_trace.routing_table`'s table (columns ``layer``, ``expert``,
``count``; the model's hash, architecture, layer, expert and pick counts and the tokens counted in the schema
metadata) with three more metadata keys: ``source`` (``serve``), ``plan_id`` (the plan served) and ``steps`` (decode
steps counted), plus ``sample_every``. It is written as Parquet: ``flux serve`` saves it under the data directory
(:func:`served_trace_path`) and ``GET /flux/routing`` returns it; ``flux plan --routing-from`` reads it back.
Nothing here imports llama_cpp.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from numpy.typing import NDArray

from engine_bridge.ops import RoutingCounts
from engine_bridge.routing_trace import routing_table

SERVED_DIR = "served-routing"
PARQUET_MEDIA_TYPE = "application/vnd.apache.parquet"


def served_trace_path(data_dir: Path, plan_id: str) -> Path:
    """Where ``flux serve`` of ``plan_id`` keeps the picks it counted."""
    return data_dir / SERVED_DIR / f"{plan_id}.parquet"


def served_table(counts: NDArray[np.int64], *, architecture: str, n_expert_used: int, tokens: int, steps: int,
                 sample_every: int, model_hash: str, plan_id: str) -> pa.Table:
    """The table of a served trace (see the module docstring)."""
    n_layer, n_expert = counts.shape
    rc = RoutingCounts(architecture=architecture, n_layer=n_layer, n_expert=n_expert, n_expert_used=n_expert_used,
                       n_tokens=tokens, counts=tuple(tuple(int(x) for x in row) for row in counts))
    table = routing_table(rc, model_hash)
    meta = dict(table.schema.metadata or {})
    meta.update({b"source": b"serve", b"plan_id": plan_id.encode(), b"steps": str(steps).encode(),
                 b"sample_every": str(sample_every).encode()})
    return table.replace_schema_metadata(meta)


def trace_meta(table: pa.Table) -> dict[str, str]:
    """A trace's schema metadata as text."""
    return {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}


def trace_array(table: pa.Table) -> NDArray[np.int64]:
    """A well-formed trace's counts [n_layer, n_expert] (check it first: routing_trace.check_routing_table)."""
    meta = trace_meta(table)
    out = np.zeros((int(meta["n_layer"]), int(meta["n_expert"])), dtype=np.int64)
    out[table.column("layer").to_numpy(), table.column("expert").to_numpy()] = table.column("count").to_numpy()
    return out


def parquet_bytes(table: pa.Table) -> bytes:
    """The table as a Parquet file's bytes (what ``GET /flux/routing`` sends)."""
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def write_trace(table: pa.Table, path: Path) -> None:
    """Write the table to ``path`` as Parquet, atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def read_trace(path: Path) -> pa.Table:
    """A trace file (Parquet) as its table.

    Raises:
        OSError, pyarrow.ArrowInvalid: the file cannot be read as Parquet.
    """
    return pq.read_table(path)
