"""Bad GGUFs of the hybrid families: a missing or mis-shaped tensor, a missing or unknown field. Each is refused in
one line that names the tensor or field, exit 2, by `flux inspect` and by `flux plan` before anything is planned;
the loader's own checks are what find them (a load that reads no weights)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest

from artifacts.errors import ModelFileError
from artifacts.model_info import model_info
from artifacts.synth import synthesize
from engine_bridge.structure import check_structure
from engine_bridge.worker.load import load_problem

Edit = Callable[[str, Any], Any]  # (key or tensor name, value or data) -> the new one, or None to leave it out


def rewrite(src: Path, dst: Path, *, keys: Edit | None = None, tensors: Edit | None = None,
            add: dict[str, str] | None = None) -> Path:
    """A copy of ``src`` with some metadata or tensors left out or changed (as a broken converter would)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        v = keys(k, f.contents()) if keys else f.contents()
        if v is None:
            continue
        kind = f.types[0]
        w.add_key_value(k, v, kind, sub_type=f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for k, text in (add or {}).items():
        w.add_string(k, text)
    for t in r.tensors:
        data = tensors(t.name, t.data) if tensors else t.data
        if data is not None:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module", params=["tiny-qwen3next", "tiny-qwen35moe"])
def twin(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch = {"tiny-qwen3next": "qwen3next", "tiny-qwen35moe": "qwen35moe"}[request.param]
    return arch, synthesize(request.param, tmp_path_factory.mktemp(request.param) / "m.gguf").path


def test_the_loaders_reason_without_its_prefixes() -> None:
    lines = ["llama_model_load: error loading model: check_tensor_dims: tensor 'blk.1.ssm_a' not found",
             "llama_model_load_from_file_impl: failed to load model"]
    assert load_problem(lines) == "tensor 'blk.1.ssm_a' not found"
    hp = "llama_model_load: error loading model: error loading model hyperparameters: key not found in model: x.y"
    assert load_problem([hp]) == "key not found in model: x.y"
    assert load_problem(["llama_model_load_from_file_impl: failed to load model"]) is None


def test_a_whole_twin_passes(twin: tuple[str, Path], tmp_path: Path) -> None:
    check_structure(twin[1], tmp_path / "w.log")  # no error


def test_a_missing_recurrent_tensor_is_named(twin: tuple[str, Path], tmp_path: Path) -> None:
    bad = rewrite(twin[1], tmp_path / "b.gguf", tensors=lambda n, d: None if n == "blk.1.ssm_a" else d)
    with pytest.raises(ModelFileError, match=r"llama.cpp cannot load it: tensor 'blk.1.ssm_a' not found; .*convert"):
        check_structure(bad, tmp_path / "w.log")


def test_a_field_that_reshapes_a_tensor_is_named_with_both_shapes(twin: tuple[str, Path], tmp_path: Path) -> None:
    arch, path = twin
    bad = rewrite(path, tmp_path / "b.gguf", keys=lambda k, v: 0 if k == f"{arch}.ssm.conv_kernel" else v)
    with pytest.raises(ModelFileError, match=r"tensor 'blk.0.ssm_conv1d.weight' has wrong shape; expected 0, \d+, got "):
        check_structure(bad, tmp_path / "w.log")


def test_a_missing_ssm_field_is_named(twin: tuple[str, Path], tmp_path: Path) -> None:
    arch, path = twin
    bad = rewrite(path, tmp_path / "b.gguf", keys=lambda k, v: None if k == f"{arch}.ssm.state_size" else v)
    with pytest.raises(ModelFileError, match=rf"key not found in model: {arch}.ssm.state_size"):
        check_structure(bad, tmp_path / "w.log")


def test_an_unknown_rope_scaling_type_is_named_from_the_header(twin: tuple[str, Path], tmp_path: Path) -> None:
    arch, path = twin
    bad = rewrite(path, tmp_path / "b.gguf", add={f"{arch}.rope.scaling.type": "sideways"})
    with pytest.raises(ModelFileError, match=rf"{arch}.rope.scaling.type is 'sideways', which llama.cpp does not know"):
        model_info(bad)


def test_a_crash_in_the_loader_is_a_refusal_with_its_assertion(twin: tuple[str, Path], tmp_path: Path) -> None:
    # what the loader does with a rope scaling type it does not know, past Flux's header check: it asserts
    bad = rewrite(twin[1], tmp_path / "b.gguf", add={f"{twin[0]}.rope.scaling.type": "sideways"})
    with pytest.raises(ModelFileError, match=r"llama.cpp stopped reading .*GGML_ASSERT\(hparams.rope_scaling_type_train"):
        check_structure(bad, tmp_path / "w.log")


def test_flux_inspect_and_plan_refuse_in_one_line(flux: Any, tmp_path: Path) -> None:
    path = synthesize("tiny-qwen3next", tmp_path / "m.gguf").path
    bad = rewrite(path, tmp_path / "bad.gguf", tensors=lambda n, d: None if n == "blk.2.ssm_out.weight" else d)
    for args in (("inspect", str(bad)), ("plan", str(bad), "--budget-s", "30")):
        got = flux(*args)
        assert got.returncode == 2, (args, got.stdout, got.stderr)
        last = got.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and "tensor 'blk.2.ssm_out.weight' not found" in last, got.stderr
    plans = flux("plans")
    assert plans.returncode == 0 and "bad.gguf" not in plans.stdout, "nothing was planned"


def test_a_minicpm_twin_missing_a_tensor_is_named(tmp_path: Path) -> None:
    path = synthesize("tiny-minicpm", tmp_path / "m.gguf").path
    check_structure(path, tmp_path / "w.log")
    bad = rewrite(path, tmp_path / "b.gguf", tensors=lambda n, d: None if n == "blk.1.ffn_up.weight" else d)
    with pytest.raises(ModelFileError, match=r"tensor 'blk.1.ffn_up.weight' not found"):
        check_structure(bad, tmp_path / "w.log")


def test_a_split_model_is_checked_whole_from_its_first_shard(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("split_helper", Path(__file__).parents[1] / "artifacts" /
                                                  "test_model_info.py")
    assert spec is not None and spec.loader is not None
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)  # gguf-split's layout, written by the model-info tests' helper
    write_split = helper.write_split

    path = synthesize("tiny-moe", tmp_path / "m.gguf").path
    shards = write_split(path, tmp_path, 3)
    check_structure(shards[0], tmp_path / "w.log")  # llama.cpp reads the other shards' tensors too
    shards[2].write_bytes(shards[2].read_bytes()[:64])  # a shard cut short: its tensors are not there
    with pytest.raises(ModelFileError, match="llama.cpp"):
        check_structure(shards[0], tmp_path / "w.log")


def test_a_check_that_cannot_run_refuses_nothing(tmp_path: Path) -> None:
    """A worker that does not answer in time (here: no time at all) is not the model's fault: the check is
    skipped with a warning (no refusal, though the file is bad), and planning meets the file in its own loads."""
    import logging

    path = synthesize("tiny-moe", tmp_path / "m.gguf").path
    bad = rewrite(path, tmp_path / "b.gguf", tensors=lambda n, d: None if n == "blk.1.ffn_up_exps.weight" else d)
    lines: list[str] = []  # a handler of the test's own: the suite's logging setup may not propagate to caplog
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("engine_bridge.structure")
    logger.addHandler(handler)
    try:
        check_structure(bad, tmp_path / "w.log", timeout_s=1e-6)
    finally:
        logger.removeHandler(handler)
    assert len(lines) == 1 and "did not run" in lines[0] and "going on without it" in lines[0], lines
    with pytest.raises(ModelFileError, match="blk.1.ffn_up_exps.weight"):  # with time to run, it refuses
        check_structure(bad, tmp_path / "w.log")
