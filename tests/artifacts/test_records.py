"""The typed store: records put and read by their declared kind, prefixes resolved once, messages that say
what to do, and the same bytes and ids as an untyped write of the same model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from artifacts.engine_params import EngineParams
from artifacts.errors import NotFound, StoreError
from artifacts.ids import content_id
from artifacts.records.evidence import MeasureSummary, ValidationResult
from artifacts.records.kinds import KINDS, MODEL_PATH, PLAN, PROBE, ROUTING_PROFILE, declare
from artifacts.records.plan import ModelPath, Plan, PlanRequest, plan_id, seal
from artifacts.records.routing import RoutingProfile
from artifacts.records.search import Candidate, Placement, Prediction
from artifacts.records.store import Records
from artifacts.store import AmbiguousId, Store
from tasks.testing import h200_report


def _plan(model_path: str = "/models/m.gguf", **overrides: Any) -> Plan:
    """A sealed plan built by hand (no machine, no model file)."""
    params = EngineParams(n_ctx=512)
    cand = Candidate(id="c000", family="hand-built", placement=Placement(layer_device=["CPU"] * 2), params=params,
                     weights_bytes={"CPU": 1}, kv_bytes={"CPU": 1}, compute_bytes={"CPU": 1})
    measured = MeasureSummary(candidate_id="c000", prefill_tps=10.0, decode_tps=1.0, workload_s=1.0, n_trials=1)
    body: dict[str, Any] = {
        "key": {"model_hash": "m"}, "created_at": "2025-01-01T00:00:00+00:00", "model_path": model_path,
        "model_name": "m", "model_hash": "m", "hardware_fingerprint": "h", "backend_build": "b", "driver": None,
        "request": PlanRequest(model=model_path).model_dump(), "candidate": cand.model_dump(),
        "measured": measured.model_dump(),
        "predicted": Prediction(candidate_id="c000", prefill_tps=1.0, decode_tps=1.0, score_s=1.0).model_dump(),
        "validation": ValidationResult(candidate_id="c000", mean_kl=0.0, max_kl=0.0, top1_agreement=1.0, n_tokens=1,
                                       passed=True).model_dump(),
        "finalists": [measured.model_dump()], "predictions": [], "median_prediction_error": None,
        "roofline_decode_tps": None, "memory_budget": {"CPU": 1}, "trials_table": "none",
        "quality_profile": "reference", "workload_prefill_share": 0.5, **overrides,
    }
    return seal(body)


@pytest.fixture()
def records(tmp_path: Path) -> Records:
    return Records.at(tmp_path / "store")


def test_a_record_round_trips_as_its_model(records: Records) -> None:
    report = h200_report(2)
    oid = records.put(PROBE, report)
    assert oid == content_id(report)
    back = records.get(PROBE, oid)
    assert isinstance(back, type(report)) and back == report
    plan = _plan()
    assert records.put(PLAN, plan, key=plan.id) == plan.id
    assert records.get(PLAN, plan.id) == plan and records.find_by_prefix(PLAN, plan.id[:6]) == plan
    assert [p.id for p in records.all(PLAN)] == [plan.id] and records.has(PLAN, plan.id)


def test_a_record_is_stored_as_an_untyped_write_of_the_same_model(tmp_path: Path) -> None:
    """Stores written before the typed API read back, and write the same bytes under the same ids."""
    plan, seen = _plan(), ModelPath(model_hash="m", path="/models/m.gguf")
    old, new = Store(tmp_path / "old"), Records.at(tmp_path / "new")
    assert old.put_json("plan", plan, key=plan.id) == new.put(PLAN, plan, key=plan.id)
    assert old.put_json("model_path", {"model_hash": "m", "path": "/models/m.gguf"}) == new.put(MODEL_PATH, seen)
    for kind, oid in (("plan", plan.id), ("model_path", content_id(seen))):
        rel = Path("objects") / kind / f"{oid}.json"
        assert (old.data_dir / rel).read_bytes() == (new.store.data_dir / rel).read_bytes()
    assert Records(old).get(PLAN, plan.id) == plan


def test_a_plans_id_is_the_content_id_of_its_body() -> None:
    plan = _plan()
    stored = json.loads(json.dumps(plan.model_dump(mode="json")))
    assert plan_id(stored) == plan.id == content_id({k: v for k, v in stored.items() if k != "id"})
    assert seal(plan.model_dump(exclude={"id"})) == plan
    assert plan_id({**stored, "model_name": "edited"}) != plan.id


def test_a_record_of_another_model_is_refused(records: Records) -> None:
    with pytest.raises(StoreError, match="a plan record is a Plan, not a HardwareReport"):
        records.put(PLAN, h200_report(1))  # type: ignore[arg-type]


def test_an_ambiguous_prefix_lists_the_candidates(records: Records) -> None:
    plans = [_plan(model_path=f"/m{i}.gguf") for i in range(40)]  # two of them share their first character
    a, b = next((x, y) for i, x in enumerate(plans) for y in plans[i + 1:] if x.id[0] == y.id[0])
    for p in (a, b):
        records.put(PLAN, p, key=p.id)
    common = next(i for i in range(64) if a.id[i] != b.id[i])
    with pytest.raises(AmbiguousId) as info:
        records.find_by_prefix(PLAN, a.id[:common])
    assert info.value.candidates == sorted([a.id, b.id]) and "type more" in str(info.value)
    assert records.find_by_prefix(PLAN, a.id[:common + 1]) == a


def test_an_unknown_prefix_says_how_to_list_what_is_stored(records: Records) -> None:
    with pytest.raises(NotFound, match=r"no plan id starts with 'abc' in .*; `flux plans` lists them"):
        records.find_by_prefix(PLAN, "abc")
    with pytest.raises(NotFound, match=r"no routing_profile id starts with 'abc' .*`flux sql .*routing_profile"):
        records.find_by_prefix(ROUTING_PROFILE, "abc")
    with pytest.raises(NotFound):
        records.get(ROUTING_PROFILE, "abc")


def test_a_stored_record_that_is_not_its_model_is_a_one_line_store_error(records: Records) -> None:
    records.store.put_json("routing_profile", {"trace_id": "t", "n_tokens": "many"}, key="bad")
    with pytest.raises(StoreError, match=r"routing_profile bad in .* is not a RoutingProfile \(n_tokens: .*"
                                         r"another version of Flux or by hand"):
        records.get(ROUTING_PROFILE, "bad")


def test_the_check_sees_the_stored_json_before_it_is_parsed(records: Records) -> None:
    profile = RoutingProfile(trace_id="t", n_tokens=4, n_expert_used=1, counts=((1, 3),))
    oid = records.put(ROUTING_PROFILE, profile)
    seen: list[dict[str, Any]] = []
    assert records.find_by_prefix(ROUTING_PROFILE, oid[:8], check=seen.append) == profile
    assert seen == [json.loads(profile.model_dump_json())]


def test_every_kind_is_declared_once() -> None:
    assert {"plan", "probe", "routing_profile", "space", "finalists", "measured", "validation",
            "model_path"} <= KINDS.keys()
    assert all(k.name == name for name, k in KINDS.items())
    with pytest.raises(ValueError, match="declared twice"):
        declare("plan", Plan)
