"""Stored results keyed by the code that made them, exactly: each stage's key carries the hash of the sources its
result depends on (its declaring module and all it imports, and the worker modules it runs), and the plan key the
hash of all of them. Edits are made in a temporary copy of the sources, as an upgraded installation has them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from artifacts.code_id import ROOT, imported_modules, source_files
from artifacts.ids import content_id
from artifacts.records.keys import plan_key, probe_key
from artifacts.records.plan import PlanRequest
from tasks.pipeline import MEASURE, PROBE, PRUNE, STAGES, pipeline_code
from tasks.testing import h200_report


@pytest.fixture()
def copy(tmp_path: Path) -> Path:
    """A copy of Flux's packages, as an upgraded installation would have them."""
    for pkg in ("tasks", "engine_bridge", "flows", "artifacts", "server"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _edit(path: Path, text: str = "\n# an upgrade\n") -> None:
    path.write_text(path.read_text() + text)


def _codes(root: Path) -> dict[str, str]:
    return {s.name: s.code(root) for s in STAGES}


def test_the_copy_is_this_installations_code(copy: Path) -> None:
    assert _codes(copy) == _codes(ROOT)
    assert pipeline_code(copy) == pipeline_code()


@pytest.mark.parametrize("source", ["server/routes.py", "server/service.py", "engine_bridge/gbnf.py",
                                    "flows/show.py", "tasks/bench/run.py", "server/routing_watch.py"])
def test_a_serving_or_showing_edit_keeps_every_stored_probe_space_and_plan(copy: Path, source: str) -> None:
    before = _codes(copy)
    _edit(copy / source)
    assert _codes(copy) == before
    assert pipeline_code(copy) == pipeline_code()


def test_a_pruning_edit_is_new_finalists_and_plans_but_the_same_probe(copy: Path) -> None:
    before = _codes(copy)
    _edit(copy / "tasks/search/ranking.py")
    after = _codes(copy)
    changed = {name for name in before if before[name] != after[name]}
    assert "prune" in changed and "probe" not in changed and "route" not in changed
    assert pipeline_code(copy) != pipeline_code(), "the plan key carries every stage's code"


@pytest.mark.parametrize(("source", "stage"), [("engine_bridge/worker/native.py", "probe"),
                                               ("engine_bridge/worker/routing.py", "route"),
                                               ("engine_bridge/worker/serving.py", "measure"),
                                               ("tasks/costmodel.py", "prune"),
                                               ("artifacts/corpus_data/prompts.jsonl", "measure")])
def test_an_edit_of_what_a_stage_runs_is_a_new_key_for_it(copy: Path, source: str, stage: str) -> None:
    """The worker modules a stage names (it runs their ops in another process), its imports, and the data files
    they read."""
    before = _codes(copy)
    _edit(copy / source, "\n" if source.endswith(".jsonl") else "\n# an upgrade\n")
    assert _codes(copy)[stage] != before[stage]


def test_a_new_module_counts_once_a_stage_imports_it(copy: Path) -> None:
    before = PRUNE.code(copy)
    (copy / "tasks" / "new_rule.py").write_text("X = 1\n")
    assert PRUNE.code(copy) == before, "nothing imports it yet"
    _edit(copy / "tasks/search/ranking.py", "\nfrom tasks import new_rule  # noqa: F401\n")
    assert copy / "tasks/new_rule.py" in source_files(("tasks.search.ranking",), copy)
    assert PRUNE.code(copy) != before


def test_lazy_imports_count_but_the_worker_op_table_names_its_ops_only() -> None:
    handlers = imported_modules(ROOT / "engine_bridge/worker/handlers.py")
    assert "engine_bridge.worker.serving" not in handlers, "an op's module is imported inside the op: not followed"
    files = {p.relative_to(ROOT).as_posix() for p in source_files((MEASURE.run.__module__, *MEASURE.sources))}
    assert "engine_bridge/worker/serving.py" in files and not {f for f in files if f.startswith("server/")}
    probe = {p.relative_to(ROOT).as_posix() for p in source_files((PROBE.run.__module__, *PROBE.sources))}
    assert not {f for f in probe if f.startswith("server/") or f in ("engine_bridge/gbnf.py",
                                                                     "engine_bridge/worker/serving.py")}


def test_the_plan_key_and_the_probe_key_carry_the_code(copy: Path) -> None:
    from engine_bridge.machine_facts import machine_facts

    hw, req, facts = h200_report(1), PlanRequest(model="m"), machine_facts()
    old, old_probe = pipeline_code(copy), PROBE.code(copy)
    _edit(copy / "engine_bridge/worker/native.py")
    new, new_probe = pipeline_code(copy), PROBE.code(copy)
    assert content_id(plan_key("m", hw, "b", req, {}, code=old)) != content_id(plan_key("m", hw, "b", req, {}, code=new))
    assert content_id(probe_key(facts, "m", "b", old_probe)) != content_id(probe_key(facts, "m", "b", new_probe))
