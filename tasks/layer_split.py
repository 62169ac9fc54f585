"""The GPU llama.cpp gives each layer, and the tensor split that makes it the placement's.

With ``-ngl 999`` llama.cpp assigns every layer, and the output head as position ``n_layer``, to a GPU by
cumulative tensor-split fractions: position ``il`` goes to the first GPU whose cumulative share exceeds
``il / (n_layer + 1)`` (llama-model.cpp, ``load_tensors``; without a split, shares follow free memory).
That GPU holds the layer's KV cache and, unless a tensor override says otherwise, its weights. Flux pins
weights with overrides and sets the split so that llama.cpp's own assignment agrees with the placement:
each layer's KV cache then sits on the GPU that computes its attention, and an all-on-one-GPU placement
stays on that GPU when the machine has several.
"""

from __future__ import annotations

from collections.abc import Sequence

from artifacts.records.search import Placement

# Each boundary sits half a position below the first position of the next GPU's run, so float rounding
# of the fractions never moves a layer across it.
_MARGIN = 0.5


def runs(sizes: Sequence[int], budgets: Sequence[int]) -> list[int]:
    """GPU index of each position: consecutive runs in GPU order, in proportion to the budgets.

    A position goes to the next GPU once its midpoint would pass the current GPU's share of the total
    bytes, as llama.cpp's own split by free memory does with whole layers.
    """
    total, share = sum(sizes), sum(budgets)
    out, acc, j = [], 0.0, 0
    for size in sizes:
        while j < len(budgets) - 1 and (acc + size / 2) * share > total * sum(budgets[: j + 1]):
            j += 1
        out.append(j)
        acc += size
    return out


def boundaries(placement: Placement, gpus: Sequence[str]) -> list[int]:
    """b[0] = 0 <= b[1] <= ... <= b[g] = n_layer + 1: GPU j gets positions b[j] .. b[j+1]-1.

    A GPU's run ends after the last position the placement gives it; positions on the CPU fall into
    whichever run covers them (their KV cache goes there). A placement made by ``expert_select`` keeps
    each GPU's positions contiguous and in GPU order, so every GPU-resident position lands on its GPU.
    """
    seq = [*placement.layer_device, placement.output_device]
    last: dict[int, int] = {}
    for pos, dev in enumerate(seq):
        if dev in gpus:
            last[gpus.index(dev)] = pos
    out = [0]
    for j in range(len(gpus) - 1):
        out.append(max(out[-1], last[j] + 1) if j in last else out[-1])
    out.append(len(seq))
    return out


def tensor_split(placement: Placement, gpus: Sequence[str]) -> tuple[float, ...] | None:
    """llama.cpp ``tensor_split`` shares (``-ts``) that reproduce the placement's GPU of every position.

    None with fewer than two GPUs: with one, llama.cpp has nothing to split.
    """
    if len(gpus) < 2:
        return None
    b = boundaries(placement, gpus)
    n_pos = b[-1]
    cum = [1.0 if b[j + 1] >= n_pos else max(0.0, (b[j + 1] - _MARGIN) / n_pos) for j in range(len(gpus) - 1)]
    cum.append(1.0)
    shares = [cum[0]] + [cum[j] - cum[j - 1] for j in range(1, len(cum))]
    return tuple(round(max(0.0, s), 6) for s in shares)


def llama_gpu(split: Sequence[float], n_layer: int, pos: int) -> int:
    """Index of the GPU llama.cpp gives position ``pos`` under ``split`` with every layer offloaded."""
    total = sum(split)
    acc, x = 0.0, pos / (n_layer + 1)
    for j, s in enumerate(split):
        acc += s
        if acc / total > x:
            return j
    return len(split) - 1


def llama_devices(placement: Placement, gpus: Sequence[str]) -> list[str]:
    """The GPU llama.cpp gives each position (every layer, then the head) under the placement's split."""
    n = len(placement.layer_device)
    split = tensor_split(placement, gpus)
    if split is None:
        return [gpus[0]] * (n + 1)
    return [gpus[llama_gpu(split, n, pos)] for pos in range(n + 1)]


def kv_devices(placement: Placement, gpus: Sequence[str]) -> list[str]:
    """The device of each layer's KV cache when every layer is offloaded (``-ngl 999``) to ``gpus``;
    the CPU for every layer when ``gpus`` is empty (no GPU, or the KV cache kept on the host)."""
    n = len(placement.layer_device)
    if not gpus:
        return ["CPU"] * n
    return llama_devices(placement, gpus)[:n]
