"""The engine declarations: command templates, the launch of a placement on llama-server, the registry's refusals,
the finalists on each engine and the plan key of a request that leaves --engines at its default."""

from __future__ import annotations

from pathlib import Path

import pytest

from artifacts.config import EngineSettings
from artifacts.engine_params import EngineParams, ExpertSplit
from artifacts.engine_spec import EngineSpec
from artifacts.records.plan import PlanRequest
from engine_bridge.engines.registry import EngineRefused, resolve
from engine_bridge.engines.spec import BadEngineTemplate, check_template, launch


@pytest.mark.parametrize(("command", "says"), [
    (["vllm", "serve", "{model}", "--port", "{port}", "--gpu", "{gpu}"], "unknown template field(s) {gpu}"),
    (["vllm", "--port", "{0}"], "unknown template field(s) {0}"),
    (["vllm", "--port", "{port:d}"], "write fields as"),
    (["vllm", "--port", "{port"], "{port"),
    (["vllm", "{model}"], "does not name {port}"),
    ([], "empty"),
])
def test_a_bad_template_is_refused_in_words(command: list[str], says: str) -> None:
    with pytest.raises(BadEngineTemplate) as err:
        check_template(command)
    assert says in str(err.value)


def test_a_template_gets_port_model_and_ctx() -> None:
    spec = EngineSpec(name="mine", kind="command", command=("srv", "-m", "{model}", "--port={port}", "-c", "{ctx}"))
    argv, env = launch(spec, "/m.gguf", EngineParams(n_ctx=2048), 9000)
    assert argv == ["srv", "-m", "/m.gguf", "--port=9000", "-c", "2048"] and env == {}


def test_llama_server_gets_the_placement_its_slots_and_the_expert_split() -> None:
    split = ExpertSplit.on("CUDA0", {1: [0, 3]})
    params = EngineParams(n_ctx=1024, n_seq_max=4, flash_attn=True, load_mode="load", expert_split=split)
    spec = EngineSpec(name="llama-server", kind="llama-server", command=("/bin/llama-server",))
    argv, env = launch(spec, "/m.gguf", params, 9001)
    assert argv[:3] == ["/bin/llama-server", "-m", "/m.gguf"]
    assert argv[argv.index("-c") + 1] == "4096" and argv[argv.index("-np") + 1] == "4"
    assert argv[argv.index("-lm") + 1] == "none" and "--no-mmap" not in argv
    assert argv[argv.index("--port") + 1] == "9001" and env["FLUX_MOE_SPLIT"] == split.env_value()


def test_the_registry_resolves_and_refuses(tmp_path: Path) -> None:
    conf = {"mine": EngineSettings(command=["srv", "--port", "{port}"], grammar=True)}
    specs = resolve(["native", "llama-server", "mine"], conf, tmp_path / "llama-server")
    assert [s.kind for s in specs] == ["native", "llama-server", "command"] and specs[2].grammar
    for names, conf_, says in ((["native", "native"], conf, "named twice"), (["vllm"], conf, "not a known engine"),
                               (["llama-server"], conf, "not built"),
                               (["bad"], {"bad": EngineSettings(command=["x", "{port}", "{host}"])}, "{host}")):
        with pytest.raises(EngineRefused) as err:
            resolve(names, conf_, None)
        assert says in str(err.value)


def test_the_engines_measured_are_part_of_the_plan_key() -> None:
    from artifacts.records.hardware import HardwareReport
    from artifacts.records.keys import plan_key

    req = PlanRequest(model="/m.gguf")
    flags = req.model_dump(exclude={"model"})
    assert flags["engines"] == ["native"] and flags["prefer_engine"] is None
    hw = HardwareReport.model_construct(fingerprint="f", driver=None, ggml_devices=[])
    key = plan_key("h", hw, "b", req, {})
    assert key["flags"]["engines"] == ["native"] and key["flags"]["prefer_engine"] is None
    other = plan_key("h", hw, "b", req.model_copy(update={"engines": ["native", "llama-server"]}), {})
    assert other["flags"]["engines"] == ["native", "llama-server"]


def test_a_configured_engines_template_is_part_of_the_plan_key(tmp_path: Path, tiny_moe: Path) -> None:
    """A plan measured on ``[engines.mine]`` is valid for that command only: another template is another plan;
    without a configured engine the key's settings are as before."""
    import dataclasses

    from bench_support import bench_settings

    from flows import stages

    st, _ = bench_settings(tmp_path / "s", tmp_path / "c")
    ctx = stages.context(PlanRequest(model=str(tiny_moe)), st)
    assert "engines" not in ctx.settings_view()
    specs = resolve(["native", "mine"], {"mine": EngineSettings(command=["srv", "--port", "{port}"])}, None)
    mine = dataclasses.replace(ctx, engines=tuple(specs))
    other = dataclasses.replace(ctx, engines=tuple(resolve(["native", "mine"], {"mine": EngineSettings(
        command=["srv", "--port", "{port}", "--fast"])}, None)))
    assert mine.settings_view()["engines"][0]["command"] == ["srv", "--port", "{port}"]
    assert mine.settings_view() != other.settings_view()
