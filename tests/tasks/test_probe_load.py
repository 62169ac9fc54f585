"""A probe taken on a busy machine (issue 56 item 4): the probe records what other processes took of the CPUs; a
stored probe taken under load is measured again once the machine is quiet (reused, with a warning, while it is still
busy); a budget refusal from its speeds names `--reprobe`; a plan made from it, or whose first round ran far faster
than its probe predicted, says so in `flux show`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from artifacts.config import Settings, load_settings
from artifacts.engine_params import EngineParams
from artifacts.ids import content_id
from artifacts.model_info import model_info
from artifacts.records.hardware import CpuInfo, HardwareReport
from artifacts.records.kinds import PROBE
from artifacts.records.search import Finalists, Prediction
from flows.plan_context import plan_context
from flows.request import plan_request
from tasks.errors import ImpossiblePlan
from tasks.measurement.rounds import TRIAL_SCHEMA
from tasks.probing import probe as probe_stage
from tasks.probing.host import usable_cpus
from tasks.probing.machine import busy_limit, load_words, probe, quiet_now, taken_under_load
from tasks.recording.record import PROBE_DISAGREES, first_round_speedup, load_notes
from tasks.stage import PlanContext
from tasks.testing import h200_report, stored_plan

pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")


def cpu_report(others: float | None, cpus: int = 2, threads: int = 2) -> HardwareReport:
    """A CPU-only machine of ``cpus`` CPUs whose probe timed the kernels with ``threads`` threads while other
    processes kept ``others`` CPUs busy (None: a probe stored before that was measured)."""
    hw = h200_report(0)
    kernel = hw.kernels[0].model_copy(update={"n_threads": threads})
    return hw.model_copy(update={
        "cpu": CpuInfo(model="test CPU", physical_cores=threads, logical_cores=cpus, isa=["avx2"]),
        "kernels": [kernel], "ggml_devices": [{"name": "CPU", "kind": "cpu"}], "others_cpus": others,
        "load_avg_1m": None if others is None else others + 0.2, "usable_cpus": None if others is None else cpus})


@contextmanager
def busy_loops(n: int) -> Iterator[None]:
    """``n`` processes spinning on a CPU each, ended (by their ids) on the way out. They are started through a shell
    that leaves them behind, so they are no children of this process: the probe runs in it here, and it leaves its
    own process tree out of what others took."""
    loop = f"{sys.executable} -c 'while True: pass' > /dev/null 2>&1 < /dev/null & echo $!"
    pids = [int(subprocess.run(["sh", "-c", loop], capture_output=True, text=True, check=True).stdout)
            for _ in range(n)]
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture()
def settings(tmp_path: Path) -> Settings:
    return load_settings({"HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / "data"),
                          "XDG_CACHE_HOME": str(tmp_path / "cache")})


def context(settings: Settings, model: Path, **flags: Any) -> PlanContext:
    return plan_context(plan_request(settings, model, **flags), settings, model_info(model))


def test_busy_means_more_cpus_taken_than_the_kernels_left_free() -> None:
    """Half a CPU beyond those the probe's threads left free: none on a 2-core machine timed with 2 threads, the 8
    hyperthread siblings of a 16-CPU machine timed with 8."""
    assert busy_limit(cpu_report(0.0)) == 0.5
    assert busy_limit(cpu_report(0.0, cpus=16, threads=8)) == 8.5
    assert not taken_under_load(cpu_report(0.4)) and taken_under_load(cpu_report(0.6))
    assert not taken_under_load(cpu_report(8.0, cpus=16, threads=8)) and taken_under_load(cpu_report(9.0, 16, 8))
    assert not taken_under_load(cpu_report(None)), "a probe stored before load was recorded: unknown, not busy"
    assert load_words(cpu_report(1.8)) == "other processes kept 1.8 of 2 CPUs busy while it ran, at a load average of 2.0"


def test_a_probe_stored_before_load_was_recorded_still_loads() -> None:
    doc = cpu_report(0.1).model_dump(mode="json")
    for name in ("others_cpus", "load_avg_1m", "usable_cpus"):
        del doc[name]
    old = HardwareReport.model_validate(doc)
    assert old.others_cpus is None and old.usable_cpus is None and not taken_under_load(old)


def test_a_probe_taken_beside_busy_loops_records_that_it_was_under_load(tiny_moe: Path, settings: Settings) -> None:
    with busy_loops(usable_cpus()):
        hw = probe(tiny_moe, "model-hash", settings, "build")
        quiet, now = quiet_now(hw, seconds=0.5)
    assert hw.others_cpus is not None and hw.usable_cpus == usable_cpus() and hw.load_avg_1m is not None
    assert taken_under_load(hw), (hw.others_cpus, busy_limit(hw))
    assert not quiet and now > busy_limit(hw), "the loops still spin: the machine is not quiet"


@contextmanager
def logged(name: str) -> Iterator[list[str]]:
    """The messages logger ``name`` emits meanwhile, through a handler of its own (the suite's logging setup, e.g.
    Prefect's, may stop them from reaching pytest's capture)."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    level, disabled = logger.level, logger.disabled
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.disabled = False  # a logging.config.dictConfig of an earlier test may have disabled it
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled


