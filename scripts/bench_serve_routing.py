"""What counting the expert picks costs the serving engine's decode (docs/serving.md, Routing watch).

Side by side in rounds (off / callback installed but never asking / one step in 8 / every step), each a fresh
serving worker of the same model decoding the same greedy reply: the median decode time per token and its ratio to
counting off. The default model is tiny-moe made 48 layers deep: a graph with as many nodes as a 48-layer MoE's and
almost no compute, so the callback's per-node cost shows at its largest relative to the step.

    python3 scripts/bench_serve_routing.py [--model m.gguf] [--tokens 128] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from artifacts.engine_params import EngineParams  # noqa: E402
from engine_bridge import ops  # noqa: E402
from engine_bridge.client import WorkerClient  # noqa: E402
from engine_bridge.sampling import GREEDY  # noqa: E402

SETTINGS = {"off": 0, "installed": 1 << 30, "1 in 8": 8, "every step": 1}


def decode_ms_per_token(model: Path, every: int, tokens: int, threads: int) -> tuple[float, int]:
    """One fresh serving worker's decode ms per token over a greedy reply, and the steps it counted."""
    params = EngineParams(n_ctx=tokens + 64, n_batch=64, n_ubatch=64, n_threads=threads, n_threads_batch=threads)
    prompt = np.random.default_rng(0).integers(0, 500, size=32).tolist()
    with WorkerClient() as w:
        w.request(ops.SERVE_LOAD, ops.ServeLoadArgs(model=str(model), params=params, routing_every=every))
        result = ops.GenerateResult(finish_reason="cancelled", prompt_tokens=len(prompt))
        for msg in w.generate(ops.GenerateArgs(rid="r", prompt=prompt, max_tokens=tokens, sampling=GREEDY)):
            if msg["type"] == "result":
                result = msg["result"]
        steps = w.request(ops.SERVE_ROUTING).steps
    return result.decode_ms / max(1, result.completion_tokens - 1), steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None:
            from artifacts.synth import synthesize

            model = Path(tmp) / "tiny-moe-48.gguf"
            synthesize("tiny-moe", model, quant="Q4_0", overrides={"n_layer": "48"})
        times: dict[str, list[float]] = {k: [] for k in SETTINGS}
        counted: dict[str, int] = {}
        for _ in range(a.rounds):
            for name, every in SETTINGS.items():
                ms, counted[name] = decode_ms_per_token(model, every, a.tokens, a.threads)
                times[name].append(ms)
    base = statistics.median(times["off"])
    print(f"{model.name}: {a.tokens} tokens, {a.rounds} rounds, {a.threads} thread(s)")
    for name in SETTINGS:
        med = statistics.median(times[name])
        print(f"  {name:>10}: {med:7.3f} ms/token ({med - base:+.3f} ms, {med / base:.3f}x off), "
              f"{counted[name]} steps counted, rounds {', '.join(f'{t:.3f}' for t in times[name])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
