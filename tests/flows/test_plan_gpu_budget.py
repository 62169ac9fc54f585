"""`--gpu-mem-budget` on a machine without a GPU (issue 56 item 6): said at once, at the start of `flux plan`, and no
plan key of its own: the saved plan of the same request without it is reused (a stored probe and plan, no planner)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from artifacts.config import load_settings
from artifacts.engine_params import EngineParams
from artifacts.ids import content_id
from artifacts.model_info import model_info
from artifacts.records.keys import plan_key
from artifacts.records.kinds import PLAN, PROBE
from artifacts.records.plan import PlanRequest
from artifacts.records.store import Records
from engine_bridge.machine_facts import machine_facts
from flows.plan_context import plan_context
from flows.request import gpu_budget_unused, plan_request
from tasks.probing import probe as probe_stage
from tasks.recording.persist import existing_plan
from tasks.testing import h200_report, stored_plan


def test_the_plan_key_leaves_out_a_gpu_budget_where_llama_cpp_sees_no_gpu() -> None:
    def key(hw: Any, **flags: Any) -> dict[str, Any]:
        return plan_key("m", hw, "b", PlanRequest(model="m", **flags), {})

    cpu, gpu = h200_report(0), h200_report(1)
    assert key(cpu, gpu_mem_budget_gib=[12]) == key(cpu)
    assert key(gpu, gpu_mem_budget_gib=[12]) != key(gpu), "with a GPU the budget shapes the plan"
    assert gpu_budget_unused(PlanRequest(model="m", gpu_mem_budget_gib=[12, 8.5]), 0) == (
        "--gpu-mem-budget 12,8.5: this machine has no GPU, so the plan runs on the CPU and the budget is not used (a "
        "saved plan of the same request without it is the same plan)")
    assert gpu_budget_unused(PlanRequest(model="m", gpu_mem_budget_gib=[12]), 1) is None
    assert gpu_budget_unused(PlanRequest(model="m"), 0) is None


@pytest.mark.skipif(bool(machine_facts().gpus), reason="this machine has a GPU: the budget is used")
def test_flux_plan_says_at_once_and_reuses_the_plan_made_without_it(flux: Any, flux_env: dict[str, str],
                                                                     tiny_moe: Path, tmp_path: Path) -> None:
    settings = load_settings(flux_env)
    ctx = plan_context(plan_request(settings, tiny_moe), settings, model_info(tiny_moe))
    hw = h200_report(0).model_copy(update={"ggml_devices": [{"name": "CPU", "kind": "cpu"}], "others_cpus": 0.0})
    ctx.records.put(PROBE, hw, key=content_id(probe_stage.STAGE.key_of(ctx)))
    elsewhere = load_settings({**flux_env, "XDG_DATA_HOME": str(tmp_path / "elsewhere")})
    plan = stored_plan(elsewhere, tiny_moe, EngineParams(n_ctx=256, n_batch=64, n_ubatch=64))
    kid = content_id(plan_key(ctx.model_hash, hw, ctx.backend_build, ctx.req, ctx.settings_view(), None, ctx.code))
    Records.at(settings.data_dir).put(PLAN, plan, key=plan.id, meta={"key_id": kid})
    assert existing_plan(ctx) == plan.id, "the plan of the request without the flag is saved"

    got = flux("plan", str(tiny_moe), "--gpu-mem-budget", "12")
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == plan.id, "the saved plan without the flag, not a new one"
    lines = got.stderr.splitlines()
    said = next(i for i, x in enumerate(lines) if x.startswith("note: --gpu-mem-budget 12: this machine has no GPU"))
    assert said < next(i for i, x in enumerate(lines) if "reusing saved plan" in x), "at once, before anything else"
    plain = flux("plan", str(tiny_moe))
    assert plain.returncode == 0 and plain.stdout.strip() == plan.id and "gpu-mem-budget" not in plain.stderr
