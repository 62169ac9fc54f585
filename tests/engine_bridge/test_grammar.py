"""The grammar sampler's UTF-8 guard: what may start or continue text, stricter than CPython's incremental
decoder is about an unfinished character (it lets the first bytes of a surrogate or an over-long form by)."""

from __future__ import annotations

import pytest

from engine_bridge.worker.grammar import incomplete_tail, utf8_prefix_ok


@pytest.mark.parametrize(("data", "ok", "tail"), [
    (b"abc", True, b""), (b"a\xc3", True, b"\xc3"), (b"\xc3\xa9", True, b""),
    (b"\xed", True, b"\xed"), (b"\xed\x9f", True, b"\xed\x9f"),
    (b"\xed\xa8", False, None),  # a surrogate's first bytes
    (b"\xe0\x80", False, None),  # over-long
    (b"\xf4\x90", False, None),  # past U+10FFFF
    (b"\xf0\x9f\x98", True, b"\xf0\x9f\x98"), (b"\xf0\x9f\x98\x80", True, b""),
    (b"\x80", False, None), (b"\xc0", False, None), (b"\xf5", False, None), (b"\xc3a", False, None),
])
def test_utf8_prefixes(data: bytes, ok: bool, tail: bytes | None) -> None:
    assert utf8_prefix_ok(data) is ok
    assert incomplete_tail(data) == tail
