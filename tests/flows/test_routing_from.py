"""`flux plan --routing-from`: a plan re-fitted to the routing a server counted (issue 51 item 4).

Real `flux plan` runs of the tiny MoE twin on this CPU (the real Prefect flow, real workers). The served trace is
counted by a real serving worker (every decode step, `serve_routing`) and saved where `flux serve` saves it
(tests/server/test_routing_watch.py covers the server's own saving and GET /flux/routing). Without a GPU a
routing trace shapes no placement, but a served trace still keys the plan and says so in its notes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from artifacts.engine_params import EngineParams
from artifacts.records.kinds import PLAN, ROUTING_TABLE
from artifacts.records.plan import Plan, PlanRequest
from artifacts.records.store import Records
from artifacts.store import Store
from engine_bridge import ops
from engine_bridge.client import WorkerClient
from engine_bridge.sampling import GREEDY
from engine_bridge.serve_trace import served_table, served_trace_path, trace_array, write_trace

REPO = Path(__file__).resolve().parents[2]
BUDGET = 25
PARAMS = EngineParams(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1)


def flux(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flows", *args], env=env, cwd=REPO, capture_output=True, text=True)


def served_counts(model: Path, n_tokens: int) -> ops.ServeRouting:
    """A real serving worker's counts of every decode step of one greedy reply."""
    with WorkerClient() as w:
        w.request(ops.SERVE_LOAD, ops.ServeLoadArgs(model=str(model), params=PARAMS, routing_every=1))
        prompt = np.random.default_rng(1).integers(0, 500, size=32).tolist()
        for _ in w.generate(ops.GenerateArgs(rid="r", prompt=prompt, max_tokens=n_tokens + 1, sampling=GREEDY)):
            pass
        return w.request(ops.SERVE_ROUTING)


def save_served(got: ops.ServeRouting, path: Path, plan: Plan, *, model_hash: str | None = None,
                counts: np.ndarray | None = None) -> Path:
    arr = np.asarray(got.counts, dtype=np.int64) if counts is None else counts
    table = served_table(arr, architecture=got.architecture, n_expert_used=got.n_expert_used, tokens=got.tokens,
                         steps=got.steps, sample_every=1, model_hash=model_hash or plan.model_hash, plan_id=plan.id)
    write_trace(table, path)
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("refit")
    e = {k: v for k, v in os.environ.items() if not k.startswith(("FLUX_", "XDG_DATA", "XDG_CONFIG"))}
    e.update({"XDG_DATA_HOME": str(home / "data"), "XDG_CONFIG_HOME": str(home / "config"),
              "PREFECT_HOME": str(home / "prefect"), "PYTHONPATH": str(REPO)})
    return e


def data_dir(env: dict[str, str]) -> Path:
    return Path(env["XDG_DATA_HOME"]) / "flux"


def plan_of(env: dict[str, str], *args: str) -> tuple[Plan, str]:
    out = flux(env, "plan", *args, "--budget-s", str(BUDGET), "--ctx", "512")
    assert out.returncode == 0, out.stderr[-4000:]
    return Records.at(data_dir(env)).get(PLAN, out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.fixture(scope="module")
def served(env: dict[str, str], tiny_moe: Path) -> tuple[Plan, Path]:
    """A plan of tiny-moe and the trace its server saved: 300 sampled tokens."""
    old, _ = plan_of(env, str(tiny_moe))
    got = served_counts(tiny_moe, 300)
    assert got.tokens == 300
    return old, save_served(got, served_trace_path(data_dir(env), old.id), old)


def test_a_plan_refitted_from_a_served_plan_is_keyed_by_its_trace(env: dict[str, str], tiny_moe: Path,
                                                                   served: tuple[Plan, Path]) -> None:
    old, path = served
    new, log = plan_of(env, str(tiny_moe), "--routing-from", old.id[:12])
    tid = new.request.routing_from
    assert new.id != old.id and tid is not None and new.key["routing"] == tid == new.routing_trace
    assert new.key["flags"]["routing_from"] == tid and old.key["flags"]["routing_from"] is None
    stored = Store(data_dir(env)).get_table(ROUTING_TABLE, tid)
    from engine_bridge.serve_trace import read_trace

    np.testing.assert_array_equal(trace_array(stored), trace_array(read_trace(path)))
    assert any(n.startswith(f"re-fitted to the routing `flux serve` counted ({old.id[:12]}, 300 sampled tokens")
               for n in new.notes), new.notes
    assert new.routing_coverage, "flux show prints the served routing's coverage"

    shown = flux(env, "show", old.id[:12])
    assert shown.returncode == 0, shown.stderr
    assert f"re-fitted as {new.id[:12]} from the routing `flux serve` of this plan counted (300 sampled tokens)" \
        in " ".join(shown.stdout.split())
    again = flux(env, "plan", str(tiny_moe), "--routing-from", str(path), "--budget-s", str(BUDGET), "--ctx", "512")
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == new.id, \
        "the same trace from its file is the same plan"
    assert "reusing saved plan" in again.stderr


def test_a_trace_too_short_to_rank_experts_falls_back_to_the_bundled_trace(
        env: dict[str, str], tiny_moe: Path, served: tuple[Plan, Path], tmp_path: Path) -> None:
    old, _ = served
    short = save_served(served_counts(tiny_moe, 40), tmp_path / "short.parquet", old)
    new, log = plan_of(env, str(tiny_moe), "--routing-from", str(short))
    assert new.routing_trace is not None and new.routing_trace != new.request.routing_from
    note = next(n for n in new.notes if "too few to rank experts" in n)
    assert "holds 40 sampled tokens" in note and "the bundled workload's trace" in note


def test_a_trace_of_another_model_or_shape_is_refused_in_one_line(env: dict[str, str], tiny_moe: Path,
                                                                  served: tuple[Plan, Path], tmp_path: Path) -> None:
    old, path = served
    got = served_counts(tiny_moe, 8)
    other = save_served(got, tmp_path / "other.parquet", old, model_hash="0" * 64)
    wide = save_served(got, tmp_path / "wide.parquet", old, counts=np.ones((4, 16), dtype=np.int64))
    for bad, what in ((other, "model hash"), (wide, "expert count")):
        out = flux(env, "plan", str(tiny_moe), "--routing-from", str(bad), "--budget-s", str(BUDGET))
        assert out.returncode == 2, out.stderr[-2000:]
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and f"--routing-from {bad}: the trace is of another model: its {what}" in lines[0]
    for missing in ("nothing-by-this-name", "0" * 12):
        out = flux(env, "plan", str(tiny_moe), "--routing-from", missing)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_deployment_run_resolves_the_flag_as_flux_plan_does(env: dict[str, str], tiny_moe: Path,
                                                              served: tuple[Plan, Path]) -> None:
    """`prefect deployment run 'plan-model/default' --param routing_from=<plan id>`: the flow's context stores the
    trace and keys the plan by its id, the same id the plan's file gives."""
    from artifacts.config import load_settings
    from flows import stages

    old, path = served
    settings = load_settings(env)
    by_plan = stages.context(PlanRequest(model=str(tiny_moe), routing_from=old.id[:12]), settings).req.routing_from
    by_file = stages.context(PlanRequest(model=str(tiny_moe), routing_from=str(path)), settings).req.routing_from
    assert by_plan == by_file and by_plan is not None and Store(data_dir(env)).has(ROUTING_TABLE, by_plan)
    again = stages.context(PlanRequest(model=str(tiny_moe), routing_from=by_plan), settings).req.routing_from
    assert again == by_plan, "a stored trace's id resolves to itself"
