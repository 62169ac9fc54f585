"""`flux show` names the chat template `flux serve` would render the plan's chats with."""

from __future__ import annotations

import io
from pathlib import Path

from gguf_edit import edited_gguf
from rich.console import Console

from artifacts.config import load_settings
from artifacts.engine_params import EngineParams
from artifacts.synth import synthesize
from flows.show import print_plan
from tasks.testing import stored_plan


def _shown(model: Path, tmp_path: Path) -> str:
    settings = load_settings({"XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                              "HOME": str(tmp_path)})
    out = io.StringIO()
    print_plan(stored_plan(settings, model, EngineParams(n_ctx=256, n_batch=64, n_ubatch=64)),
               Console(file=out, width=400))
    return next(x for x in out.getvalue().splitlines() if x.startswith("chat template:"))


def test_show_names_the_gguf_s_template_or_the_family_s(tiny_moe: Path, tmp_path: Path) -> None:
    assert _shown(tiny_moe, tmp_path / "own") == "chat template: the GGUF's own (tokenizer.chat_template)"
    twin = tmp_path / "tiny-gemma3.gguf"
    synthesize("tiny-gemma3", twin, quant="Q4_0")
    plain = edited_gguf(twin, tmp_path / "plain.gguf", drop=("tokenizer.chat_template",))
    assert _shown(plain, tmp_path / "plain") == ("chat template: gemma: llama.cpp's built-in, the gemma3 "
                                                 "architecture's (the GGUF has none)")
