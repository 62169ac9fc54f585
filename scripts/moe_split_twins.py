"""Write the twins and FLUX_MOE_SPLIT values of the per-expert split's H200 diagnosis (patches/llama.cpp/README.md),
for llama.cpp's own llama-bench and llama-perplexity on a GPU machine.

    python3 scripts/moe_split_twins.py OUT_DIR

OUT_DIR gets qwen3moe-small-skewed.gguf, qwen3-30b-a3b-{skewed,uniform}.gguf, text.txt (a perplexity corpus) and
split-<preset>-<h>.env: each layer's h busiest experts by the skewed profile (the same seed as the twins), on CUDA0.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from artifacts.synth import PRESETS, synthesize
from artifacts.synth.routing import layer_ranks, router_scales

WORDS = ("the harbour bridge library budget tram winter steel baker fountain jazz physics gulls oysters quantum poetry "
         "lighthouse committee engineers rain").split()


def split_value(preset: str, hot: int, device: str = "CUDA0") -> tuple[str, float]:
    """FLUX_MOE_SPLIT putting each layer's `hot` busiest experts (skewed profile, the twins' seed) on `device`,
    and the share of the picks they take."""
    spec = PRESETS[preset]
    _, expected = router_scales(spec.n_expert, spec.n_expert_used, spec.routing_top_half)
    items = [(f"{device}|" if il == 0 else "") + f"{il}:" + ",".join(map(str, np.flatnonzero(
        layer_ranks(spec.n_expert, il, seed=0) < hot))) for il in range(spec.n_layer)]
    return ";".join(items), float(np.sort(expected)[::-1][:hot].sum())


def main(out: Path) -> None:
    """Write the files (existing twins are kept)."""
    out.mkdir(parents=True, exist_ok=True)
    for preset, routing in (("qwen3moe-small", "skewed"), ("qwen3-30b-a3b", "skewed"), ("qwen3-30b-a3b", "uniform")):
        path = out / f"{preset}-{routing}.gguf"
        if not path.exists():
            t0 = time.perf_counter()
            r = synthesize(preset, path, overrides={"routing": routing} if routing != "uniform" else None)
            sys.stdout.write(f"{path.name}: {r.file_bytes / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s\n")
    for preset in ("qwen3moe-small", "qwen3-30b-a3b"):
        for h in (8, 16, 32, 64):
            if h >= PRESETS[preset].n_expert:
                continue
            value, share = split_value(preset, h)
            (out / f"split-{preset}-{h}.env").write_text(value)
            sys.stdout.write(f"{preset}: {h} of {PRESETS[preset].n_expert} experts hot per layer, {share:.3f} of the picks\n")
    (out / "text.txt").write_text(" ".join(np.random.default_rng(0).choice(WORDS, size=6000)))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
