"""llama-server drafting the ways Flux's worker does, with the pin's own drafters: a draft model's greedy tokens
(``--spec-type draft-simple``) and prompt lookup (``ngram-simple``). The drafted greedy text is the plain one,
and llama-server's timings count what was proposed and kept (the measure stage reads them)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from artifacts.drafting import Drafting
from artifacts.engine_params import EngineParams
from artifacts.engine_spec import EngineSpec
from artifacts.synth.draft import draft_twin
from engine_bridge.backend import llama_server_path
from engine_bridge.engines.process import EngineProcess
from engine_bridge.engines.spec import launch


def test_the_flags_say_the_same_drafting_as_the_worker_does(tmp_path: Path) -> None:
    spec = EngineSpec(name="llama-server", kind="llama-server", command=("llama-server",))
    cpu, gpu = EngineParams(n_ctx=512), EngineParams(n_ctx=512, n_gpu_layers=-1)
    draft = Drafting(kind="model", model=str(tmp_path / "d.gguf"), n_draft=5)
    argv = launch(spec, "m.gguf", cpu, 9000, draft)[0]
    tail = ["--spec-type", "draft-simple", "-md", str(tmp_path / "d.gguf"), "--spec-draft-n-max", "5",
            "--spec-draft-p-min", "0"]
    assert argv[-len(tail):] == tail, "every proposal kept whatever the draft's confidence, as the worker drafts"
    assert draft.server_args(gpu)[-2:] == ["-ngld", "all"], "the whole draft on the GPU when the model uses one"
    lookup = Drafting(kind="ngram", ngram=3, n_draft=4)
    assert lookup.server_args(cpu) == ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                       "--spec-ngram-simple-size-m", "4", "--spec-ngram-simple-min-hits", "1"]
    assert "--spec-type" not in launch(spec, "m.gguf", cpu, 9000, None)[0]


def test_llama_server_drafts_and_keeps_the_greedy_text(tiny_moe: Path, tmp_path: Path) -> None:
    exe = llama_server_path(Path.home() / ".cache" / "flux")
    if exe is None:
        pytest.skip("llama-server is not built: run scripts/build-backend.sh")
    spec = EngineSpec(name="llama-server", kind="llama-server", command=(str(exe),))
    params = EngineParams(n_ctx=512, n_threads=1, n_threads_batch=1)
    draft = draft_twin(tiny_moe, tmp_path / "draft.gguf", 1).path
    prompt = list(range(300, 330)) * 3  # a prompt that repeats itself: lookup finds its continuations
    got = {}
    for name, drafting in (("plain", None), ("model", Drafting(kind="model", model=str(draft))),
                           ("ngram", Drafting(kind="ngram"))):
        proc = EngineProcess(spec, str(tiny_moe), params, log_path=tmp_path / f"{name}.log", drafting=drafting)
        proc.start()
        try:
            r = httpx.post(f"{proc.base}/completion", json={"prompt": prompt, "n_predict": 48, "temperature": 0,
                                                           "ignore_eos": True, "cache_prompt": False}, timeout=60)
            got[name] = r.json()
        finally:
            proc.stop()
    assert got["plain"]["timings"]["predicted_n"] == 48 and not got["plain"]["timings"].get("draft_n")
    for name in ("model", "ngram"):
        t = got[name]["timings"]
        assert got[name]["content"] == got["plain"]["content"], name
        assert t["draft_n"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"], (name, t)
    # the 1-layer draft of this twin agrees with it at every step measured here (37 of 37 kept)
    assert got["model"]["timings"]["draft_n_accepted"] / got["model"]["timings"]["draft_n"] >= 0.5
