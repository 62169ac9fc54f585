"""What a real plan measured on the CPU says about itself (issue 56 items 4, 5, 6, 7): `flux show` prints prefill by
prompt length from the plan's trials and fits 80 columns; the flow run's final state and its last log line carry the
plan id (what `prefect deployment run --watch` shows); the probe recorded the machine's load and a plan made from a
busy probe says so. One real `flux plan` of the tiny MoE twin (the real Prefect flow, real workers)."""

from __future__ import annotations

import io
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from artifacts.records.kinds import PLAN, PROBE
from artifacts.records.store import Records
from flows.show import plan_trials, print_plan
from tasks.probing.machine import taken_under_load

REPO = Path(__file__).resolve().parents[2]
BUDGET = 25


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> dict[str, object]:
    home = tmp_path_factory.mktemp("cpuplan")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLUX_", "XDG_DATA", "XDG_CONFIG"))}
    env.update({"XDG_DATA_HOME": str(home / "data"), "XDG_CONFIG_HOME": str(home / "config"),
                "PREFECT_HOME": str(home / "prefect"), "PYTHONPATH": str(REPO)})
    out = subprocess.run([sys.executable, "-m", "flows", "plan", str(tiny_moe), "--budget-s", str(BUDGET), "--ctx",
                          "512"], env=env, cwd=REPO, capture_output=True, text=True, timeout=BUDGET + 300)
    assert out.returncode == 0, out.stderr[-4000:]
    return {"env": env, "id": out.stdout.strip().splitlines()[-1], "log": out.stderr, "home": home,
            "data": home / "data" / "flux"}


def flux(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flows", *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_flux_show_prints_prefill_by_prompt_length_from_the_plans_trials(planned: dict[str, object]) -> None:
    shown = flux(planned["env"], "show", str(planned["id"])[:12])  # type: ignore[arg-type]
    assert shown.returncode == 0, shown.stderr
    line = next((x for x in shown.stdout.splitlines() if x.startswith("prefill by prompt length")), None)
    assert line is not None, shown.stdout
    assert re.fullmatch(r"prefill by prompt length \(measured, -ub \d+\): (\d+: \d+(, )?)+ tok/s; a \d+-token prompt "
                        r"took \d+\.\d\d s", line), line


def test_flux_show_of_a_real_plan_fits_80_columns_with_its_numbers_whole(planned: dict[str, object]) -> None:
    records = Records.at(Path(str(planned["data"])))
    plan = records.get(PLAN, str(planned["id"]))
    out = io.StringIO()
    print_plan(plan, Console(file=out, width=80), trials=plan_trials(Path(str(planned["data"])), plan))
    text = out.getvalue()
    assert "…" not in text, text  # nothing cut to an ellipsis
    for s in plan.finalists:
        if s.workload_s is not None:
            assert f"{s.workload_s:.2f}" in text and f"{s.decode_tps or 0:.1f}" in text, (s, text)


def test_the_flow_run_ends_with_the_plan_id_in_its_state_and_its_log(planned: dict[str, object]) -> None:
    """`prefect deployment run --watch` streams the run's logs and its final state's name: the id is in both the
    run's last log line and its state message (the UI, `prefect flow-run inspect`)."""
    pid = str(planned["id"])
    assert re.search(rf"\bplan {pid}\b", str(planned["log"])), str(planned["log"])[-3000:]
    db = Path(str(planned["home"])) / "prefect" / "prefect.db"
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT s.name, s.message FROM flow_run f JOIN flow_run_state s ON f.state_id = s.id"
                            ).fetchall()
    assert rows == [("Completed", f"plan {pid}")], rows


def test_the_probe_recorded_the_machines_load_and_the_plan_says_whether_it_was_busy(
        planned: dict[str, object]) -> None:
    records = Records.at(Path(str(planned["data"])))
    hw = records.all(PROBE)[-1]
    assert hw.others_cpus is not None and hw.others_cpus >= 0 and hw.usable_cpus and hw.load_avg_1m is not None
    plan = records.get(PLAN, str(planned["id"]))
    busy = [n for n in plan.notes if n.startswith("made on a busy machine")]
    assert bool(busy) == taken_under_load(hw), (hw.others_cpus, plan.notes)
