"""Next-token (MTP) heads in a file of their own (`flux synth --heads-of`), grafted by llama-server onto the model
converted without them (`-md heads.gguf --spec-type draft-mtp`): the drafted greedy text is the plain one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from gguf import GGUFReader
from twin_checks import field, kinds_by_layer

from artifacts.drafting import Drafting
from artifacts.engine_params import EngineParams
from artifacts.engine_spec import EngineSpec
from artifacts.synth import synthesize
from artifacts.synth.heads import heads_mismatch, heads_of
from engine_bridge.backend import llama_server_path
from engine_bridge.engines.process import EngineProcess
from engine_bridge.engines.spec import launch

TINY = "tiny-qwen35moe"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The trunk alone, the same model with its block, and the block alone written from the latter."""
    d = tmp_path_factory.mktemp("heads")
    trunk = synthesize(TINY, d / "trunk.gguf").path
    mtp = synthesize(TINY, d / "mtp.gguf", overrides={"n_mtp": "1"}).path
    return {"trunk": trunk, "mtp": mtp, "heads": heads_of(mtp, d / "heads.gguf").path}


def test_the_heads_file_holds_the_block_and_what_it_reads_and_no_trunk(twins: dict[str, Path]) -> None:
    heads, mtp = GGUFReader(twins["heads"]), GGUFReader(twins["mtp"])
    assert field(heads, "qwen35moe.block_count") == 5 and field(heads, "qwen35moe.nextn_predict_layers") == 1
    assert sorted(kinds_by_layer([t.name for t in heads.tensors])) == [4], "the block only, no layer of the trunk"
    outside = {t.name for t in heads.tensors if not t.name.startswith("blk.")}
    assert outside == {t.name for t in mtp.tensors if not t.name.startswith("blk.")} >= {"token_embd.weight",
                                                                                         "output_norm.weight"}
    same = {t.name: bytes(t.data) for t in mtp.tensors}
    assert all(bytes(t.data) == same[t.name] for t in heads.tensors), "the model's own bytes"
    assert twins["heads"].stat().st_size < twins["mtp"].stat().st_size / 2


def test_heads_that_do_not_fit_the_model_say_why(twins: dict[str, Path], tmp_path: Path) -> None:
    assert heads_mismatch(twins["trunk"], twins["heads"]) is None
    assert "has its own next-token block" in str(heads_mismatch(twins["mtp"], twins["heads"]))
    assert "holds no next-token (MTP) block" in str(heads_mismatch(twins["trunk"], twins["trunk"]))
    deeper = synthesize(TINY, tmp_path / "deep.gguf", overrides={"n_layer": "8"}).path
    assert "a trunk of 4 layers, the model has 8" in str(heads_mismatch(deeper, twins["heads"]))
    wider = synthesize(TINY, tmp_path / "wide.gguf", overrides={"n_embd": "128"}).path
    assert "its width (qwen35moe.embedding_length)" in str(heads_mismatch(wider, twins["heads"]))
    moe = synthesize("tiny-moe", tmp_path / "moe.gguf").path
    assert "its architecture is qwen35moe, the model's qwen3moe" in str(heads_mismatch(moe, twins["heads"]))
    with pytest.raises(ValueError, match="has no next-token"):
        heads_of(twins["trunk"], tmp_path / "none.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a model")
    assert "is not a readable GGUF" in str(heads_mismatch(twins["trunk"], tmp_path / "junk.gguf"))


def test_flux_synth_writes_the_heads_and_refuses_a_model_without_them(twins: dict[str, Path], tmp_path: Path) -> None:
    def synth(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "flows", "synth", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=120)

    ok = synth("--heads-of", str(twins["mtp"]), "-o", str(tmp_path / "h.gguf"))
    assert ok.returncode == 0 and "the next-token block of mtp.gguf (1 layer(s))" in ok.stdout, ok.stderr
    assert (tmp_path / "h.gguf").read_bytes() == twins["heads"].read_bytes()
    none = synth("--heads-of", str(twins["trunk"]), "-o", str(tmp_path / "n.gguf"))
    assert none.returncode == 2 and "has no next-token (MTP) block" in none.stderr
    assert len(none.stderr.strip().splitlines()) == 1


def test_llama_server_grafts_the_heads_and_keeps_the_greedy_text(twins: dict[str, Path], tmp_path: Path) -> None:
    """The trunk drafting with the grafted block proposes and keeps what the model with its own block does."""
    exe = llama_server_path(Path.home() / ".cache" / "flux")
    if exe is None:
        pytest.skip("llama-server is not built: run scripts/build-backend.sh")
    spec = EngineSpec(name="llama-server", kind="llama-server", command=(str(exe),))
    params = EngineParams(n_ctx=512, n_threads=1, n_threads_batch=1)
    grafted = Drafting(kind="mtp", n_draft=3, model=str(twins["heads"]))
    argv = launch(spec, str(twins["trunk"]), params, 9000, grafted)[0]
    assert argv[-6:] == ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3", "-md", str(twins["heads"])]
    assert grafted.server_args(params.model_copy(update={"n_gpu_layers": -1}))[-2:] == ["-ngld", "all"]
    got = {}
    for name, model, drafting in (("plain", twins["trunk"], None), ("own", twins["mtp"], Drafting(kind="mtp", n_draft=3)),
                                  ("grafted", twins["trunk"], grafted)):
        proc = EngineProcess(spec, str(model), params, log_path=tmp_path / f"{name}.log", drafting=drafting)
        proc.start()
        try:
            r = httpx.post(f"{proc.base}/completion", json={"prompt": list(range(300, 340)), "n_predict": 48,
                                                           "temperature": 0, "ignore_eos": True,
                                                           "cache_prompt": False}, timeout=60)
            got[name] = r.json()
        finally:
            proc.stop()
    assert got["grafted"]["content"] == got["own"]["content"] == got["plain"]["content"]
    own, grafted_t = got["own"]["timings"], got["grafted"]["timings"]
    assert grafted_t["draft_n"] == own["draft_n"] > 0 and grafted_t["draft_n_accepted"] == own["draft_n_accepted"]
