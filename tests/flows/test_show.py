"""`flux show` of a stored plan, printed to a real console (no planner run)."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from artifacts.config import load_settings
from artifacts.records.evidence import MeasureSummary
from engine_bridge.params import EngineParams
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
