"""`flux show` of a stored plan, printed to a real console (no planner run)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from rich.console import Console

from artifacts.config import load_settings
from artifacts.engine_params import EngineParams
from artifacts.records.evidence import MeasureSummary
from flows.show import print_plan
from tasks.testing import stored_plan


def test_show_states_the_measured_gpu_memory_when_there_is_one(tiny_moe: Path, tmp_path: Path) -> None:
    settings = load_settings({"XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                              "HOME": str(tmp_path)})
    params = EngineParams(n_ctx=256, n_batch=64, n_ubatch=64)
    measured = MeasureSummary(candidate_id="c000", prefill_tps=900.0, decode_tps=50.0, workload_s=1.0, n_trials=2,
                              gpu_bytes=int(7.85 * 2**30))
    for plan, want in ((stored_plan(settings, tiny_moe, params, measured=measured.model_dump()), True),
                       (stored_plan(settings, tiny_moe, params), False)):
        out = io.StringIO()
        print_plan(plan, Console(file=out, width=200))
        assert ("measured GPU memory of the chosen plan (NVML, after its runs, per-process): 7.85 GiB" in out.getvalue()) is want
        assert "workload mix" in out.getvalue()


def test_show_prints_the_page_budgets(tiny_moe: Path, tmp_path: Path) -> None:
    """The KV cache the plan commits at load, per device, and the RAM `flux serve` gives parked conversations."""
    from server.service import PARK_MAX_BYTES, park_budget

    settings = load_settings({"XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                              "HOME": str(tmp_path)})
    plan = stored_plan(settings, tiny_moe, EngineParams(n_ctx=256, n_batch=64, n_ubatch=64))
    out = io.StringIO()
    print_plan(plan, Console(file=out, width=400), reserve_percent=25)
    line = next(x for x in out.getvalue().splitlines() if x.startswith("page budgets:"))
    kv = sum(plan.candidate.kv_bytes.values())
    assert kv > 0 and f"KV cache for 256 tokens x {plan.candidate.params.n_seq_max} sequence(s)" in line
    assert f"{kv / 2**30:.2f} GiB" in line and "25% host reserve" in line
    assert f"at most {PARK_MAX_BYTES / 2**30:.2f} GiB" in line
    assert 0 <= park_budget(25) <= PARK_MAX_BYTES


def test_each_finalist_is_shown_with_its_own_prediction(tiny_moe: Path, tmp_path: Path) -> None:
    """Finalists are listed in the order they were measured and predictions in the order prune ranked them:
    each row pairs them by candidate id (run 11's `flux show` printed the first prediction beside another
    finalist), and a finalist timed on another engine has its placement's prediction."""
    from artifacts.records.search import Prediction

    settings = load_settings({"XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                              "HOME": str(tmp_path)})
    preds = [Prediction(candidate_id=cid, prefill_tps=pp, decode_tps=tg, score_s=1.0)
             for cid, pp, tg in (("c191", 1572.2, 40.6), ("c201", 1453.6, 37.4), ("c121", 2321.7, 15.6))]
    measured = [MeasureSummary(candidate_id=cid, prefill_tps=pp, decode_tps=tg, workload_s=w, n_trials=2)
                for cid, pp, tg, w in (("c191", 1984.4, 38.5, 1.35), ("c121", 2353.4, 30.7, 1.5),
                                       ("c201@llama-server", 1500.0, 36.0, 1.6))]
    plan = stored_plan(settings, tiny_moe, EngineParams(n_ctx=256, n_batch=64, n_ubatch=64),
                       predictions=[p.model_dump() for p in preds]).model_copy(update={"finalists": measured})
    out = io.StringIO()
    print_plan(plan, Console(file=out, width=300))
    rows = {line.split()[0].rstrip("*"): line for line in out.getvalue().splitlines() if line.lstrip().startswith("c")}
    assert "2321.7" in rows["c121"] and "15.6" in rows["c121"] and "1572.2" not in rows["c121"]
    assert "1453.6" in rows["c201@llama-server"] and "37.4" in rows["c201@llama-server"]
    assert "1572.2" in rows["c191"] and "40.6" in rows["c191"]


def test_show_prints_the_routing_traces_coverage_and_locality(tiny_moe: Path, tmp_path: Path) -> None:
    """A plan shaped by a routing trace says how skewed it was and how often a token's picks were its
    predecessor's (the route stage's repeat share); a plan of a trace made before that says only the first."""
    settings = load_settings({"XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                              "HOME": str(tmp_path)})
    params = EngineParams(n_ctx=256, n_batch=64, n_ubatch=64)
    coverage = {"10%": 0.31, "25%": 0.6, "50%": 0.9}
    for repeat, want in ((0.47, "; 47% of a token's picks are the previous token's (median)"), (None, None)):
        plan = stored_plan(settings, tiny_moe, params, routing_trace="ab" * 20, routing_coverage=coverage,
                           routing_repeat=repeat)
        out = io.StringIO()
        print_plan(plan, Console(file=out, width=400))
        line = next(x for x in out.getvalue().splitlines() if x.strip().startswith("routing (trace abababababab)"))
        assert "50% of experts take 90% of its picks" in line
        assert (want in line) if want else ("previous token" not in line and line.endswith("(median)"))


def test_flux_plans_lists_the_readable_plans_and_names_one_it_cannot_read(flux: Any, flux_env: dict[str, str],
                                                                          tiny_moe: Path) -> None:
    """A plan written by another version of Flux (here: a field a later check refuses) must not hide the others."""
    import json

    settings = load_settings(flux_env)
    good = stored_plan(settings, tiny_moe, EngineParams(n_ctx=256, n_batch=64, n_ubatch=64))
    stale = stored_plan(settings, tiny_moe, EngineParams(n_ctx=512, n_batch=64, n_ubatch=64))
    path = settings.data_dir / "objects" / "plan" / f"{stale.id}.json"
    doc = json.loads(path.read_text())
    doc["request"]["gpu_mem_budget_gib"] = [-1.0]
    path.write_text(json.dumps(doc))
    got = flux("plans")
    assert got.returncode == 0, got.stderr
    assert good.id[:12] in got.stdout and stale.id[:12] not in got.stdout
    note = [x for x in got.stderr.splitlines() if x.startswith("note: plan ")]
    assert len(note) == 1 and stale.id[:12] in note[0] and "gpu_mem_budget_gib" in note[0], got.stderr


def test_show_prints_prefill_by_prompt_length_beside_decode_by_depth(tiny_moe: Path, tmp_path: Path) -> None:
    """A coding agent's wait is prefill: `flux show` prints the chosen plan's measured prefill speed for each prompt
    length it timed (median over rounds, from the plan's trials; another finalist's and failed trials left out), with
    its micro-batch and its longest prompt's wait; a plan whose trials are not in the store prints no such line."""
    import pyarrow as pa

    from artifacts.records.kinds import TRIALS_TABLE
    from artifacts.store import Store
    from flows.show import plan_trials, prefill_by_length
    from tasks.measurement.rounds import TRIAL_SCHEMA

    settings = load_settings({"XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                              "HOME": str(tmp_path)})
    trials_id = "ab" * 16
    plan = stored_plan(settings, tiny_moe, EngineParams(n_ctx=40960, n_batch=4096, n_ubatch=4096),
                       trials_table=trials_id, decode_by_depth=[(1024, 180.0), (16384, 150.0)])
    # (candidate, round, prompt tokens, prompt ms, error): c000 at 1,024 tokens in 0.5 and 0.4 s (2,048 and 2,560
    # tok/s: median 2,304), 16,384 in 3.2 s
    rows = [("c000", 0, 1024, 500.0, None), ("c000", 1, 1024, 400.0, None), ("c000", 0, 16384, 3200.0, None),
            ("c000", 1, 16384, 1.0, "worker died"), ("c001", 0, 1024, 100.0, None)]
    table = pa.Table.from_pylist([
        {"candidate_id": c, "round": r, "prompt_index": 0, "prompt_tokens": n, "prompt_ms": ms, "gen_tokens": 32,
         "gen_ms": 200.0, "prefill_tps": None, "decode_tps": 160.0, "load_ms": 1.0, "peak_rss_bytes": 0,
         "gpu_bytes": None, "gpu_method": None, "error": err} for c, r, n, ms, err in rows], schema=TRIAL_SCHEMA)
    assert plan_trials(settings.data_dir, plan) is None, "not stored yet"
    Store(settings.data_dir).put_table(TRIALS_TABLE, table, key=trials_id)
    trials = plan_trials(settings.data_dir, plan)
    assert trials is not None and prefill_by_length(trials, "c000") == [(1024, 2304.0), (16384, 5120.0)]
    out = io.StringIO()
    print_plan(plan, Console(file=out, width=400), trials=trials)
    lines = out.getvalue().splitlines()
    line = next(x for x in lines if x.startswith("prefill by prompt length"))
    assert line == ("prefill by prompt length (measured, -ub 4096): 1024: 2304, 16384: 5120 tok/s; "
                    "a 16384-token prompt took 3.20 s")
    assert lines[lines.index(line) + 1].startswith("decode by context depth (measured): 1024: 180.0, 16384: 150.0")
    out = io.StringIO()
    print_plan(plan, Console(file=out, width=400))
    assert "prefill by prompt length" not in out.getvalue()


def test_show_prints_the_kv_pages_the_plan_implies(tiny_moe: Path, tmp_path: Path) -> None:
    """Pages per pool: the host's an estimate from the probe's RAM (else the plan's host budget), minus the weights
    in RAM and the reserve, that `flux serve` makes again when it starts."""
    from artifacts.model_info import model_info
    from artifacts.records.hardware import HardwareReport
    from flows.page_budgets import estimated_host_ram
    from server.kv_pages import kv_page_bytes

    settings = load_settings({"XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                              "HOME": str(tmp_path)})
    plan = stored_plan(settings, tiny_moe, EngineParams(n_ctx=1024, n_seq_max=2, n_batch=64, n_ubatch=64))
    out = io.StringIO()
    print_plan(plan, Console(file=out, width=600), reserve_percent=10, data_dir=settings.data_dir)
    line = next(x for x in out.getvalue().splitlines() if x.startswith("KV pages"))
    page = kv_page_bytes(model_info(tiny_moe), "f16", "f16")
    assert line.startswith(f"KV pages of 256 tokens for 1024 tokens x 2 sequence(s): host 8 pages x {page / 1024:,.1f} KiB")
    assert "an estimate: the plan's host budget of 8.0 GiB" in line and "`flux serve` sizes it" in line
    weights = plan.candidate.weights_bytes["CPU"]
    hw = HardwareReport.model_construct(ram_total=100 << 30, ram_available=50 << 30)
    ram, how = estimated_host_ram(plan, 10, hw)
    assert ram.kv_bytes == (50 << 30) - weights - (10 << 30)
    assert "the probe's 50.0 GiB of available RAM" in how and "the 10% reserve (10.0 GiB)" in how
    assert estimated_host_ram(plan, 10, hw, override=4096)[0].kv_bytes == 4096
