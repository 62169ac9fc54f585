"""Checks the family twins' tests share: a header's fields and tensor kinds per layer, and a real llama.cpp load."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader

# What llama.cpp prints about the memory it allocates (MiB, two decimals)
BUFFER = re.compile(r"CPU (KV|RS) buffer size =\s+([\d.]+) MiB")
_LOAD = """
import sys, llama_cpp
llama_cpp.Llama(sys.argv[1], n_ctx=256, n_threads=2, verbose=True, seed=0)
"""


def field(reader: GGUFReader, key: str) -> Any:
    """A GGUF field's value."""
    return reader.fields[key].contents()


def kinds_by_layer(names: list[str]) -> dict[int, set[str]]:
    """Layer -> the tensor kinds (name after ``blk.N.``) it holds."""
    kinds: dict[int, set[str]] = {}
    for name in names:
        m = re.match(r"blk\.(\d+)\.(.+)", name)
        if m:
            kinds.setdefault(int(m.group(1)), set()).add(m.group(2))
    return kinds


def greedy_twice(path: Path, arch: str) -> list[str]:
    """Load ``path`` in the real llama.cpp (its architecture must be ``arch``) and complete one prompt greedily
    twice, the state reset in between: the two texts."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=2, verbose=False, seed=0)
    assert llm.metadata["general.architecture"] == arch
    runs = []
    for _ in range(2):
        out = llm("The quick brown fox", max_tokens=6, temperature=0.0)
        assert isinstance(out, dict)  # not a stream
        assert out["usage"]["completion_tokens"] >= 1
        runs.append(out["choices"][0]["text"])
        llm.reset()  # the KV cache (and a hybrid's recurrent state) restarts
    return runs


def load_log(path: Path) -> str:
    """What llama.cpp prints (stderr) while it loads ``path`` with 256 cells of context."""
    pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")
    res = subprocess.run([sys.executable, "-c", _LOAD, str(path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stderr


def written_tiny_twin(preset: str, out: Path, quant: Any) -> GGUFReader:
    """Write ``preset`` as a CI twin (< 10 MB) and check its file has exactly the planned tensors, sizes and
    types, in order; its reader."""
    from artifacts.synth import PRESETS, plan_tensors, planned_bytes, synthesize

    result = synthesize(preset, out, quant=quant, seed=5)
    assert result.file_bytes == out.stat().st_size == planned_bytes(preset, quant) < 10_000_000
    reader = GGUFReader(result.path)
    assert [(t.name, tuple(int(d) for d in t.shape), t.tensor_type) for t in reader.tensors] == [
        (p.name, p.shape, p.ggml_type) for p in plan_tensors(PRESETS[preset], quant)
    ]
    return reader
