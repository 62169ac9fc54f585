"""`flux bench ablate`: which variants a plan has, and a real race of them on a tiny twin."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from bench_support import bench_settings, make_plan, session_cache

from artifacts.engine_params import EngineParams, TensorOverride
from artifacts.records.search import Candidate, Placement
from tasks.bench.ablate import EXPERTS_ON_CPU, NO_SPEC, OTHER, VARIANTS, AblateOptions, bench_ablate, variants
from tasks.bench.context import open_bench
from tasks.bench.engines import llama_cpp_python_defaults
from tasks.bench.record import save_run


def _cand(params: EngineParams, experts: list[dict[str, str]] | None = None) -> Candidate:
    return Candidate(id="c1", family="test", placement=Placement(layer_device=["CPU"] * 4, expert_device=experts or []),
                     params=params, weights_bytes={}, kv_bytes={}, compute_bytes={})


def test_a_plan_with_default_choices_has_nothing_to_undo() -> None:
    plan = llama_cpp_python_defaults(EngineParams(n_ctx=1024), cpu_count=4)
    found = variants(_cand(plan), cpu_count=4)
    assert set(found) == set(VARIANTS)
    assert all(isinstance(v, str) and v.startswith("not chosen by the plan") for v in found.values())


def test_each_variant_undoes_exactly_one_choice() -> None:
    plan = EngineParams(n_ctx=1024, n_batch=256, n_ubatch=128, n_threads=3, n_threads_batch=3, flash_attn=True,
                        load_mode="load", no_host=True, offload_kqv=False, offload_min_batch=64, n_gpu_layers=99,
                        tensor_overrides=(TensorOverride(pattern=r"blk\.[0-1]\.ffn_.*_exps", device="CPU"),))
    experts = [{"gate": "CUDA0", "up": "CUDA0", "down": "CPU"}] * 4
    found = variants(_cand(plan, experts), cpu_count=4)
    assert all(isinstance(v, EngineParams) for v in found.values()), found
    changed = {name: {k for k, v in p.model_dump().items() if v != plan.model_dump()[k]}
               for name, p in found.items() if isinstance(p, EngineParams)}
    assert changed == {
        "default-threads": {"n_threads", "n_threads_batch"}, "ubatch-512": {"n_ubatch", "n_batch"},
        "flash-attn-default": {"flash_attn"}, "load-mmap": {"load_mode"}, "host-pinned": {"no_host"},
        "kv-offload-default": {"offload_kqv"},
        "offload-threshold-default": {"offload_min_batch"}, "experts-on-cpu": {"tensor_overrides"}}
    ex = found["experts-on-cpu"]
    assert isinstance(ex, EngineParams) and ex.tensor_overrides == (EXPERTS_ON_CPU,)
    ub = found["ubatch-512"]
    assert isinstance(ub, EngineParams) and (ub.n_ubatch, ub.n_batch) == (512, 512)


def test_a_choice_that_cannot_be_undone_says_why() -> None:
    plan = EngineParams(n_ctx=1024, flash_attn=True, type_k="q8_0", type_v="q8_0", n_threads=2, n_threads_batch=4)
    why = variants(_cand(plan), cpu_count=4)["flash-attn-default"]
    assert isinstance(why, str) and "needs flash attention" in why


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> dict[str, Any]:
    """A plan that chose flash attention and n_ubatch 128, ablated in 2 paired rounds."""
    import os

    st, _ = bench_settings(tmp_path_factory.mktemp("bench-ablate"), session_cache(tmp_path_factory))
    cpus = os.cpu_count() or 1
    params = EngineParams(n_ctx=512, n_batch=256, n_ubatch=128, n_threads=max(cpus // 2, 1), n_threads_batch=cpus,
                          flash_attn=True)
    plan = make_plan(st, tiny_moe, params=params)
    ctx = open_bench(st, plan.id[:12])
    run = bench_ablate(ctx, AblateOptions(rounds=2, prompts=1, n_gen=6))
    save_run(run)
    rows = ctx.store.query(f"SELECT * FROM bench_summary WHERE run_id = '{run.run_id}'").to_pylist()
    return {"rows": {r["baseline"]: r for r in rows}, "raw": ctx.store.get_table("bench_ablate_raw", run.run_id).to_pylist()}


def test_ablation_races_only_the_choices_the_plan_made(stored: dict[str, Any]) -> None:
    rows = stored["rows"]
    assert set(rows) == {*VARIANTS, OTHER, NO_SPEC}
    assert rows.pop(NO_SPEC)["detail"] == "not chosen by the plan (it does not draft)"
    other = rows.pop(OTHER)  # the plan's placement on llama-server, where the backend built it
    if other["ratio_decode"] is None:
        assert other["detail"] == "not measured: llama-server is not built for this backend"
    else:
        assert json.loads(other["metrics"])["changed"] == "engine worker -> llama-server"
    measured = {n for n, r in rows.items() if r["ratio_decode"] is not None}
    assert measured == {"flash-attn-default", "ubatch-512"}
    for name in set(VARIANTS) - measured:
        assert rows[name]["verdict"] == "info" and rows[name]["detail"].startswith("not chosen by the plan")
    for name in measured:
        r = rows[name]
        assert r["ci_low"] <= r["ratio_decode"] <= r["ci_high"] and r["n_samples"] == 2
        assert r["verdict"] in ("info", "fail")
        assert json.loads(r["metrics"])["changed"] == {"flash-attn-default": "flash_attn True -> False",
                                                       "ubatch-512": "n_batch 256 -> 512, n_ubatch 128 -> 512"}[name]
    engines = {r["engine"] for r in stored["raw"]}
    assert engines - {OTHER} == {"plan", "flash-attn-default", "ubatch-512"}
    assert not [r for r in stored["raw"] if r["error"]]


def test_a_drafting_plan_races_its_placement_without_drafting(tmp_path_factory: pytest.TempPathFactory,
                                                              tiny_moe: Path) -> None:
    from artifacts.drafting import Drafting

    st, _ = bench_settings(tmp_path_factory.mktemp("bench-ablate-spec"), session_cache(tmp_path_factory))
    params = EngineParams(n_ctx=512, n_batch=512, n_ubatch=512, n_threads=1, n_threads_batch=1)
    base = make_plan(st, tiny_moe, params=params)
    plan = make_plan(st, tiny_moe, params=params, candidate=base.candidate.model_copy(
        update={"id": "c000+ngram", "draft": Drafting(kind="ngram")}).model_dump())
    ctx = open_bench(st, plan.id[:12])
    run = bench_ablate(ctx, AblateOptions(rounds=2, prompts=1, n_gen=32))
    rows = {r.baseline: r for r in run.rows}
    row = rows[NO_SPEC]
    assert row.ratio_decode is not None and row.n_samples == 2, row
    assert row.metrics["changed"] == "drafting ngram -> none"
    assert not [r for r in run.raw.to_pylist() if r["error"]]


def test_a_llama_server_plan_races_drafting_as_it_serves(tmp_path_factory: pytest.TempPathFactory,
                                                         tiny_moe: Path) -> None:
    """A plan won by llama-server drafting with a draft model is raced as it is served: llama-server with the
    pin's drafter; `no-speculation` is llama-server without it, `other-engine` the native worker drafting alike."""
    from artifacts.drafting import Drafting
    from artifacts.engine_spec import EngineSpec as ServedBy
    from artifacts.synth.draft import draft_twin
    from engine_bridge.backend import llama_server_path
    from tasks.bench.engines import no_drafting, other_engine, plan_engine

    exe = llama_server_path(Path.home() / ".cache" / "flux")
    if exe is None:
        pytest.skip("llama-server is not built: run scripts/build-backend.sh")
    d = tmp_path_factory.mktemp("bench-ablate-server-spec")
    st, _ = bench_settings(d, session_cache(tmp_path_factory))
    draft = Drafting(kind="model", model=str(draft_twin(tiny_moe, d / "draft.gguf", 1).path))
    params = EngineParams(n_ctx=512, n_batch=512, n_ubatch=512, n_threads=1, n_threads_batch=1)
    base = make_plan(st, tiny_moe, params=params)
    plan = make_plan(st, tiny_moe, params=params, engine=ServedBy(name="llama-server", kind="llama-server",
                                                                 command=(str(exe),)).model_dump(),
                     candidate=base.candidate.model_copy(update={"id": "c000@llama-server+draft", "draft": draft,
                                                                 "engine": "llama-server"}).model_dump())
    ctx = open_bench(st, plan.id[:12])
    served, plain, other = plan_engine(ctx), no_drafting(ctx, NO_SPEC), other_engine(ctx)
    assert served.kind == plain.kind == "llama-server" and other.kind == "worker"
    assert "-md" in served.args and "--spec-type" not in plain.args and other.draft == draft
    run = bench_ablate(ctx, AblateOptions(rounds=2, prompts=1, n_gen=32))
    row = {r.baseline: r for r in run.rows}[NO_SPEC]
    assert row.ratio_decode is not None and row.n_samples == 2, row
    assert row.metrics["changed"] == "drafting model -> none"
    assert not [r for r in run.raw.to_pylist() if r["error"]]
