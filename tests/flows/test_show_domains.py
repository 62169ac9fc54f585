"""`flux show` of a plan measured on a shifted domain mix (--domains TRACE:MEASURE): its GPU copies' share of the
picks on the measured traffic beside the trace's."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from artifacts.config import load_settings
from artifacts.engine_params import EngineParams
from artifacts.records.plan import PlanRequest
from flows.show import print_plan
from tasks.testing import stored_plan


def test_show_prints_the_shifted_share_beside_the_traced(tiny_moe: Path, tmp_path: Path) -> None:
    settings = load_settings({"XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                              "HOME": str(tmp_path)})
    params = EngineParams(n_ctx=256, n_batch=64, n_ubatch=64)
    request = PlanRequest(model=str(tiny_moe), domains="prose:chat").model_dump()
    for shift, want in (({"trace": 0.97, "measured": 0.63}, True), ({}, False)):
        plan = stored_plan(settings, tiny_moe, params, request=request, routing_shift=shift)
        out = io.StringIO()
        print_plan(plan, Console(file=out, width=400))
        line = ("GPU copies' share of the picks (--domains prose:chat): 97% on the traced traffic, 63% on the "
                "measured rounds'")
        assert (line in out.getvalue()) is want
        assert "prefill tokens; --domains prose:chat (the routing trace on the first, the measured rounds on the last)" \
            in out.getvalue()
