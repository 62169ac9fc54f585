"""A diagnosis, not the product path: how GPU expert caches would do on a twin's real routing.

Traces every token's expert picks through llama.cpp (the worker's routing trace, in this process), on a "plan"
workload and a different "serve" workload of random tokens, then replays the serve picks of each layer through
cache policies with H expert slots per layer, every token taken as a decode step:

* ``static``: the plan trace's busiest H experts, fixed (a plan's hot set; FLUX_MOE_CACHE_FREEZE=1);
* ``0007``: patch 0007's adaptive cache with its defaults (picks read every 8th step into scores decayed 0.8 a
  read, up to 2 swaps a layer every 8th read, a cold expert must score > 1.25x + 1 the hot one it replaces);
* ``0007 fast``: the same read every step and swapping every step;
* ``LRU``: every cold pick brought in, evicting the least recently used (a per-token cache);
* ``static+LRU``: H - 16 static slots and 16 LRU slots.

For each: the share of picks served from the GPU and the experts that cross the bus per token and layer (a
mapped cold pick reads its expert's bytes over the bus once; a swap or an LRU fill copies it once). The bus
bytes are what a mapped split adds to the whole-model step (patches/llama.cpp/README.md), so fewer is faster
whatever the GPU.

    python3 scripts/cache_sim.py TWIN.gguf [--hot 32,64,96] [--prompts 4] [--tokens 512]
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from artifacts.engine_params import EngineParams
from engine_bridge.ops import RoutingRequest
from engine_bridge.worker.routing import TopkRecorder, trace

Picks = list[NDArray[np.int32]]  # per layer: [tokens, n_used] in token order (sequences concatenated)


def picks_of(model: Path, seed: int, n_prompts: int, n_tokens: int, n_vocab: int) -> tuple[Picks, NDArray[np.int64]]:
    rng = np.random.default_rng(seed)
    prompts = tuple(tuple(rng.integers(0, n_vocab, size=n_tokens).tolist()) for _ in range(n_prompts))
    params = EngineParams(n_ctx=n_tokens + 64, n_batch=256, n_ubatch=256)
    rec = TopkRecorder(keep_picks=True)
    counts = trace(RoutingRequest(model=str(model), params=params, prompts=prompts, n_gen=32), rec)
    if rec.picks is None:
        raise SystemExit("the recorder kept no picks")
    layers = sorted(rec.picks[0])
    return [np.concatenate([np.concatenate(seq[layer]) for seq in rec.picks]) for layer in layers], counts.array()


def static(picks: NDArray[np.int32], hot: set[int]) -> tuple[int, int]:
    hits = int(np.isin(picks, list(hot)).sum())
    return hits, picks.size - hits


def adaptive(picks: NDArray[np.int32], hot: set[int], n_expert: int, sample: int, every: int,
             swaps: int = 2, decay: float = 0.8) -> tuple[int, int]:
    hot, score = set(hot), np.zeros(n_expert)
    hits = bus = reads = 0
    for step, row in enumerate(picks):
        h = sum(int(e) in hot for e in row)
        hits, bus = hits + h, bus + len(row) - h
        if (step + 1) % sample:
            continue
        score *= decay
        np.add.at(score, row, 1.0)
        reads += 1
        if reads % every:
            continue
        for _ in range(swaps):
            hl, cl = list(hot), [e for e in range(n_expert) if e not in hot]
            worst = min(hl, key=lambda e: score[e])
            best = max(cl, key=lambda e: score[e])
            if score[best] <= 1.25 * score[worst] + 1.0:
                break
            hot.remove(worst)
            hot.add(best)
            bus += 1
    return hits, bus


def lru(picks: NDArray[np.int32], fixed: set[int], start: list[int], slots: int) -> tuple[int, int]:
    cache: OrderedDict[int, None] = OrderedDict((e, None) for e in start[:slots])
    hits = bus = 0
    for row in picks:
        for e in map(int, row):
            if e in fixed:
                hits += 1
            elif e in cache:
                hits += 1
                cache.move_to_end(e)
            else:
                bus += 1
                cache[e] = None
                if len(cache) > slots:
                    cache.popitem(last=False)
    return hits, bus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--hot", default="32,64,96")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=500, help="token ids drawn below this")
    args = ap.parse_args()
    plan, plan_counts = picks_of(args.model, 1, args.prompts, args.tokens, args.vocab)
    serve, _ = picks_of(args.model, 2, args.prompts, args.tokens, args.vocab)
    n_expert = plan_counts.shape[1]
    n_used = serve[0].shape[1]
    tokens = serve[0].shape[0]
    print(f"{args.model.name}: {len(serve)} layers, {n_expert} experts x {n_used}, {tokens} serve tokens a layer")
    print("| H hot | policy | picks on GPU | experts over the bus per token and layer |")
    print("|---:|---|---:|---:|")
    for h in map(int, args.hot.split(",")):
        rows: dict[str, list[tuple[int, int]]] = {}
        for layer, p in enumerate(serve):
            order = [int(e) for e in np.argsort(-plan_counts[layer], kind="stable")]
            top = set(order[:h])
            for name, res in (
                ("static", static(p, top)),
                ("0007", adaptive(p, top, n_expert, 8, 8)),
                ("0007 fast", adaptive(p, top, n_expert, 1, 1)),
                ("LRU", lru(p, set(), order, h)),
                ("static+LRU 16", lru(p, set(order[:h - 16]), order[h - 16:], 16)),
            ):
                rows.setdefault(name, []).append(res)
        for name, per_layer in rows.items():
            hits = sum(r[0] for r in per_layer)
            bus = sum(r[1] for r in per_layer)
            total = tokens * n_used * len(per_layer)
            print(f"| {h} | {name} | {hits / total:.1%} | {bus / (tokens * len(per_layer)):.2f} |")


if __name__ == "__main__":
    main()
