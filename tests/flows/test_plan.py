"""`flux plan` end to end: the real Prefect flow, real workers, real llama.cpp on a tiny twin."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from artifacts.records.plan import Plan, PlanRequest
from artifacts.store import Store

REPO = Path(__file__).resolve().parents[2]
BUDGET = 25


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> dict[str, object]:
    """One real plan of the tiny MoE twin, shared by the tests of this module."""
    import os

    home = tmp_path_factory.mktemp("planhome")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLUX_", "XDG_DATA", "XDG_CONFIG"))}
    env.update({"XDG_DATA_HOME": str(home / "data"), "XDG_CONFIG_HOME": str(home / "config"),
                "PREFECT_HOME": str(home / "prefect"), "PYTHONPATH": str(REPO)})
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "flows", "plan", str(tiny_moe), "--budget-s", str(BUDGET), "--ctx", "512"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=BUDGET + 240)
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr[-4000:]
    plan_id = out.stdout.strip().splitlines()[-1]
    return {"env": env, "id": plan_id, "took": took, "log": out.stderr, "data": home / "data" / "flux"}


def flux(env: dict[str, str], *args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flows", *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_plan_finishes_within_budget_and_prints_an_id(planned: dict[str, object]) -> None:
    assert re.fullmatch(r"[0-9a-f]{64}", str(planned["id"]))
    assert float(planned["took"]) < BUDGET + 60 + 30  # + the ephemeral Prefect server's start-up (8-25 s)
    log = str(planned["log"])
    for stage in ("probe", "enumerate", "prune", "measure", "validate", "persist"):
        assert f"Task run '{stage}" in log, stage
    assert re.search(r"measure: candidate \d+/\d+ .* s left in the budget", log)
    for stage in ("probe", "reference", "measure", "validate"):  # the flow's clock: time and what is left
        assert re.search(rf"{stage}: \d+ s \((computed|reused)\); \d+ s so far, about \d+ s left", log), stage


def test_plan_is_immutable_and_keyed(planned: dict[str, object]) -> None:
    store = Store(Path(str(planned["data"])))
    plan = Plan.model_validate(store.get_json("plan", str(planned["id"])))
    assert set(plan.key) >= {"model_hash", "hardware", "backend_build", "driver", "flags", "settings"}
    assert plan.validation.passed and plan.measured.n_trials > 0
    assert plan.candidate.id in {s.candidate_id for s in plan.finalists}
    trials = store.get_table("trials", plan.trials_table)
    assert trials.num_rows >= len([s for s in plan.finalists if s.n_trials])
    assert {"probe", "enumerate", "prune", "reference", "measure", "validate", "total"} <= set(plan.stage_seconds)
    assert plan.key["planner_code"], "plans are keyed by the code that made them"
    ranked = [s for s in plan.finalists if s.workload_s is not None]
    assert ranked and all(s.n_rounds >= 2 for s in ranked), "every finalist that can be the plan has a spread"
    assert all(s.n_rounds >= 2 or (s.error or "").startswith(("measured once", "not measured"))
               for s in plan.finalists if s.n_trials)


def test_show_prints_the_plan(planned: dict[str, object]) -> None:
    out = flux(planned["env"], "show", str(planned["id"])[:10])  # type: ignore[arg-type]
    assert out.returncode == 0, out.stderr
    for needle in ("llama.cpp flags", "measured: prefill", "spread", "predicted vs measured", "roofline",
                   "cost model median error", "memory budget", "key: model", "planning: probe", "pred GPU GiB"):
        assert needle in out.stdout, needle
    listing = flux(planned["env"], "plans")  # type: ignore[arg-type]
    assert str(planned["id"])[:12] in listing.stdout


def test_second_plan_is_reused(planned: dict[str, object], tiny_moe: Path) -> None:
    """How quickly is scripts/bench_reuse.py's to say (docs/benchmarks/cpu.md): no wall-clock limit in a test."""
    out = flux(planned["env"], "plan", str(tiny_moe), "--budget-s", str(BUDGET), "--ctx", "512")  # type: ignore[arg-type]
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == planned["id"] and "reusing saved plan" in out.stderr


def _flow_runs(prefect_home: Path) -> int:
    """How many flow runs Prefect's database (its temporary server's, under PREFECT_HOME) records."""
    import sqlite3

    with sqlite3.connect(prefect_home / "prefect.db") as db:
        return int(db.execute("SELECT count(*) FROM flow_run").fetchone()[0])


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_reuse_runs_no_flow_and_starts_no_prefect_server(planned: dict[str, object], tiny_moe: Path,
                                                          tmp_path: Path) -> None:
    env: dict[str, str] = planned["env"]  # type: ignore[assignment]
    home = Path(env["PREFECT_HOME"])
    before = _flow_runs(home)
    assert before >= 1, "the plan was made by a flow run, recorded in this database"
    args = ("plan", str(tiny_moe), "--budget-s", str(BUDGET), "--ctx", "512")

    def reused(**more: str) -> str:
        out = flux({**env, **more}, *args)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip() == planned["id"] and "reusing saved plan" in out.stderr
        return out.stderr

    reused()  # as a user runs it: a flow run here would be recorded in the temporary server's database
    assert _flow_runs(home) == before, "a reuse ran a flow"
    # a Prefect home of its own: a temporary server started there would create its database; and every module the
    # process imports is listed (-X importtime): Prefect is not among them
    fresh = tmp_path / "prefect-home"
    said = reused(PREFECT_HOME=str(fresh), PYTHONPROFILEIMPORTTIME="1")
    assert not (fresh / "prefect.db").exists(), "a reuse started Prefect's temporary server"
    assert not re.search(r"\| +prefect(\.|$)", said, re.MULTILINE), "a reuse imported Prefect"
    # and with Prefect's API on a port where nothing listens: any contact with a server fails
    reused(PREFECT_API_URL=f"http://127.0.0.1:{_closed_port()}/api")


