"""The prefill micro-batch as a searched dimension: which micro-batches beyond the default grid a GPU plan tries.

A coding agent's turn is a 10k-60k-token prompt, and its wait is prefill. A placement that leaves expert weights on
the host copies every host-resident expert tensor to the GPU once per micro-batch at or above llama.cpp's offload
threshold: on the H100 (issue 50, skewed qwen3-30b-a3b Q4_0 twin at 9 GiB) ~16 GB at ~50 GB/s pinned, 0.3 s a
micro-batch, so ~800 tok/s is the copy bound at ``-ub 256`` (a mapped split measured 904 on a 4,555-token prompt,
the whole model on the GPU 7.3-8.3k) and ~12k at ``-ub 4096``; 2,048 -> 4,096 measured 1.5x. A micro-batch's compute
buffer grows with it (the logits of every token, :func:`tasks.gpu_memory.compute_bytes`: 2.8 GiB at 4,096 and 5.7
at 8,192 for that twin), so it is paid for in GPU memory the experts' copies would otherwise use: each of these
micro-batches gets placements sized with its own compute buffer (:mod:`tasks.search.space`), and the cost model
(:mod:`tasks.costmodel`) and measurement weigh the faster prefill against the slower decode.
"""

from __future__ import annotations

import re

from artifacts.records.plan import PlanRequest
from tasks.workload import nominal_lengths

# Doubling up from the default grid's largest (tasks.search.space: 256, 512, 2048). 1,024 is left out: a hybrid's
# prefill only grows with the micro-batch (the copy bound), so 1,024 could win only where 2,048's compute buffer
# costs more decode than 2,048 saves prefill, which the placements sized for 2,048 already measure.
PREFILL_UBATCHES = (2048, 4096, 8192)


def prefill_ubatches(n_ctx: int, req: PlanRequest) -> tuple[int, ...]:
    """The micro-batches placements are sized for at ``n_ctx`` under ``req``'s workload: those the context holds
    and that some workload prompt is longer than half of (it needs fewer micro-batches, so fewer copies, than at
    half the size). The agent workload's 16-32k prompts reach all of them; chat's (at most 256 tokens) none: a
    prompt shorter than the micro-batch is one micro-batch of its own, and a larger one only costs memory."""
    longest = max(nominal_lengths(n_ctx, req)[0])
    return tuple(u for u in PREFILL_UBATCHES if u <= n_ctx and longest > u // 2)


_SIZED = re.compile(r"/ub(\d+)")


def sized_family(family: str, n_ubatch: int) -> str:
    """The family of ``family``'s placement sized for ``n_ubatch`` ('experts-mapped' -> 'experts-mapped/ub4096');
    a context tag comes after it ('experts-mapped/ub4096@32768')."""
    return f"{family}/ub{n_ubatch}"


def sizing(family: str) -> tuple[str, int | None]:
    """(the family without its sizing, the prefill micro-batch it was sized for; None: the default grid's)."""
    m = _SIZED.search(family)
    return (family, None) if m is None else (family[:m.start()] + family[m.end():], int(m.group(1)))
