"""`flux bench quality` on a tiny twin: plan vs reference placement, read back from the store."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from bench_support import bench_settings, make_plan, session_cache

from artifacts.engine_params import EngineParams
from tasks.bench.context import open_bench
from tasks.bench.quality import QualityOptions, bench_quality
from tasks.bench.record import save_run

OPTS = QualityOptions(n_tokens=6, held_out=(48,), conversations=2, ppl_windows=2, ppl_tokens=48)


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> dict[str, Any]:
    """A flash-attention plan (a real, small numeric difference from the reference) compared and saved."""
    st, _ = bench_settings(tmp_path_factory.mktemp("bench-quality"), session_cache(tmp_path_factory))
    params = EngineParams(n_ctx=512, n_batch=128, n_ubatch=64, n_threads=2, n_threads_batch=2, flash_attn=True)
    plan = make_plan(st, tiny_moe, params=params)
    ctx = open_bench(st, plan.id[:12])
    run = bench_quality(ctx, OPTS)
    save_run(run)
    row = ctx.store.query(f"SELECT * FROM bench_summary WHERE run_id = '{run.run_id}'").to_pylist()
    return {"row": row[0] if len(row) == 1 else row, "raw": ctx.store.get_table("bench_quality_raw", run.run_id).to_pylist(),
            "settings": st}


def test_summary_row_holds_kl_top1_and_both_perplexities(stored: dict[str, Any]) -> None:
    row = stored["row"]
    assert row["suite"] == "quality" and row["baseline"] == "reference"
    m = json.loads(row["metrics"])
    assert 0 <= m["mean_kl"] <= m["max_kl"] and 0 <= m["top1"] <= 1
    assert m["n_tokens"] == row["n_samples"] == 6 * 3  # 1 held-out prompt + 2 conversations
    assert m["ppl_plan"] > 1 and m["ppl_reference"] > 1
    assert math.isclose(m["ppl_ratio"], m["ppl_plan"] / m["ppl_reference"])
    assert m["reference"]["flash_attn"] is False and m["reference"]["type_k"] == "f16"
    limits = stored["settings"].plan
    passed = m["mean_kl"] <= limits.max_kl and m["top1"] >= limits.min_top1
    assert row["verdict"] == ("pass" if passed else "fail")


def test_raw_rows_cover_prompts_conversations_and_perplexity(stored: dict[str, Any]) -> None:
    raw = stored["raw"]
    assert [r["source"] for r in raw].count("held_out") == 1
    assert [r["source"] for r in raw].count("conversation") == 2
    ppl = [r for r in raw if r["source"] == "perplexity"]
    assert len(ppl) == 2 and all(r["n_tokens"] == 48 and r["nll_plan"] > 0 and r["nll_reference"] > 0 for r in ppl)
    kl_rows = [r for r in raw if r["source"] != "perplexity"]
    assert all(r["n_tokens"] == 6 and r["mean_kl"] >= 0 and r["max_kl"] >= r["mean_kl"] for r in kl_rows)
    # flash attention changes the arithmetic a little: not bit-identical, yet far within the limits
    assert any(r["max_kl"] > 0 for r in kl_rows)
    m = json.loads(stored["row"]["metrics"])
    assert m["mean_kl"] == pytest.approx(sum(r["mean_kl"] for r in kl_rows) / len(kl_rows))


def test_a_non_reference_quality_profile_is_info(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> None:
    from tasks.bench.quality import _verdict

    st, _ = bench_settings(tmp_path_factory.mktemp("bench-quality-kv"), session_cache(tmp_path_factory))
    plan = make_plan(st, tiny_moe, quality_profile="kv-q8_0")
    verdict, detail = _verdict(open_bench(st, plan.id[:12]), mean_kl=0.5, top1=0.2)
    assert verdict == "info" and "kv-q8_0" in detail


def test_perplexity_is_scored_on_wikitext2_when_it_is_cached(tmp_path_factory: pytest.TempPathFactory,
                                                              tiny_moe: Path) -> None:
    st, _ = bench_settings(tmp_path_factory.mktemp("bench-quality-wiki"), session_cache(tmp_path_factory))
    cached = st.cache_dir / "corpora" / "wikitext-2" / "test.txt"
    cached.parent.mkdir(parents=True, exist_ok=True)
    body = " ".join(f"The harbour light number {i} was first lit in {1851 + i} and kept for a century ." for i in range(40))
    cached.write_text(f" = Harbour lights = \n\n {body} \n\n {body} \n", encoding="utf-8")
    params = EngineParams(n_ctx=512, n_batch=128, n_ubatch=64, n_threads=2, n_threads_batch=2)
    ctx = open_bench(st, make_plan(st, tiny_moe, params=params).id[:12])
    row = bench_quality(ctx, OPTS).rows[0]
    assert row.metrics["ppl_corpus"] == "WikiText-2 test"
    assert "WikiText-2 test text" in row.detail and row.metrics["ppl_tokens"] == 2 * 48
