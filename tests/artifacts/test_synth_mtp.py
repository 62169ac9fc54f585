"""A qwen35moe twin with its next-token (MTP) block, as the converter writes Qwen3.5/3.6 without --no-mtp: the
trunk unchanged, the block after it, and llama-server drafting with it (the drafted greedy text is the plain one)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from gguf import GGUFReader
from twin_checks import field, greedy_twice, kinds_by_layer

from artifacts.drafting import Drafting
from artifacts.engine_params import EngineParams
from artifacts.engine_spec import EngineSpec
from artifacts.model_info import model_info
from artifacts.synth import synthesize
from engine_bridge.backend import llama_server_path
from engine_bridge.engines.process import EngineProcess
from engine_bridge.engines.spec import launch

TINY = "tiny-qwen35moe"
NEXTN = {"nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("mtp")
    return (synthesize(TINY, d / "trunk.gguf").path, synthesize(TINY, d / "mtp.gguf", overrides={"n_mtp": "1"}).path)


def test_the_block_follows_the_trunk_as_the_converter_writes_it(pair: tuple[Path, Path]) -> None:
    trunk, mtp = (GGUFReader(p) for p in pair)
    kinds = kinds_by_layer([t.name for t in mtp.tensors])
    assert sorted(kinds) == [0, 1, 2, 3, 4] and field(mtp, "qwen35moe.block_count") == 5
    assert field(mtp, "qwen35moe.nextn_predict_layers") == 1
    assert field(mtp, "qwen35moe.attention.recurrent_layers") == [True, True, True, False, False], "the block attends"
    assert NEXTN <= kinds[4] and {"attn_q.weight", "ffn_gate_exps.weight", "ffn_up_shexp.weight"} <= kinds[4]
    assert not kinds[4] & {"attn_qkv.weight", "ssm_a"}, "full attention, no delta-net"
    eh = next(t for t in mtp.tensors if t.name == "blk.4.nextn.eh_proj.weight")
    n_embd = field(mtp, "qwen35moe.embedding_length")
    assert [int(x) for x in eh.shape] == [2 * n_embd, n_embd], "[normed embedding; normed hidden] -> hidden"
    same = {t.name: bytes(t.data) for t in trunk.tensors}
    assert all(bytes(t.data) == same[t.name] for t in mtp.tensors if t.name in same), "the trunk's bytes are kept"
    info = model_info(pair[1])
    assert (info.n_layer, info.n_nextn_layers, len(info.layers)) == (4, 1, 4)
    assert info.n_kv_layers == model_info(pair[0]).n_kv_layers


def test_the_trunk_generates_as_without_the_block(pair: tuple[Path, Path]) -> None:
    assert greedy_twice(pair[1], "qwen35moe") == greedy_twice(pair[0], "qwen35moe")


def test_llama_server_drafts_with_the_block_and_keeps_the_greedy_text(pair: tuple[Path, Path],
                                                                     tmp_path: Path) -> None:
    """llama-server (--spec-type draft-mtp) with the twin's head: the greedy tokens are those without drafting,
    and the head's proposals are kept often (its eh_proj passes the chosen token's embedding, which the
    shallow trunk barely changes: measured here, 90% or more of the proposals on this twin)."""
    exe = llama_server_path(Path.home() / ".cache" / "flux")
    if exe is None:
        pytest.skip("llama-server is not built: run scripts/build-backend.sh")
    spec = EngineSpec(name="llama-server", kind="llama-server", command=(str(exe),))
    params = EngineParams(n_ctx=512, n_threads=1, n_threads_batch=1)
    mtp = Drafting(kind="mtp", n_draft=3)
    argv, _ = launch(spec, str(pair[1]), params, 9000, mtp)
    assert argv[-4:] == ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3"]
    prompt = list(range(300, 340))
    got = {}
    for name, drafting in (("plain", None), ("mtp", mtp)):
        proc = EngineProcess(spec, str(pair[1]), params, log_path=tmp_path / f"{name}.log", drafting=drafting)
        proc.start()
        try:  # llama-server's own endpoint: drafting, it streams no logprobs (so no token ids) on /v1
            r = httpx.post(f"{proc.base}/completion", json={"prompt": prompt, "n_predict": 48, "temperature": 0,
                                                           "ignore_eos": True, "cache_prompt": False}, timeout=60)
            got[name] = r.json()
        finally:
            proc.stop()
    assert got["mtp"]["content"] == got["plain"]["content"] and got["plain"]["timings"]["predicted_n"] == 48
    timings = got["mtp"]["timings"]
    assert not got["plain"]["timings"].get("draft_n")
    assert timings["draft_n"] > 0 and timings["draft_n_accepted"] / timings["draft_n"] >= 0.9, timings
