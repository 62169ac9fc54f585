"""`flux plan`'s flags are PlanRequest's fields: real argparse parsing, one checking place, one-line errors."""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field

from artifacts.config import Settings, load_settings
from artifacts.records.keys import plan_key
from artifacts.records.plan import PlanRequest
from flows.cli import OneLineParser, build_parser
from flows.request import BadPlanFlag, check_for_model, flow_params, plan_request
from flows.request_flags import add_plan_flags, flag_fields, request_from_args
from tasks.errors import ImpossiblePlan
from tasks.testing import h200_report

# every flag `flux plan --help` listed when its flags were written by hand: none may go missing or be renamed
FLAGS = ["--ctx", "--concurrency", "--serving-p95-ms", "--kv", "--budget-s", "--gpu-mem-budget", "--allow-storage-streaming",
         "--workload", "--host-mem-budget", "--rpc", "--rpc-mem-budget", "--engines", "--prefer-engine", "--speculation",
         "--draft-model", "--heads", "--routing-from", "--domains", "--replan",
         "--reprobe", "--seed"]


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    cfg = tmp_path / "flux.toml"
    cfg.write_text("[plan]\ntuning_budget_s = 42.0\nfinalists = 2\nrepeats = 5\n")
    return load_settings({"FLUX_CONFIG": str(cfg), "HOME": str(tmp_path)})


