"""A twin's tensor data: every tensor drawn and written, block tensors streamed from pools of random blocks.

:mod:`artifacts.synth` lays a twin out and writes its header; this writes what follows it.
"""

from __future__ import annotations

import io
from typing import BinaryIO, Protocol

import numpy as np
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q
from numpy.typing import NDArray

from artifacts.synth.blocks import BLOCK_MAKERS
from artifacts.synth.layout import PlannedTensor
from artifacts.synth.routing import RouterTransform

ALIGN = 32
_POOL_BYTES = 64 << 20  # random blocks per (type, std) pool
_CHUNK_BYTES = 16 << 20  # one write, taken from a random block offset of a pool
_CONST = {"ones": 1.0, "neg_ones": -1.0}  # constant f32 fills (norm weights; a delta-net's ssm_a)


class TensorEditor(Protocol):
    """A routing profile that writes structure into some drawn block tensors (the local and domains profiles)."""

    def claims(self, name: str) -> bool: ...

    def edit(self, t: PlannedTensor, data: NDArray[np.uint8]) -> None: ...


def padded(n: int) -> int:
    """``n`` rounded up to ALIGN: where the next tensor's data starts."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def write_all(f: BinaryIO | io.BytesIO, data: memoryview) -> None:
    """Write all of `data`: a raw (unbuffered) write may write less than asked."""
    while data:
        data = data[f.write(data) :]


def write_data(
    f: BinaryIO, plan: list[PlannedTensor], sizes: list[int], rng: np.random.Generator,
    router: RouterTransform | None, locality: TensorEditor | None = None,
) -> None:
    """Write every tensor's data, block tensors streamed from per-(type, std) random pools.

    ``router`` reshapes the drawn f32 tensors of a routing profile (router rows), after the same draw as a
    uniform twin's: the two twins differ only in those tensors. ``locality`` (the local and domains profiles) also
    writes its structure into the drawn blocks of the embedding and the attention tensors it claims.
    """
    need: dict[tuple[Q, float], int] = {}
    for t in plan:
        if t.fill == "blocks":
            need[(t.ggml_type, t.std)] = need.get((t.ggml_type, t.std), 0) + t.nbytes
    pools: dict[tuple[Q, float], NDArray[np.uint8]] = {}
    for t, size in zip(plan, sizes, strict=True):
        if t.fill == "blocks" and t.name == "output.weight":
            _stream_fresh(f, t, size, rng)
        elif t.fill == "blocks":
            key = (t.ggml_type, t.std)
            if key not in pools:
                block_bytes = GGML_QUANT_SIZES[t.ggml_type][1]
                n_blocks = max(1, min(_POOL_BYTES, need[key]) // block_bytes)
                pools[key] = BLOCK_MAKERS[t.ggml_type](n_blocks, t.std, rng).reshape(-1)
            if locality and locality.claims(t.name):
                drawn = io.BytesIO()
                _stream(drawn, pools[key], GGML_QUANT_SIZES[t.ggml_type][1], size, rng)
                blocks = np.frombuffer(drawn.getbuffer(), dtype=np.uint8).copy()
                locality.edit(t, blocks.reshape(int(np.prod(t.shape[1:])), -1))
                write_all(f, memoryview(blocks.tobytes()))
            else:
                _stream(f, pools[key], GGML_QUANT_SIZES[t.ggml_type][1], size, rng)
        elif t.fill == "pass_first":
            write_all(f, memoryview(pass_first(t).tobytes()))
        else:
            shape = t.shape[::-1]
            if t.fill == "normal":
                data = rng.normal(0.0, t.std, size=shape)
            else:
                data = np.full(shape, t.std if t.fill == "const" else _CONST[t.fill])
            if router is not None:
                data = router(t.name, data)
            write_all(f, memoryview(data.astype("<f4").tobytes()))
        write_all(f, memoryview(b"\0" * (padded(size) - size)))


def pass_first(t: PlannedTensor) -> NDArray[np.uint8]:
    """A projection that passes its first ``ne1`` inputs through (identity there, zero on the rest), encoded
    exactly in ``t``'s type: a next-token block's eh_proj that keeps the embedding half (synth_layout)."""
    n_in, n_out = t.shape[0], t.shape[1]
    m = np.zeros((n_out, n_in), dtype=np.float32)
    m[np.arange(n_out), np.arange(n_out)] = 1.0
    if t.ggml_type == Q.F16:
        return m.astype("<f2").view(np.uint8)
    return np.asarray(quants.quantize(m, t.ggml_type), dtype=np.uint8)


def _stream_fresh(f: BinaryIO, t: PlannedTensor, size: int, rng: np.random.Generator) -> None:
    """Write a tensor of freshly drawn blocks, no pool: every vocabulary row of the output layer differs.

    Pooled chunks drawn at random offsets can overlap, which repeats rows; two equal rows of the output
    layer are two tokens with exactly equal logits, and greedy decoding then breaks ties by index.
    """
    block_bytes = GGML_QUANT_SIZES[t.ggml_type][1]
    left = size // block_bytes
    chunk = max(1, _CHUNK_BYTES // block_bytes)
    while left:
        n = min(left, chunk)
        write_all(f, memoryview(BLOCK_MAKERS[t.ggml_type](n, t.std, rng).tobytes()))
        left -= n


def _stream(
    f: BinaryIO | io.BytesIO, pool: NDArray[np.uint8], block_bytes: int, size: int, rng: np.random.Generator
) -> None:
    """Write `size` bytes as chunks of whole blocks, each from a random block offset of the pool."""
    pool_blocks = pool.size // block_bytes
    chunk_blocks = max(1, min(_CHUNK_BYTES // block_bytes, pool_blocks))
    view = memoryview(pool)  # type: ignore[arg-type]  # a 1-D uint8 array exports the buffer protocol
    left = size // block_bytes
    while left:
        n = min(left, chunk_blocks)
        start = int(rng.integers(0, pool_blocks - n + 1)) * block_bytes
        write_all(f, view[start : start + n * block_bytes])
        left -= n
