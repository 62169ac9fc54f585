"""`flux bench run --via serve --depths`: decode and prefill by depth, on the CPU with the real parts (the plan's
`flux serve` and llama-server of the built backend, the tiny MoE twin): one row per (contender, depth) with the
depth, both speeds, the solo flag, and for the plan the bytes bound of its decode there; a depth past the plan's
context is skipped and said; a depth past a baseline's own context is "not held" for it, never a failure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_support import bench_settings, make_plan, session_cache

from artifacts.engine_params import EngineParams
from artifacts.model_info import kv_cache_bytes, model_info
from artifacts.records.kinds import PROBE
from artifacts.records.search import Candidate
from artifacts.records.store import Records
from flows.bench_report import print_rows
from tasks.bench.context import BenchContext, open_bench
from tasks.bench.record import overall, save_run, summary_table
from tasks.bench.rows import distinct_prompts
from tasks.bench.run import RunOptions, bench_run
from tasks.bench.served_contenders import Turn, plan_contender, server_contender
from tasks.bench.served_depths import RACE, depth_lines, depth_summary, depth_turns
from tasks.bench.served_race import race_solo
from tasks.costmodel import all_on
from tasks.testing import h200_report

N_CTX, GEN = 1024, 32


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> BenchContext:
    """A plan of the tiny twin holding 1,024 tokens, its placement the model's own layers on the CPU, and a probe
    of this machine stored for it (the H200 host's figures stand in for the bandwidths its bound is priced at)."""
    st, _ = bench_settings(tmp_path_factory.mktemp("bench-depths"), session_cache(tmp_path_factory))
    info = model_info(tiny_moe)
    params = EngineParams(n_ctx=N_CTX, n_batch=256, n_ubatch=256, n_threads=2, n_threads_batch=2)
    cand = Candidate(id="c000", family="hand-built", placement=all_on(info, "CPU"), params=params,
                     weights_bytes={"CPU": tiny_moe.stat().st_size}, kv_bytes={"CPU": kv_cache_bytes(info, "f16", N_CTX)},
                     compute_bytes={"CPU": 16 << 20})
    plan = make_plan(st, tiny_moe, params=params, candidate=cand.model_dump(mode="json"))
    hw = h200_report(0).model_copy(update={"fingerprint": plan.hardware_fingerprint, "model_hash": plan.model_hash})
    Records.at(st.data_dir).put(PROBE, hw, key="probe-for-depths")
    c = open_bench(st, plan.id[:12])
    if c.llama_server is None:
        pytest.skip("llama-server is not built (scripts/build-backend.sh)")
    return c


def test_depths_past_the_context_are_skipped_and_the_rest_raced_shallowest_first() -> None:
    turns, skipped = depth_turns([4096, 512, 256, 512, 1000], N_CTX, GEN)
    assert [t.prompt for t in turns] == [256, 512] and {t.gen for t in turns} == {GEN}
    assert skipped == [1000, 4096], "1,000 + 32 generated tokens do not fit 1,024"
    with pytest.raises(ValueError, match="--via serve"):
        RunOptions(depths=(256,))


def test_each_contender_at_each_depth_is_a_row_with_its_speeds_and_the_plans_bound(ctx: BenchContext) -> None:
    said: list[str] = []
    opts = RunOptions(via="serve", depths=(512, 256, 4096), depth_gen=GEN, rounds=2, baselines=("fit",), n_boot=200)
    run = bench_run(ctx, opts, said.append)
    by = {r.baseline: r for r in run.rows}
    assert list(by) == ["plan@256", "fit@256", "plan@512", "fit@512", "plan@4096"], list(by)
    assert any("depth 4,096: skipped" in s for s in said), said
    skipped = by["plan@4096"]
    assert skipped.verdict == "info" and "skipped" in skipped.detail and skipped.metrics["skipped"] is True
    for depth in (256, 512):
        plan, fit = by[f"plan@{depth}"].metrics, by[f"fit@{depth}"].metrics
        for m, who in ((plan, "plan"), (fit, "fit")):
            assert m["depth"] == depth and m["contender"] == who and m["solo"] is True and m["race"] == RACE
            assert (m["prefill_tps"] or 0) > 0 and (m["decode_tps"] or 0) > 0, m
            assert not m["not_held"] and not m["error"]
        assert fit["server_decode_tps"] and fit["server_prefill_tps"], "llama-server's own timings beside the client's"
        assert plan["bound_decode_tps"] > 0 and plan["predicted_decode_tps"] > 0
        assert fit["plan_bound_decode_tps"] == plan["bound_decode_tps"]
        # a ratio at each depth: reported, or, where the visits disagreed on this busy machine, kept unreported
        fit_row = by[f"fit@{depth}"]
        assert fit_row.ratio_decode or fit_row.metrics["unreported"]["decode"]["ratio"]
        assert fit_row.verdict in ("info", "invalid") and by[f"plan@{depth}"].verdict in ("info", "invalid")
    # more cells read at 512 than at 256: a lower bound (the cost model's arithmetic, not a speed)
    assert by["plan@512"].metrics["bound_decode_tps"] < by["plan@256"].metrics["bound_decode_tps"]
    assert sorted(set(run.raw.column("depth").to_pylist())) == [256, 512]
    assert run.verdict == overall([r.verdict for r in run.rows])
    # stored as the race's rows are, and printed per depth by `flux bench run` / `flux bench show`
    save_run(run)
    stored = summary_table(run).to_pylist()
    assert json.loads(stored[0]["metrics"])["depth"] == 256
    lines = depth_lines(stored)
    assert lines[0].startswith("depth 256: the plan's decode bound") and any(line.startswith("depth 4,096") for line in lines)
    print_rows(stored, run.raw, "depths")


def test_a_depth_past_a_baselines_own_context_is_not_held_not_a_failure(ctx: BenchContext) -> None:
    """A baseline started with half the plan's context (as --fit may shrink it): 512 + 32 tokens do not fit its
    512, so that depth is not held for it, said and recorded, and its row is no failure."""
    turns = (Turn(name="d256", prompt=256, gen=GEN), Turn(name="d512", prompt=512, gen=GEN))
    flat = distinct_prompts(ctx, [256, 256, 512, 512], "held_out", 5)
    prompts = {"d256": flat[:2], "d512": flat[2:]}
    assert [len(x) for x in flat] == [256, 256, 512, 512]
    assert len({tuple(x[:2]) for x in flat}) == 4, "no two prompts open alike: no prefix cache helps a prefill"
    short = server_contender(ctx, "fit", ["-c", "512", "-np", "1", "-t", "2", "--no-warmup", "-ngl", "0"],
                             "llama-server holding 512 tokens")
    said: list[str] = []
    contenders = [plan_contender(ctx), short]
    table = race_solo(contenders, prompts, turns, 1, ctx.timeout_s, 0, said.append, turns_per_visit=1,
                      warmup="first")
    rows = {r["engine"]: r for r in table.to_pylist() if r["turn"] == 1}
    assert rows["fit"]["not_held"] and rows["fit"]["n_ctx"] == 512 and not rows["fit"]["error"]
    assert rows["plan"]["n_ctx"] == N_CTX and rows["plan"]["decode_tps"] > 0
    assert any("d512 not held" in s for s in said), said
    opts = RunOptions(via="serve", depths=(256, 512), rounds=1, n_boot=200)
    by = {r.baseline: r for r in depth_summary(contenders, table, turns, {}, opts, {})}
    assert by["fit@512"].verdict == "info" and "not held" in by["fit@512"].detail
    assert by["fit@256"].metrics["decode_tps"] > 0 and by["plan@512"].metrics["decode_tps"] > 0
    assert "no bound" in by["plan@512"].detail, "no probe given: said, not invented"