def test_a_stored_busy_probe_is_measured_again_once_the_machine_is_quiet(tiny_moe: Path, tmp_path: Path) -> None:
    asked: list[HardwareReport] = []

    def calm(hw: HardwareReport) -> tuple[bool, float]:
        asked.append(hw)
        return True, 0.1

    def busy(hw: HardwareReport) -> tuple[bool, float]:
        return False, 1.9

    def stored(others: float, where: str) -> PlanContext:
        ctx = context(load_settings({"HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / where),
                                     "XDG_CACHE_HOME": str(tmp_path / "cache")}), tiny_moe)
        assert not probe_stage.measure_again(ctx, calm), "nothing stored: the probe is measured, not measured again"
        ctx.records.put(PROBE, cpu_report(others), key=content_id(probe_stage.STAGE.key_of(ctx)))
        return ctx

    quiet = stored(0.1, "quiet")
    assert not probe_stage.measure_again(quiet, calm) and not asked, "a quiet probe is reused without a look"
    ctx = stored(1.9, "busy")
    with logged("tasks.probing.probe") as lines:
        assert probe_stage.measure_again(ctx, calm) and asked and asked[0].others_cpus == 1.9
    text = "\n".join(lines)
    assert "measuring this machine again" in text and "kept 1.9 of 2 CPUs busy" in text
    assert not probe_stage.measure_again(ctx, busy), "still busy: a probe now would be as slow, it is reused"
    assert probe_stage.measure_again(dataclasses.replace(ctx, reprobe=True), busy), "--reprobe: whatever the load"
    # still busy: the stage's report says so, naming --reprobe
    with logged("test") as lines:
        probe_stage.STAGE.report(ctx, logging.getLogger("test"), cpu_report(1.9))  # type: ignore[misc]
    text = "\n".join(lines)
    assert "the probe was taken while the machine was busy" in text and "--reprobe" in text


def test_a_probe_measured_again_is_stored_and_found_by_the_next_plan(tiny_moe: Path, settings: Settings) -> None:
    """The store keeps the first record under a key: a re-probe goes to the next link of the machine's chain and
    every look-up (the stage's key, a saved plan's) finds the newest, busy or not, so it is measured once."""
    ctx = context(settings, tiny_moe)
    first = probe_stage.STAGE.key_of(ctx)
    ctx.records.put(PROBE, cpu_report(1.9), key=content_id(first))
    with busy_loops(usable_cpus()):  # the machine is still busy: the stored probe is its key, measured again it is not
        assert probe_stage.STAGE.key_of(ctx) == first
    again = dataclasses.replace(ctx, reprobe=True)
    second = probe_stage.STAGE.key_of(again)
    assert second != first and second["after"] == content_id(first)
    ctx.records.put(PROBE, cpu_report(0.0), key=content_id(second))
    newest = probe_stage.stored_probe(ctx)
    assert newest is not None and newest.others_cpus == 0.0 and probe_stage.STAGE.key_of(ctx) == second
    assert probe_stage.STAGE.key_of(again)["after"] == content_id(second), "another --reprobe: another link"


