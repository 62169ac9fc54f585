"""Which tensors go to which GPU under a memory budget: a 0/1 knapsack solved with scipy's MILP.

Items are each layer's non-expert block and each layer's routed-expert tensors (gate, up, down
separately), one binary variable per (item, GPU). The value of an item on a GPU is the time per token
it saves there (decode reads + prefill copies, weighted by the workload's mix); the constraints are one
device per item and each GPU's byte budget. An expert tensor may only go to the GPU that holds its
layer's attention (activations stay on one device inside a layer). The output head is an item too, at
position n_layer after the last layer.

With several GPUs, each GPU may only take items from one run of consecutive positions, the runs in GPU
order and sized in proportion to the budgets: the pipeline llama.cpp's layer split builds, with one
hand-over per GPU boundary and each layer's KV cache on the GPU of its attention (``tasks/layer_split.py``).
The knapsack then decides, inside each run, what stays on the host. (Letting the MILP choose the
boundaries too found the same splits with two GPUs but did not converge in seconds with four.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from artifacts.model_info import ModelInfo
from artifacts.records.search import Placement
from tasks import layer_split
from tasks.costmodel import EXPERT_PARTS, head_bytes


@dataclass(frozen=True)
class Item:
    """A placeable unit of weights."""

    layer: int  # position: the layer's index, or n_layer for the output head
    part: str  # "block" (attention, norms, dense FFN, router, shared experts), an expert part, or "output"
    bytes: int
    read_per_token: float


def items(info: ModelInfo) -> list[Item]:
    """The placeable units of a model, in layer order."""
    frac = info.n_expert_used / info.n_expert if info.n_expert else 1.0
    out = []
    for layer in info.layers:
        roles = layer.bytes_by_role
        block = sum(v for k, v in roles.items() if not k.startswith("experts_"))
        out.append(Item(layer.index, "block", block, float(block)))
        for part in EXPERT_PARTS:
            b = roles.get(f"experts_{part}", 0)
            if b:
                out.append(Item(layer.index, part, b, b * frac))
    head = head_bytes(info)
    if head > 0:
        out.append(Item(info.n_layer, "output", head, float(head)))
    return out


# Value per byte of the head relative to a block's: both are read whole for every token, but a head on
# the host makes every token's logits a CPU matmul, so it goes to a GPU first.
HEAD_PRIORITY = 2.0
# Many near-equal items make proving optimality slow (10 s limits were hit with one GPU and a mixed
# workload); HiGHS finds its best solution in well under a second and spends the rest proving it: on the
# recorded qwen3-30b-a3b twin at 6-16 GiB and three workload mixes, 0.5 s gave the objective of a 3 s solve in
# 14 of 15 cases and 0.09% short of it in the last, and the same on 2 and 4 GPUs, where 3 s made enumerating
# a first plan's placements take 9 s on the 2-core CPU (10-18 s on the H200's host). The measure stage decides
# between candidates anyway.
MILP_TIME_LIMIT_S = 0.5


def select(info: ModelInfo, budgets: list[int], prefill_weight: float = 0.5,
           bias_late: float = 0.0) -> Placement:
    """Choose each item's device: maximise saved time subject to per-GPU byte budgets.

    Args:
        info: the model.
        budgets: bytes available for weights on each GPU (index = CUDA device number).
        prefill_weight: 0..1 share of the workload that is prefill; prefill values bytes resident
            (each host byte is copied per micro-batch), decode values bytes read per token.
        bias_late: tiny preference for later layers (>0) or earlier ones (<0), to break ties in
            different ways and give the measure stage distinct candidates.
    """
    its = items(info)
    n, g = len(its), len(budgets)
    if g == 0 or n == 0:
        return _to_placement(info, its, np.zeros((n, 0)))
    value = np.array([((1 - prefill_weight) * it.read_per_token + prefill_weight * it.bytes)
                      * (HEAD_PRIORITY if it.part == "output" else 1.0) for it in its])
    value = value / max(value.max(), 1.0) + bias_late * np.array([it.layer for it in its]) / (info.n_layer * 1e3)
    c = -np.repeat(value, g)  # milp minimises; x[i*g + j] = item i on GPU j
    size = np.array([it.bytes for it in its], dtype=float)
    cons = []
    one_device = np.zeros((n, n * g))
    for i in range(n):
        one_device[i, i * g : (i + 1) * g] = 1
    cons.append(LinearConstraint(one_device, 0, 1))
    cap = np.zeros((g, n * g))
    for j in range(g):
        cap[j, j::g] = size
    cons.append(LinearConstraint(cap, 0, np.array(budgets, dtype=float)))
    cons.extend(_same_gpu_as_block(its, g))
    upper = np.ones((n, g))
    if g > 1:  # each position may only use the GPU whose run covers it
        run = layer_split.runs(position_bytes(info), budgets)
        upper = np.array([[1.0 if j == run[it.layer] else 0.0 for j in range(g)] for it in its])
    res = milp(c, constraints=cons, integrality=np.ones(n * g), bounds=Bounds(0, upper.ravel()),
               options={"time_limit": MILP_TIME_LIMIT_S, "mip_rel_gap": 1e-3})
    x = np.zeros((n, g)) if res.x is None else np.round(res.x).reshape(n, g)
    return _to_placement(info, its, x)


def position_bytes(info: ModelInfo) -> list[int]:
    """Bytes of each position: every layer's weights, then the output head."""
    return [layer.total_bytes for layer in info.layers] + [head_bytes(info)]


def _same_gpu_as_block(its: list[Item], g: int) -> list[LinearConstraint]:
    """x[expert part, j] <= x[its layer's block, j] for every GPU j."""
    block_at = {it.layer: i for i, it in enumerate(its) if it.part == "block"}
    rows = []
    for i, it in enumerate(its):
        if it.part in ("block", "output"):
            continue
        for j in range(g):
            row = np.zeros(len(its) * g)
            row[i * g + j] = 1
            row[block_at[it.layer] * g + j] = -1
            rows.append(row)
    return [LinearConstraint(np.array(rows), -np.inf, 0)] if rows else []


def _to_placement(info: ModelInfo, its: list[Item], x: np.ndarray) -> Placement:
    layer_dev = ["CPU"] * info.n_layer
    experts: list[dict[str, str]] = [dict.fromkeys(EXPERT_PARTS, "CPU") for _ in range(info.n_layer)]
    output = "CPU"
    for i, it in enumerate(its):
        gpus: list[int] = [int(j) for j in np.flatnonzero(x[i] > 0.5)] if x.shape[1] else []
        dev = f"CUDA{gpus[0]}" if gpus else "CPU"
        if it.part == "block":
            layer_dev[it.layer] = dev
        elif it.part == "output":
            output = dev
        else:
            experts[it.layer][it.part] = dev
    return Placement(layer_device=layer_dev, expert_device=experts if info.is_moe else [], output_device=output)