def plan_parser() -> argparse.ArgumentParser:
    """The `flux plan` subparser of the real `flux` parser."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["plan"]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["plan", *argv])


def test_the_flags_are_the_ones_flux_plan_always_had() -> None:
    p = plan_parser()
    options = [s for a in p._actions for s in a.option_strings if s != "-h" and s != "--help"]
    assert options == FLAGS
    assert [a.dest for a in p._actions if not a.option_strings] == ["model"]
    assert list(flag_fields()) == ["model", "ctx", "concurrency", "serving_p95_ms", "kv", "budget_s", "gpu_mem_budget_gib",
                                   "allow_storage_streaming", "workload", "host_mem_budget_gib", "rpc",
                                   "rpc_mem_budget_gib", "engines", "prefer_engine", "speculation", "draft_model", "heads",
                                   "routing_from", "domains", "replan",
                                   "reprobe", "seed"]


def test_help_comes_from_the_field_descriptions() -> None:
    text = " ".join(plan_parser().format_help().split())
    for name in ("model", "ctx", "kv", "budget_s", "gpu_mem_budget_gib", "workload", "replan"):
        assert " ".join(str(PlanRequest.model_fields[name].description).split()) in text, name
    assert "--kv {f32,f16,bf16,q8_0,q5_1,q5_0,q4_1,q4_0,iq4_nl}" in text
    assert "--gpu-mem-budget GPU_MEM_BUDGET" in text and "--budget-s BUDGET_S" in text
    assert "--finalists" not in text and "--repeats" not in text  # [plan] settings, not flags


def test_parsed_flags_become_the_request(settings: Settings, tmp_path: Path) -> None:
    args = parse(str(tmp_path / "m.gguf"), "--ctx", "512", "--kv", "q8_0", "--gpu-mem-budget", "12,24",
                 "--allow-storage-streaming", "--workload", "chat", "--replan", "--seed", "7")
    req = request_from_args(settings, args, Path(args.model))
    assert req.model == str(tmp_path / "m.gguf")
    assert (req.ctx, req.kv, req.gpu_mem_budget_gib, req.workload, req.seed) == (512, "q8_0", [12.0, 24.0], "chat", 7)
    assert req.allow_storage_streaming and req.replan and not req.reprobe
    assert (req.budget_s, req.finalists, req.repeats) == (42.0, 2, 5)  # left out: the [plan] settings
    assert request_from_args(settings, parse("m.gguf", "--budget-s", "9"), Path("m.gguf")).budget_s == 9.0


def test_left_out_flags_keep_the_request_and_its_serialized_form(settings: Settings) -> None:
    req = request_from_args(settings, parse("m.gguf"), Path("m.gguf"))
    want = PlanRequest(model=str(Path("m.gguf").resolve()), budget_s=42.0, finalists=2, repeats=5)
    assert req == want
    assert set(req.model_dump()) == {"model", "ctx", "concurrency", "kv", "budget_s", "gpu_mem_budget_gib",
                                     "allow_storage_streaming", "workload", "finalists", "repeats", "seed",
                                     "host_mem_budget_gib", "rpc", "rpc_mem_budget_gib", "engines", "prefer_engine",
                                     "speculation", "draft_model", "heads", "routing_from", "domains",
                                     "serving_p95_ms"}
    # every flag is in the plan key, at its default too (the planner's code id is in the key: no plan saved by
    # another planner could match, so no field is left out for one)
    key = plan_key("h", h200_report(), "b", req, {})
    assert key["flags"] == req.model_dump(exclude={"model"})
    assert PlanRequest(model="m", replan=True, reprobe=True).model_dump() == PlanRequest(model="m").model_dump()


def test_a_new_field_is_a_new_flag(settings: Settings) -> None:
    class Wider(PlanRequest):
        draft_tokens: int = Field(4, ge=1, description="tokens the draft model proposes per step",
                                  json_schema_extra={"short": "-d"})
        sampler: Literal["greedy", "top-k"] = Field("greedy", description="how the draft is sampled")
        warm_cache: bool = Field(True, description="keep the prompt cache between rounds")

    p = OneLineParser(prog="flux plan")
    add_plan_flags(p, Wider)
    text = " ".join(p.format_help().split())
    assert "-d DRAFT_TOKENS, --draft-tokens DRAFT_TOKENS tokens the draft model proposes per step" in text
    assert "--sampler {greedy,top-k}" in text and "--no-warm-cache" in text
    args = p.parse_args(["m.gguf", "-d", "8", "--sampler", "top-k", "--no-warm-cache", "--ctx", "64"])
    req = request_from_args(settings, args, Path(args.model), Wider)
    assert isinstance(req, Wider)
    assert (req.draft_tokens, req.sampler, req.warm_cache, req.ctx) == (8, "top-k", False, 64)
    with pytest.raises(BadPlanFlag, match=r"^--draft-tokens 0: input should be greater than or equal to 1"):
        request_from_args(settings, p.parse_args(["m.gguf", "-d", "0"]), Path("m.gguf"), Wider)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--kv", "q9_9"], "argument --kv: invalid choice: 'q9_9'"), (["--seed", "x"], "argument --seed: invalid int"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_a_flag_argparse_refuses_exits_2_with_one_line(argv: list[str], needle: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        parse("m.gguf", *argv)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "--help`" in lines[0], lines


@pytest.mark.parametrize(("argv", "line"), [
    (["--concurrency", "0"], "--concurrency 0: input should be greater than or equal to 1; see `flux plan --help`"),
    (["--budget-s", "-3"], "--budget-s -3.0: input should be greater than 0; see `flux plan --help`"),
    (["--gpu-mem-budget", "12,x"], "--gpu-mem-budget '12,x': expected GiB per GPU, e.g. 12 or 12,24"),
    (["--gpu-mem-budget", "12,-1"], "--gpu-mem-budget 12,-1: a GPU's budget is 0 GiB or more (0: leave that GPU out); "
                                    "see `flux plan --help`"),
])
def test_a_value_the_request_refuses_is_one_line_naming_the_flag(settings: Settings, argv: list[str],
                                                                 line: str) -> None:
    with pytest.raises(BadPlanFlag) as err:
        request_from_args(settings, parse("m.gguf", *argv), Path("m.gguf"))
    assert str(err.value) == line


def test_a_bad_value_exits_2_with_one_line(flux) -> None:
    got = flux("plan", "no-such-model.gguf", "--concurrency", "300")
    assert got.returncode == 2, got.stderr
    lines = [x for x in got.stderr.strip().splitlines() if x.strip()]
    assert lines == ["error: --concurrency 300: input should be less than or equal to 256; see `flux plan --help`"]


def test_the_flow_takes_the_flags_of_the_one_request(settings: Settings) -> None:
    from flows.plan_model import plan_model

    req = plan_request(settings, "m.gguf", ctx=512, gpu_mem_budget_gib="8", replan=True)
    params = flow_params(req)
    assert set(params) == set(inspect.signature(plan_model.fn).parameters), "a flag the flow cannot take"
    assert (params["ctx"], params["gpu_mem_budget_gib"], params["budget_s"], params["replan"]) == (512, [8.0], 42.0, True)
    assert plan_request(settings, params.pop("model"), **params) == req  # the flow rebuilds the same request


def test_context_beyond_the_trained_one_is_refused_before_planning(settings: Settings) -> None:
    req = plan_request(settings, "m.gguf", ctx=8192)
    check_for_model(req, 8192)
    check_for_model(req, None)
    with pytest.raises(ImpossiblePlan, match="--ctx 8192 exceeds the model's trained context 4096; use --ctx 4096"):
        check_for_model(req, 4096)