@pytest.mark.parametrize(("others", "names_reprobe"), [(1.9, True), (None, True), (0.0, False)])
def test_a_budget_refused_from_the_probes_speeds_names_reprobe_when_it_may_be_a_busy_machines(
        tiny_moe: Path, settings: Settings, others: float | None, names_reprobe: bool) -> None:
    """Issue 56: a probe stored at a load average of ~9 made the next `flux plan` on the quiet machine refuse its
    budget, and only --reprobe helped; the refusal never said so."""
    ctx = context(settings, tiny_moe, budget_s=0.01)
    with pytest.raises(ImpossiblePlan) as got:
        probe_stage.STAGE.report(ctx, logging.getLogger("test"), cpu_report(others))  # type: ignore[misc]
    msg = str(got.value)
    assert "use --budget-s" in msg and ("--reprobe" in msg) is names_reprobe, msg
    if others:
        assert "kept 1.9 of 2 CPUs busy" in msg, msg


def _trials(rows: list[tuple[str, int, float, float]]) -> pa.Table:
    """(candidate, round, prompt ms, gen ms) of 1,024-token prompts with 32 tokens generated each."""
    return pa.Table.from_pylist([
        {"candidate_id": c, "round": r, "prompt_index": 0, "prompt_tokens": 1024, "prompt_ms": pm, "gen_tokens": 32,
         "gen_ms": gm, "prefill_tps": None, "decode_tps": None, "load_ms": 1.0, "peak_rss_bytes": 0, "gpu_bytes": None,
         "gpu_method": None, "error": None} for c, r, pm, gm in rows], schema=TRIAL_SCHEMA)


def _finalists(prefill: float, decode: float) -> Finalists:
    return Finalists.model_construct(finalists=[], predictions=[
        Prediction(candidate_id=c, prefill_tps=prefill, decode_tps=decode, score_s=1.0) for c in ("c0", "c1")],
        workload_prefill_tokens=0, workload_decode_tokens=0, n_ranked=2)


def test_a_first_round_far_faster_than_its_probe_predicted_blames_the_probe() -> None:
    """Issue 56's numbers: predicted 1.4 tok/s, measured 10.3 (prefill alike): the first round ran ~7x faster."""
    # predicted: 1024 / 20 + 32 / 1.4 = 74 s a visit; measured 1024 / 150 + 32 / 10.3 = 9.9 s (c1 a little slower)
    trials = _trials([("c0", 0, 1024 / 150 * 1e3, 32 / 10.3 * 1e3), ("c1", 0, 1024 / 140 * 1e3, 32 / 9.5 * 1e3),
                      ("c0", 1, 1.0, 1.0), ("c1@llama-server", 0, 1024 / 150 * 1e3, 32 / 10.3 * 1e3)])
    speedup = first_round_speedup(_finalists(20.0, 1.4), trials)
    assert speedup is not None and 6.5 < speedup < 8, speedup  # the second round's rows are not the first visit's
    notes = load_notes(cpu_report(None), _finalists(20.0, 1.4), trials)
    assert len(notes) == 1 and notes[0].startswith(f"the first round ran {speedup:.1f}x faster than the cost model")
    assert "`flux plan --reprobe`" in notes[0] and "likely taken while the machine was busy" in notes[0]
    # as predicted (within the cost model's usual error): nothing to say
    assert load_notes(cpu_report(0.0), _finalists(150.0 / 1.5, 10.3 / 1.5), trials) == []
    assert PROBE_DISAGREES == 3.0 and first_round_speedup(_finalists(1.0, 1.0), _trials([])) is None


def test_flux_show_says_a_plan_was_made_on_a_busy_machine(flux: Any, flux_env: dict[str, str], tiny_moe: Path) -> None:
    notes = load_notes(cpu_report(1.9), _finalists(150.0, 10.3), _trials([("c0", 0, 1024 / 150 * 1e3, 32 / 10.3 * 1e3)]))
    assert notes == ["made on a busy machine: other processes kept 1.9 of 2 CPUs busy while it was probed, at a load "
                     "average of 2.1, so the probe's speeds, the cost model's predictions and the budget's sizing are a "
                     "busy machine's; `flux plan --replan --reprobe` on a quiet machine measures both again"]
    plan = stored_plan(load_settings(flux_env), tiny_moe, EngineParams(n_ctx=256, n_batch=64, n_ubatch=64), notes=notes)
    shown = flux("show", plan.id[:12])
    assert shown.returncode == 0, shown.stderr
    assert f"note: {notes[0]}" in " ".join(shown.stdout.split()), shown.stdout
