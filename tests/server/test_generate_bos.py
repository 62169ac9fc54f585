"""`flux generate` tokenizes a prompt as `flux serve`'s `/v1/completions` does: BOS first where the model's
vocabulary adds it (`tokenizer.ggml.add_bos_token`), none where it does not."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from gguf_edit import edited_gguf
from support import ServeEnv, start_server, stop_server

from artifacts.gguf_header import read_header
from artifacts.records.plan import Plan

PROMPT_LINE = re.compile(r"prompt (\d+) tokens \(([\d, .]+)\)")


@pytest.mark.parametrize("add_bos", [True, False])
def test_generate_s_prompt_is_the_server_s(add_bos: bool, flux: Any, senv: ServeEnv, tiny_moe: Path,
                                           plan_maker: Callable[..., Plan], tmp_path: Path) -> None:
    model = edited_gguf(tiny_moe, tmp_path / "twin.gguf", bools={"tokenizer.ggml.add_bos_token": add_bos})
    bos = read_header(model).metadata["tokenizer.ggml.bos_token_id"]
    out = flux("generate", str(model), "--prompt", "Hello", "-n", "4")
    assert out.returncode == 0, out.stderr
    found = PROMPT_LINE.search(out.stdout)
    assert found, out.stdout
    n, ids = int(found.group(1)), [int(x) for x in found.group(2).split(", ") if x != "..."]
    assert (ids[0] == bos) is add_bos, ids
    srv = start_server(senv, plan_maker(senv.settings, model).id)
    try:
        r = httpx.post(f"{srv.base}/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == n, "the same prompt tokens as the server's"
    finally:
        stop_server(srv)
