"""Plans keyed by the code that made them: an edit of a planner source (in a temporary copy of the sources)
is a new code id, so a new key for every stage and plan; an edit of what only shows or serves plans is not."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from artifacts.code_id import ROOT, code_id, planner_code_id, planner_files
from artifacts.ids import content_id
from artifacts.records.keys import plan_key, probe_key
from artifacts.records.plan import PlanRequest
from tasks.testing import h200_report


@pytest.fixture()
def copy(tmp_path: Path) -> Path:
    """A copy of Flux's packages, as an upgraded installation would have them."""
    for pkg in ("tasks", "engine_bridge", "flows", "artifacts", "server"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _edit(path: Path) -> None:
    path.write_text(path.read_text() + "\n# an upgrade\n")


@pytest.mark.parametrize("source", ["tasks/enumerate.py", "tasks/costmodel.py", "engine_bridge/worker/load.py",
                                    "flows/stages.py", "tasks/workload.py", "artifacts/model_info.py"])
def test_editing_a_planner_source_is_a_new_code_id(copy: Path, source: str) -> None:
    before = planner_code_id(copy)
    assert before == code_id()  # the copy is this installation's code
    _edit(copy / source)
    assert planner_code_id(copy) != before


@pytest.mark.parametrize("source", ["server/routes.py", "flows/show.py", "tasks/bench/run.py"])
def test_editing_what_only_shows_serves_or_benches_keeps_every_plan(copy: Path, source: str) -> None:
    before = planner_code_id(copy)
    _edit(copy / source)
    assert planner_code_id(copy) == before


def test_a_new_planner_file_counts(copy: Path) -> None:
    before = planner_code_id(copy)
    (copy / "tasks" / "new_stage.py").write_text("X = 1\n")
    assert planner_code_id(copy) != before
    assert any(p.name == "enumerate.py" for p in planner_files(copy))


def test_the_plan_key_and_the_probe_key_carry_the_code(copy: Path) -> None:
    from artifacts.records.machine import machine_facts

    hw, req, facts = h200_report(1), PlanRequest(model="m"), machine_facts()
    old = planner_code_id(copy)
    _edit(copy / "tasks" / "prune.py")
    new = planner_code_id(copy)
    assert content_id(plan_key("m", hw, "b", req, {}, code=old)) != content_id(plan_key("m", hw, "b", req, {}, code=new))
    assert content_id(probe_key(facts, "m", "b", old)) != content_id(probe_key(facts, "m", "b", new))
