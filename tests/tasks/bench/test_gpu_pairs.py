"""The GPU record's pairs (flux bench record PAIRS): MODEL[/ROUTING]:BUDGET[@CTX][~WORKLOAD][+spec|+draftK|+heads][%S]."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.bench.gpu_pairs import parse_pair, refused_budget, split_drafting

RUN17 = Path(__file__).resolve().parents[3] / "docs" / "benchmarks" / "h200" / "run17" / "e2e.log"


@pytest.mark.parametrize(("text", "want"), [
    ("llama3-8b:0~chat", ("llama3-8b:0~chat", None, False, False)),
    ("qwen3-30b-a3b/skewed:12+spec", ("qwen3-30b-a3b/skewed:12", None, True, False)),
    ("llama3-8b:0@8192~chat+draft2", ("llama3-8b:0@8192~chat", 2, True, False)),
    ("qwen3.6-35b-a3b/skewed:12~chat+heads", ("qwen3.6-35b-a3b/skewed:12~chat", None, True, True)),
])
def test_a_pair_names_its_drafting(text: str, want: tuple[str, int | None, bool, bool]) -> None:
    assert split_drafting(text) == want


@pytest.mark.parametrize("text", ["llama3-8b:0+draft", "llama3-8b:0+draft0", "llama3-8b:0+ngram", "x:1~code",
                                  "x/hot:1", "x:big", "x:1%soon"])
def test_a_pair_it_cannot_read_is_one_line(text: str) -> None:
    with pytest.raises(ValueError, match=r"^pair ") as err:
        parse_pair(text)
    assert "\n" not in str(err.value)


def test_a_pair_becomes_its_flux_plan_command() -> None:
    pair = parse_pair("qwen3-30b-a3b/skewed:12@32768~agent+spec%300")
    assert (pair.preset, pair.routing, pair.budget_gib, pair.ctx, pair.workload) == (
        "qwen3-30b-a3b", "skewed", 12.0, 32768, "agent")
    assert pair.tag == "qwen3-30b-a3b-skewed-12@32768-agent+spec"
    model = Path("/m/q.gguf")
    assert pair.plan_args(model, None, 150) == [
        "plan", "/m/q.gguf", "--gpu-mem-budget", "12", "--ctx", "32768", "--workload", "agent", "--budget-s", "300",
        "--speculation"], "the pair's own budget wins over the run's"
    whole = parse_pair("llama3-8b:0~chat+draft2")
    assert whole.tag == "llama3-8b-uniform-0-chat+draft2"
    assert whole.plan_args(model, Path("/m/d.gguf"), 150) == [
        "plan", "/m/q.gguf", "--workload", "chat", "--budget-s", "150", "--speculation", "--draft-model", "/m/d.gguf"]
    grafted = parse_pair("qwen3.6-35b-a3b/skewed:12~chat+heads%330")
    assert grafted.tag == "qwen3.6-35b-a3b-skewed-12-chat+heads"
    assert grafted.plan_args(model, None, 150, Path("/m/h.gguf")) == [
        "plan", "/m/q.gguf", "--gpu-mem-budget", "12", "--workload", "chat", "--budget-s", "330", "--speculation",
        "--heads", "/m/h.gguf", "--engines", "native,llama-server"]


def test_a_refusal_names_the_budget_to_plan_again_at() -> None:
    """Run 17's 80B plans at B = 150 were refused with the budget that can work, which bench_gpu.py now plans at."""
    text = RUN17.read_text()
    assert [refused_budget(line) for line in text.splitlines() if "use --budget-s" in line] == [303, 338]
    assert refused_budget("error: something else") is None


def test_a_pair_names_the_depths_its_plan_is_raced_at() -> None:
    """`scripts/gpu-e2e.sh OUT 'qwen3.6-35b-a3b/skewed:12#4096/64k/262144'`: that pair's plan is raced at those
    depths (flux bench run --via serve --depths); the pair's tag and its flux plan command are unchanged."""
    pair = parse_pair("qwen3.6-35b-a3b/skewed:12~chat%300#4096/64k/262144")
    assert pair.depths == (4096, 65536, 262144) and pair.plan_budget_s == 300 and pair.workload == "chat"
    assert pair.tag == parse_pair("qwen3.6-35b-a3b/skewed:12~chat%300").tag == "qwen3.6-35b-a3b-skewed-12-chat"
    assert parse_pair("llama3-8b:8@131072").depths == ()
    for bad in ("llama3-8b:8#", "llama3-8b:8#4096/deep", "llama3-8b:8#0"):
        with pytest.raises(ValueError, match=r"^pair .*after '#'") as err:
            parse_pair(bad)
        assert "\n" not in str(err.value)
