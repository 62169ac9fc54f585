"""The domains routing profile: its layout, its tokenizer, and the hot sets of each domain measured in llama.cpp."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from artifacts.corpus import DOMAINS, UnknownDomain, domain_texts, sized_prompts
from artifacts.engine_params import EngineParams
from artifacts.synth import PRESETS, apply_overrides, synthesize
from artifacts.synth.domains import Domains, design_jaccard, subsets, twin_tokens
from engine_bridge import ops
from engine_bridge.client import WorkerClient, tokenizer
from engine_bridge.ops import RoutingRequest

pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")

# 128 experts, 8 per token, as Qwen3-30B-A3B, in a 4 MB twin (2 layers, narrow experts): as test_routing_trace's
WIDE = {"n_layer": "2", "n_expert": "128", "n_expert_used": "8", "n_ff_exp": "32"}
HOT = 16  # a hot set: the busiest 16 of a layer's 128 experts (12.5%)


def test_the_subsets_share_the_stated_overlap_pairwise_and_cover_every_expert() -> None:
    subs = subsets(128, 4, 0.05)
    assert sorted(set(itertools.chain(*subs))) == list(range(128))
    shared = {len(set(a) & set(b)) for a, b in itertools.combinations(subs, 2)}
    assert shared == {4}  # 26 own experts + 3 blocks of 4 shared: 38 each, Jaccard 4 / 72
    assert design_jaccard(128, 4, 0.05) == pytest.approx(4 / 72)
    assert design_jaccard(128, 4, 0.0) == 0.0
    assert 0.15 <= design_jaccard(128, 4, 0.2) <= 0.25


def test_the_twin_tokenizer_is_llama_cpps(tmp_path: Path) -> None:
    model = synthesize("tiny-moe", tmp_path / "t.gguf").path
    texts = [domain_texts(d)[0] for d in DOMAINS]
    with tokenizer(model) as tok:
        assert all(twin_tokens(t, 512) == tok(t) for t in texts)


def test_an_unknown_domain_names_the_known_ones() -> None:
    with pytest.raises(UnknownDomain, match="known domains: code, prose, log, chat"):
        domain_texts("rust")


def test_the_profile_is_refused_where_it_cannot_be_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 32 experts for 4 domains"):
        synthesize("tiny-moe", tmp_path / "few.gguf", overrides={"routing": "domains"})
    with pytest.raises(ValueError, match="Q4_0, Q8_0 or F16"):
        synthesize("tiny-moe", tmp_path / "k.gguf", quant="Q4_K", overrides={**WIDE, "routing": "domains"})
    assert not list(tmp_path.iterdir())


def _domain_counts(model: Path) -> dict[str, np.ndarray]:
    """Each domain's picks [layer, expert] over 4 of its tune prompts of 384 tokens (the chat domain: 2 of 768)."""
    params = EngineParams(n_ctx=2048, n_batch=512, n_ubatch=512)
    out = {}
    with tokenizer(model) as tok:
        prompts = {d: sized_prompts(tok, [768] * 2 if d == "chat" else [384] * 4, seed=1, domains=[d]) for d in DOMAINS}
    with WorkerClient() as w:
        for d, ps in prompts.items():
            req = RoutingRequest(model=str(model), params=params, prompts=tuple(tuple(p) for p in ps), n_gen=8)
            out[d] = w.request(ops.ROUTING_COUNTS, req, timeout=600).array()
    return out


def _jaccards(counts: dict[str, np.ndarray], layer: int) -> list[float]:
    top = {d: set(np.argsort(-c[layer], kind="stable")[:HOT].tolist()) for d, c in counts.items()}
    return [len(top[a] & top[b]) / len(top[a] | top[b]) for a, b in itertools.combinations(top, 2)]


def test_each_domain_has_its_own_hot_set_in_llama_cpp(tmp_path: Path) -> None:
    # published (Qwen3.6-35B-A3B): prompt classes share 3-7% of their hot experts; the skewed profile's hot set is
    # the same whatever the prompt. The domain twin's subsets share 5.6% by design; what llama.cpp routes is
    # measured on the corpus's own prompts, whose byte-level tokens only partly tell the domains apart
    domains = synthesize("tiny-moe", tmp_path / "d.gguf", overrides={**WIDE, "routing": "domains"}).path
    skewed = synthesize("tiny-moe", tmp_path / "s.gguf", overrides={**WIDE, "routing": "skewed"}).path
    d_counts, s_counts = _domain_counts(domains), _domain_counts(skewed)
    spec = apply_overrides(PRESETS["tiny-moe"], {**WIDE, "routing": "domains"})
    for layer in range(2):
        d_j, s_j = _jaccards(d_counts, layer), _jaccards(s_counts, layer)
        assert float(np.median(s_j)) >= 0.6, s_j  # one hot set for every domain
        assert float(np.median(d_j)) <= 0.35 and min(d_j) <= 0.15, d_j  # hot sets of their own
        # most of a domain's picks land in its layer's subset (38 of 128 experts: 30% by chance)
        layout = Domains(spec, seed=0).layout(layer)
        inside = [float(d_counts[d][layer][layout[i]].sum() / d_counts[d][layer].sum()) for i, d in enumerate(DOMAINS)]
        assert min(inside) >= 0.5 and max(inside) >= 0.9, inside
        # within its subset a domain is skewed as the skewed profile is: its busiest half takes most of the picks
        for i, d in enumerate(DOMAINS):
            sub = np.sort(d_counts[d][layer][layout[i]])[::-1]
            assert sub[: len(sub) // 2].sum() / sub.sum() >= 0.75, (d, sub)
