"""Engine error codes are a closed set, each mapped to one HTTP answer, and a code the worker sends that is not
in the set arrives as "engine_error" with its name kept in the message."""

from __future__ import annotations

from typing import get_args

import pytest

from engine_bridge.errors import ENGINE_CODES, EngineCode, EngineError, WorkerDied, WorkerTimeout, from_wire
from server.errors import ENGINE_HTTP, from_engine


def test_every_engine_code_has_one_http_answer() -> None:
    assert set(ENGINE_HTTP) == set(get_args(EngineCode)) == ENGINE_CODES


@pytest.mark.parametrize(("exc", "status", "code"), [
    (EngineError("bad_request", "x"), 400, "invalid_value"),
    (EngineError("bad_grammar", "x"), 400, "invalid_value"),
    (EngineError("context_overflow", "x"), 400, "context_length_exceeded"),
    (EngineError("busy", "x"), 503, "busy"),
    (EngineError("not_loaded", "x"), 503, "not_loaded"),
    (WorkerDied(-9), 502, "worker_died"),
    (WorkerTimeout("generate", 5), 504, "worker_timeout"),
    (EngineError("decode_failed", "x"), 500, "decode_failed"),
    (EngineError("bad_params", "x"), 500, "bad_params"),
])
def test_each_answer(exc: EngineError, status: int, code: str) -> None:
    err = from_engine(exc)
    assert (err.status, err.code) == (status, code)
    assert err.body()["error"]["message"]


def test_a_code_from_the_wire() -> None:
    assert from_wire({"code": "context_overflow", "message": "too long"}).code == "context_overflow"
    odd = from_wire({"code": "gpu_on_fire", "message": "oops"})
    assert odd.code == "engine_error" and "worker code gpu_on_fire" in odd.message
    assert from_engine(odd).status == 500
    assert from_wire({}).code == "engine_error"