def test_a_renamed_model_reuses_its_plan_and_the_new_path_is_remembered(planned: dict[str, object], tiny_moe: Path,
                                                                         tmp_path: Path) -> None:
    import shutil

    moved = tmp_path / "elsewhere" / "renamed-twin.gguf"
    moved.parent.mkdir()
    shutil.copy(tiny_moe, moved)
    out = flux(planned["env"], "plan", str(moved), "--budget-s", str(BUDGET), "--ctx", "512")  # type: ignore[arg-type]
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == planned["id"], "the same bytes under another name are the same model"
    paths = [p.read_text() for p in Path(str(planned["data"])).rglob("model_path/*.json")]
    assert any(str(moved) in text for text in paths), paths


def test_replan_measures_again_with_upstream_from_the_store(planned: dict[str, object], tiny_moe: Path) -> None:
    out = flux(planned["env"], "plan", str(tiny_moe), "--budget-s", str(BUDGET), "--ctx", "512", "--replan")  # type: ignore[arg-type]
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() != planned["id"]
    for kind in ("probe", "space", "finalists"):
        assert re.search(rf"{kind} [0-9a-f]{{12}} reused from the store", out.stderr), kind
    assert re.search(r"measured [0-9a-f]{12} computed and stored", out.stderr)


def test_context_beyond_training_is_a_clear_error(planned: dict[str, object], tiny_moe: Path) -> None:
    out = flux(planned["env"], "plan", str(tiny_moe), "--ctx", "99999999")  # type: ignore[arg-type]
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "trained context" in out.stderr and "--ctx" in out.stderr


def test_budget_too_small_for_one_finalist(planned: dict[str, object], tiny_moe: Path) -> None:
    out = flux(planned["env"], "plan", str(tiny_moe), "--ctx", "512", "--budget-s", "0.01", "--replan")  # type: ignore[arg-type]
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "cannot measure the" in out.stderr and "times each" in out.stderr and "use --budget-s" in out.stderr


def test_chat_workload_is_its_own_plan_timed_on_long_replies(planned: dict[str, object], tiny_moe: Path) -> None:
    out = flux(planned["env"], "plan", str(tiny_moe), "--budget-s", "40", "--ctx", "512", "--workload", "chat")  # type: ignore[arg-type]
    assert out.returncode == 0, out.stderr[-3000:]
    chat_id = out.stdout.strip().splitlines()[-1]
    assert chat_id != planned["id"], "another workload is another plan, not the saved agent plan"
    store = Store(Path(str(planned["data"])))
    agent = Plan.model_validate(store.get_json("plan", str(planned["id"])))
    chat = Plan.model_validate(store.get_json("plan", chat_id))
    assert (agent.request.workload, chat.request.workload) == ("agent", "chat")
    assert chat.workload_prefill_share < 0.5 < agent.workload_prefill_share
    shown = flux(planned["env"], "show", chat_id[:12])  # type: ignore[arg-type]
    assert "workload mix: chat" in shown.stdout
    bad = flux(planned["env"], "plan", str(tiny_moe), "--workload", "batch")  # type: ignore[arg-type]
    assert bad.returncode == 2 and "invalid choice: 'batch'" in bad.stderr and "agent" in bad.stderr


def test_the_workload_is_part_of_the_plan_key(tiny_moe: Path) -> None:
    from artifacts.records.keys import plan_key
    from tasks.testing import h200_report

    hw = h200_report(0)
    agent = plan_key("m", hw, "b", PlanRequest(model=str(tiny_moe)), {})
    chat = plan_key("m", hw, "b", PlanRequest(model=str(tiny_moe), workload="chat"), {})
    assert agent["flags"]["workload"] == "agent" and chat["flags"]["workload"] == "chat"


def test_flux_sql_shows_plans_and_their_trials(planned: dict[str, object]) -> None:
    listing = flux(planned["env"], "sql")  # type: ignore[arg-type]
    assert listing.returncode == 0, listing.stderr
    for view in ("plans", "probes", "plan_trials", "trials"):
        assert view in listing.stdout, view
    pid = str(planned["id"])
    got = flux(planned["env"], "sql", f"SELECT count(*) AS n, bool_or(chosen) AS any_chosen FROM plan_trials "  # type: ignore[arg-type]
               f"WHERE plan_id = '{pid}'")
    assert got.returncode == 0, got.stderr
    assert "True" in got.stdout, "the chosen finalist's trials carry its plan"
    bad = flux(planned["env"], "sql", "SELECT * FROM nowhere")  # type: ignore[arg-type]
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
