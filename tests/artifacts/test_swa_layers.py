"""Which layers attend to a sliding window, read from a header as the pinned llama.cpp's loaders decide
(src/models/<arch>.cpp: load_swa_pattern, llama_hparams::set_swa_pattern)."""

from __future__ import annotations

from typing import Any

import pytest

from artifacts.model_info import swa_layer_ids


@pytest.mark.parametrize(("arch", "md", "n_layer", "expected"), [
    # gemma3: a window only with sliding_window > 0; default pattern 6 (every sixth layer global)
    ("gemma3", {"sliding_window": 512}, 12, (512, [0, 1, 2, 3, 4, 6, 7, 8, 9, 10])),
    ("gemma3", {}, 12, (0, [])),
    ("gemma3", {"sliding_window": 0}, 12, (0, [])),
    # gemma2: always, 4096 without the key, pattern 2 (even layers local)
    ("gemma2", {}, 4, (4096, [0, 2])),
    ("gpt-oss", {"sliding_window": 128}, 4, (128, [0, 2])),
    # a scalar pattern in the header replaces the default; dense_first puts the global layer first
    ("gemma3", {"sliding_window": 512, "sliding_window_pattern": 2}, 4, (512, [0, 2])),
    ("cohere2moe", {"sliding_window": 4096}, 8, (4096, [1, 2, 3, 5, 6, 7])),
    # a per-layer array wins
    ("gemma3", {"sliding_window": 512, "sliding_window_pattern": [True, False, True]}, 3, (512, [0, 2])),
    ("step35", {"sliding_window": 512, "sliding_window_pattern": [False, True]}, 2, (512, [1])),
    ("step35", {"sliding_window": 512}, 2, (0, [])),  # the array is required: llama.cpp refuses the file
    # llama4: chunks of 8192 whatever the key says, unless it is 0
    ("llama4", {"sliding_window": 1000}, 4, (8192, [0, 1, 2])),
    ("llama4", {"sliding_window": 0}, 4, (0, [])),
    ("llama", {"sliding_window": 4096}, 4, (0, [])),  # no sliding-window type in llama's loader
])
def test_swa_layers_as_llama_cpp_decides(arch: str, md: dict[str, Any], n_layer: int,
                                         expected: tuple[int, list[int]]) -> None:
    header = {f"{arch}.attention.{k}": v for k, v in md.items()}
    assert swa_layer_ids(header, arch, n_layer) == expected
