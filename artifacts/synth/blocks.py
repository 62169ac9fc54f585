"""Random quant blocks for synthetic twins: each type's blocks dequantize to zero-mean weights of a given std.

Random 4-bit blocks would have a nonzero mean, whose common component makes every token pick the same
experts; these makers centre every block (see :mod:`artifacts.synth`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType as Q
from numpy.typing import NDArray


def _random_bytes(rng: np.random.Generator, n: int) -> NDArray[np.uint8]:
    """n uniform random bytes; 64-bit draws are ~15x faster than rng.bytes."""
    words = rng.integers(0, np.iinfo(np.uint64).max, size=(n + 7) // 8, dtype=np.uint64, endpoint=True)
    return words.view(np.uint8)[:n]


def _f16(x: float) -> NDArray[np.uint8]:
    return np.frombuffer(np.float16(x).tobytes(), dtype=np.uint8)


def _scale(std: float, unit_std: float) -> float:
    """fp16 block scale d giving weights of `std`, kept to 7 significant bits so 7.5*d is exact in fp16."""
    mant, exp = np.frexp(std / unit_std)
    return float(np.ldexp(np.round(mant * 128) / 128, exp))


def _nibbles_around_8() -> NDArray[np.uint8]:
    """Byte -> byte with each nibble 0 made 8: nibbles are then symmetric around 8, so d*(q-8) is zero-mean."""
    byte = np.arange(256, dtype=np.uint16)
    lo, hi = byte & 0x0F, byte >> 4
    return (np.where(lo, lo, 8) | np.where(hi, hi, 8) << 4).astype(np.uint8)


_NIBBLES_AROUND_8 = _nibbles_around_8()  # a table lookup is ~2x faster than masking each nibble


def _q4_0(n: int, std: float, rng: np.random.Generator) -> NDArray[np.uint8]:
    # w = d * (q - 8); q in 1..15 with 8 twice as likely: var 17.5
    blocks = np.empty((n, 18), dtype=np.uint8)
    blocks[:, :2] = _f16(_scale(std, 17.5**0.5))
    blocks[:, 2:] = _NIBBLES_AROUND_8[_random_bytes(rng, n * 16).reshape(n, 16)]
    return blocks


def _q8_0(n: int, std: float, rng: np.random.Generator) -> NDArray[np.uint8]:
    # w = d * q; q in -127..127 with 0 twice as likely (-128 moved to 0): var 5397.5
    q = _random_bytes(rng, n * 32).view(np.int8).reshape(n, 32)
    q[q == -128] = 0
    blocks = np.empty((n, 34), dtype=np.uint8)
    blocks[:, :2] = _f16(_scale(std, 5397.5**0.5))
    blocks[:, 2:] = q.view(np.uint8)
    return blocks


def _q4_k(n: int, std: float, rng: np.random.Generator) -> NDArray[np.uint8]:
    # w = d*sc*q - dmin*m with every 6-bit (sc, m) = (1, 1) and dmin = 7.5 d: w = d * (q - 7.5), var 21.25
    d = _scale(std, 21.25**0.5)
    blocks = _random_bytes(rng, n * 144).reshape(n, 144)
    blocks[:, 0:2], blocks[:, 2:4] = _f16(d), _f16(7.5 * d)
    blocks[:, 4:12] = 1  # sc[0..3], m[0..3] low 6 bits; high bits of sc/m[4..7] zero
    blocks[:, 12:16] = 0x11  # low nibbles of sc[4..7] | m[4..7] << 4
    return blocks


def _q6_k(n: int, std: float, rng: np.random.Generator) -> NDArray[np.uint8]:
    # w = d * sc * (q - 32), q in 0..63 (mean -0.5); int8 scales alternate +1/-1 to cancel that mean
    blocks = _random_bytes(rng, n * 210).reshape(n, 210)
    blocks[:, 192:208] = np.array([1, 255] * 8, dtype=np.uint8)
    blocks[:, 208:210] = _f16(_scale(std, 341.25**0.5))
    return blocks


def _f16_blocks(n: int, std: float, rng: np.random.Generator) -> NDArray[np.uint8]:
    values = (rng.standard_normal(n, dtype=np.float32) * np.float32(std)).astype("<f2")
    return values.view(np.uint8).reshape(n, 2)


_Maker = Callable[[int, float, np.random.Generator], NDArray[np.uint8]]
BLOCK_MAKERS: dict[Q, _Maker] = {
    Q.Q4_0: _q4_0,
    Q.Q8_0: _q8_0,
    Q.Q4_K: _q4_k,
    Q.Q6_K: _q6_k,
    Q.F16: _f16_blocks,
}
