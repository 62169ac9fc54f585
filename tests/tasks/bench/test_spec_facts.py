"""The GPU record's drafting pairs: `MODEL:BUDGET[...]+spec` and `+draftK` (scripts/bench_gpu.py)."""

from __future__ import annotations

import pytest

from tasks.bench.spec_facts import split_drafting


@pytest.mark.parametrize(("text", "want"), [
    ("llama3-8b:0~chat", ("llama3-8b:0~chat", None, False)),
    ("qwen3-30b-a3b/skewed:12+spec", ("qwen3-30b-a3b/skewed:12", None, True)),
    ("llama3-8b:0@8192~chat+draft2", ("llama3-8b:0@8192~chat", 2, True)),
])
def test_a_pair_names_its_drafting(text: str, want: tuple[str, int | None, bool]) -> None:
    assert split_drafting(text) == want


@pytest.mark.parametrize("text", ["llama3-8b:0+draft", "llama3-8b:0+draft0", "llama3-8b:0+ngram"])
def test_a_drafting_suffix_it_does_not_know_is_one_line(text: str) -> None:
    with pytest.raises(ValueError, match=r"after '\+' give spec|at least one layer") as err:
        split_drafting(text)
    assert "\n" not in str(err.value)
