"""The runner of declared stages: a stage's result is stored under its key and reused; a stage's version is part
of its key only once bumped (a stage at version 1 keeps the key it always had)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
from bench_support import bench_settings, session_cache

from artifacts.ids import content_id
from artifacts.records.hardware import HardwareReport
from artifacts.records.kinds import PROBE
from artifacts.records.plan import PlanRequest
from flows import stages
from tasks.pipeline import PlanContext, Stage, existing_plan
from tasks.testing import h200_report

LOG = logging.getLogger("test")


@pytest.fixture
def ctx(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> PlanContext:
    st, _ = bench_settings(tmp_path_factory.mktemp("stages"), session_cache(tmp_path_factory))
    return stages.context(PlanRequest(model=str(tiny_moe)), st)


def _toy(runs: list[int], version: int = 1) -> Stage[HardwareReport]:
    def run(ctx: PlanContext, log: Any, n: int) -> HardwareReport:
        runs.append(n)
        return h200_report()

    return Stage(name="toy", version=version, result=HardwareReport, run=run, kind=PROBE,
                 key=lambda ctx, n: {"stage": "toy", "n": n, "code": ctx.code}, inputs=("n", "code"))


def test_a_stage_is_computed_once_then_reused_from_the_store(ctx: PlanContext) -> None:
    runs: list[int] = []
    first, message, computed = stages.compute(_toy(runs), ctx, LOG, 3)
    assert computed and "computed and stored" in str(message)
    again, message, computed = stages.compute(_toy(runs), ctx, LOG, 3)
    assert not computed and "reused from the store" in str(message) and again == first and runs == [3]
    stages.compute(_toy(runs), ctx, LOG, 4)
    assert runs == [3, 4], "another input is another key"


def test_a_bumped_version_is_a_new_key(ctx: PlanContext) -> None:
    runs: list[int] = []
    assert _toy(runs).key_of(ctx, 1) == {"stage": "toy", "n": 1, "code": ctx.code}
    assert content_id(_toy(runs, version=2).key_of(ctx, 1)) != content_id(_toy(runs).key_of(ctx, 1))
    stages.compute(_toy(runs), ctx, LOG, 1)
    stages.compute(_toy(runs, version=2), ctx, LOG, 1)
    assert runs == [1, 1], "version 2 does not find version 1's result"


def test_forcing_recomputes(ctx: PlanContext) -> None:
    runs: list[int] = []
    stages.compute(_toy(runs), ctx, LOG, 5)
    forced = dataclasses.replace(_toy(runs), force=lambda ctx: True)
    _, _, computed = stages.compute(forced, ctx, LOG, 5)
    assert computed and runs == [5, 5]


def test_no_plan_is_found_before_the_machine_is_probed(ctx: PlanContext) -> None:
    assert existing_plan(ctx) is None
