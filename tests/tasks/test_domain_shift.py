"""A workload that shifts: --domains TRACE[:MEASURE], and the hot copies' share of the picks on the measured
traffic beside the trace's, from real routing traces of the domain twin on the CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from artifacts.corpus import DomainMix, UnknownDomain, parse_domains
from artifacts.synth import synthesize
from tasks import workload as wl
from tasks.probing import trace as route

pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")

WIDE = {"n_layer": "2", "n_expert": "128", "n_expert_used": "8", "n_ff_exp": "32"}  # as test_routing_trace's


def test_a_mix_is_trace_then_measure() -> None:
    assert parse_domains("code") == DomainMix(trace=("code",), measure=("code",))
    mix = parse_domains("code+log:chat")
    assert mix == DomainMix(trace=("code", "log"), measure=("chat",)) and mix.shifts
    assert not parse_domains("prose:prose").shifts


@pytest.mark.parametrize("text", ["rust", "code:rust", "code+rust"])
def test_an_unknown_domain_is_refused_naming_the_known_ones(text: str) -> None:
    with pytest.raises(UnknownDomain, match=r"unknown domain 'rust'; known domains: code, prose, log, chat$"):
        parse_domains(text)


@pytest.mark.parametrize("text", ["", "code:", "a:b:c"])
def test_a_malformed_mix_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="TRACE\\[:MEASURE\\]"):
        parse_domains(text)


def test_hot_share_counts_the_picks_of_the_hot_experts() -> None:
    counts = np.array([[6, 3, 1, 0], [0, 0, 5, 5]])
    hot = wl.hot_sets(counts, 0.25)
    assert hot == [[0], [2]]
    assert wl.hot_share(counts, hot) == pytest.approx((6 + 5) / 20)
    shifted = wl.shifted_share(counts, np.array([[1, 1, 1, 1], [0, 5, 5, 0]]), hot)
    assert shifted.trace == pytest.approx(0.55) and shifted.measured == pytest.approx((1 + 5) / 14)


def _traces(model: Path, mix: DomainMix, log: Path) -> tuple[np.ndarray, np.ndarray]:
    """The route stage's trace on the mix's trace domains and on its measured ones (the CPU, 4 prompts each)."""
    params = route.trace_params(n_ctx=1024, threads=2)
    out = []
    for domains in (mix.trace, mix.measure):
        prompts = wl.tune_prompts(model, [256, 256, 512, 512], seed=0, log_path=log, domains=domains)
        out.append(route.trace(model, prompts, params, log, timeout_s=600).array())
    return out[0], out[1]


def test_the_hot_copies_serve_less_of_a_shifted_workload_on_the_domain_twin(tmp_path: Path) -> None:
    # planned on prose, served chat: a quarter of each layer's experts chosen on the prose trace
    mix = parse_domains("prose:chat")
    shares = {}
    for routing in ("domains", "skewed"):
        model = synthesize("tiny-moe", tmp_path / f"{routing}.gguf", overrides={**WIDE, "routing": routing}).path
        traced, measured = _traces(model, mix, tmp_path / "worker.log")
        shares[routing] = wl.shifted_share(traced, measured, wl.hot_sets(traced, 0.25))
    d, s = shares["domains"], shares["skewed"]
    assert d.trace >= 0.8, d  # in domain, the hot quarter serves most picks (skewed within the domain's subset)
    assert d.measured <= d.trace - 0.3, d  # on another domain it serves far fewer
    assert abs(s.measured - s.trace) <= 0.05, s  # the skewed twin routes every domain alike


def test_the_plan_says_which_expert_cache_won_the_shifted_rounds() -> None:
    from artifacts.engine_params import EngineParams, ExpertSplit
    from artifacts.records.evidence import MeasureSummary
    from artifacts.records.search import Candidate, Placement

    split = EngineParams(n_ctx=512, expert_split=ExpertSplit.on("CUDA0", {0: [1, 2]}), expert_mapped=True)
    cands = [Candidate(id=f"c{i}", family="experts-mapped", placement=Placement(layer_device=["CUDA0"]),
                       params=split.model_copy(update={"expert_cache": cache}), weights_bytes={}, kv_bytes={},
                       compute_bytes={}) for i, cache in enumerate(("static", "adaptive"))]
    sums = [MeasureSummary(candidate_id="c0", prefill_tps=900.0, decode_tps=40.0, workload_s=2.5, n_trials=2),
            MeasureSummary(candidate_id="c1", prefill_tps=880.0, decode_tps=44.0, workload_s=2.3, n_trials=2)]
    (note,) = wl.cache_note(cands, sums, "c1", "prose:chat")
    assert note == ("the adaptive expert cache took 2.30 s (decode 44.0 tok/s) on the measured rounds (chat; its hot "
                    "experts were traced on prose), the static one of the same placement 2.50 s (40.0 tok/s): "
                    "measurement kept the adaptive")
    assert "the two did not race" in wl.cache_note(cands[1:], sums, "c1", "prose:chat")[0]
    assert wl.cache_note(cands, sums, "c1", "prose") == [] and wl.cache_note(cands, sums, "c1", None) == []
