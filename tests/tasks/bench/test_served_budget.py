"""`flux bench run --via serve` baselines hold their budget: fit's target is derived from the memory free when
fit starts (with the plan already loaded), and a contender that held under 85% or over its budget is flagged
and its ratios are not reported. NVML is a stand-in (no GPU here); llama-server is real."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_support import bench_settings, make_plan, session_cache

from engine_bridge.gpumem import GpuMemoryMeter, GpuReading
from engine_bridge.testing import GIB, FakeNvml
from tasks.bench.context import BenchContext, open_bench
from tasks.bench.rows import tokenize_prompts
from tasks.bench.served_contenders import (
    DEFAULT_TURNS,
    FIT_SLACK,
    MIN_BUDGET_SHARE,
    BaselineThreads,
    budget_flag,
    fit_args,
    fit_contender,
    pick_threads,
    probe_config,
    server_contender,
)

MIB = 2**20
PLAN_PID = 987654  # the plan's `flux serve`, as NVML lists it


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> BenchContext:
    st, _ = bench_settings(tmp_path_factory.mktemp("bench-budget"), session_cache(tmp_path_factory))
    return open_bench(st, make_plan(st, tiny_moe).id[:12])


def _target_mib(args: list[str]) -> int:
    return int(args[args.index("--fit-target") + 1])


def test_a_target_read_before_the_plan_loaded_starves_fit(ctx: BenchContext) -> None:
    """Today's failure, reproduced: the target read on an empty GPU, then the plan loads its 14 GiB; fit
    leaves target + nothing for itself (0.92 GiB of 14 on the H200) and the race calls it a 4.45x win."""
    nv = FakeNvml(totals=[140 * GIB], base=[GIB // 2])
    early = fit_args(ctx, 14 * GIB, GpuMemoryMeter(nv).device_free())
    nv.start(PLAN_PID, [14 * GIB])
    room_for_fit = nv.nvmlDeviceGetMemoryInfo(0).free - _target_mib(early) * MIB
    assert room_for_fit <= 0
    assert budget_flag(GpuReading(per_gpu=(int(0.92 * GIB),), method="per-process"), 14 * GIB) is not None


def test_fit_target_follows_the_memory_free_when_fit_starts(ctx: BenchContext) -> None:
    if ctx.llama_server is None:
        pytest.skip("llama-server is not built (scripts/build-backend.sh)")
    nv = FakeNvml(totals=[140 * GIB], base=[GIB // 2])
    meter = GpuMemoryMeter(nv)
    fit = fit_contender(ctx, 14 * GIB, meter)
    nv.start(PLAN_PID, [14 * GIB])          # the plan's server loads first and stays loaded
    try:
        fit.start()                         # a real llama-server (this CPU build ignores the target)
        target = _target_mib(fit.note.split())
        assert target == (140 * GIB - GIB // 2 - 14 * GIB - 14 * GIB + FIT_SLACK) // MIB
        nv.start(PLAN_PID + 1, [13 * GIB])  # another contender loads: the next fit's target drops with it
    finally:
        fit.stop()
    again = fit_contender(ctx, 14 * GIB, meter)
    try:
        again.start()
        assert _target_mib(again.note.split()) == target - 13 * GIB // MIB
    finally:
        again.stop()


@pytest.mark.parametrize(("held_gib", "flagged"), [(0.92, True), (14 * MIN_BUDGET_SHARE - 0.01, True),
                                                   (12.5, False), (14.0, False), (14.39, True)])
def test_a_contender_under_85_percent_or_over_its_budget_is_flagged(held_gib: float, flagged: bool) -> None:
    flag = budget_flag(GpuReading(per_gpu=(int(held_gib * GIB),), method="device-delta"), 14 * GIB)
    assert (flag is not None) is flagged
    assert budget_flag(None, 14 * GIB) is not None  # unread: no equal-memory claim either
    assert budget_flag(None, None) is None           # no budget (the whole GPU): nothing to hold


def test_baselines_take_the_faster_thread_count_of_the_first_one_found(ctx: BenchContext) -> None:
    """A CPU-bound baseline raced at the plan's threads may be slower than it could be: the first baseline
    found is timed again at the alternative count, and every baseline after it takes the faster one."""
    if ctx.llama_server is None:
        pytest.skip("llama-server is not built (scripts/build-backend.sh)")
    turn = DEFAULT_TURNS[0].model_copy(update={"prompt": 32, "gen": 16})
    prompts = tokenize_prompts(ctx, [32, 32], "held_out", seed=3)
    threads = BaselineThreads(1)
    first = probe_config(ctx, ["-c", "512", "-t", "1", "--no-warmup", "-ngl", "0"], prompts, turn)
    assert first.timing is not None
    found = (server_contender(ctx, "n-cpu-moe", first.args, ""), first)
    said: list[str] = []
    contender, probe = pick_threads(ctx, found, threads, 2, None, prompts, turn, said.append)
    assert said and "-t 1" in said[0] and "-t 2" in said[0]
    assert threads.n in (1, 2) and f"-t {threads.n}" in threads.note
    assert probe.args[probe.args.index("-t") + 1] == str(threads.n) and contender.name == "n-cpu-moe"
    assert pick_threads(ctx, (contender, probe), threads, threads.n, None, prompts, turn, said.append)[1] is probe
    assert fit_args(ctx, None, [], threads.n)[fit_args(ctx, None, [], threads.n).index("-t") + 1] == str(threads.n)
