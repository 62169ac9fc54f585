"""One SamplingParams: every knob it declares reaches each place a request's sampling goes, found by introspection
of its fields (a new knob is its field and its stage in the worker's sampler chain: nothing else to edit).

- the OpenAI request schemas take it by its name, with its range and default (``server.schemas.Sampling``), and
  their OpenAPI document says so;
- the ``generate`` op carries it whole, and the defaults are one set (the request's, the op's, the declaration's);
- an engine other than the worker gets it as the request field of its name (``engines.host.request_body``);
- the worker's sampler chain reads it (``worker.sampling.build_chain``, with llama.cpp's real samplers);
- the typed clients yield a generation's events typed, its result last.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from artifacts.engine_params import EngineParams
from artifacts.engine_spec import EngineKind, EngineSpec
from engine_bridge import ops
from engine_bridge.aclient import AsyncWorkerClient
from engine_bridge.client import WorkerClient
from engine_bridge.engines.host import request_body
from engine_bridge.sampling import GREEDY, SamplingParams
from server.openapi import body_schema
from server.schemas import ChatRequest, CompletionRequest, parse_body

KNOBS = tuple(SamplingParams.model_fields)
REQUESTS: dict[type[ChatRequest] | type[CompletionRequest], dict[str, Any]] = {
    ChatRequest: {"messages": [{"role": "user", "content": "hi"}]}, CompletionRequest: {"prompt": "hi"}}
PARAMS = EngineParams(n_ctx=256, n_seq_max=1, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1)


def _changed(name: str) -> Any:
    """A valid value of knob ``name`` other than its default."""
    f = SamplingParams.model_fields[name]
    d = f.default if f.default is not None else 0
    for candidate in (d / 2, d + 1, 1, 0.5):
        try:
            got = getattr(SamplingParams.model_validate({name: type(d)(candidate)}), name)
        except ValidationError:
            continue
        if got != f.default:
            return got
    raise AssertionError(f"no value of {name} other than its default")


CHANGED = SamplingParams(**{k: _changed(k) for k in KNOBS})


def test_every_knob_has_a_value_other_than_its_default() -> None:
    assert all(getattr(CHANGED, k) != f.default for k, f in SamplingParams.model_fields.items())
    assert CHANGED.temperature > 0, "the sampler test below reads every stage of a sampled (not greedy) chain"


@pytest.mark.parametrize("model", list(REQUESTS))
def test_the_request_schemas_take_every_knob(model: type[ChatRequest] | type[CompletionRequest]) -> None:
    base = REQUESTS[model]
    for name in KNOBS:
        ours, theirs = model.model_fields[name], SamplingParams.model_fields[name]
        assert (ours.default, ours.metadata) == (theirs.default, theirs.metadata), f"{name}: the declaration's"
    sent = parse_body(json.dumps({**base, **CHANGED.model_dump()}).encode(), model)
    assert sent.sampling() == CHANGED and type(sent.sampling()) is SamplingParams
    nulls = parse_body(json.dumps({**base, **dict.fromkeys(KNOBS)}).encode(), model)
    assert nulls.sampling() == parse_body(json.dumps(base).encode(), model).sampling() == SamplingParams()
    jsonschema = pytest.importorskip("jsonschema")
    schema = body_schema(model)  # the OpenAPI document says so too
    for body in ({**base, **CHANGED.model_dump()}, {**base, **dict.fromkeys(KNOBS)}):
        jsonschema.validate(body, schema)


def test_one_set_of_defaults() -> None:
    chat = parse_body(json.dumps(REQUESTS[ChatRequest]).encode(), ChatRequest)
    op = ops.GenerateArgs(rid="r", prompt=[1], max_tokens=1)
    assert chat.sampling() == op.sampling == SamplingParams()
    assert (SamplingParams().temperature, SamplingParams().top_k, SamplingParams().top_p, SamplingParams().min_p) \
        == (0.8, 40, 0.95, 0.05), "llama-server's defaults (docs/serving.md)"
    wire = ops.GenerateArgs(rid="r", prompt=[1], max_tokens=1, sampling=CHANGED).model_dump(mode="json")
    assert ops.GenerateArgs.model_validate(wire).sampling == CHANGED and set(wire["sampling"]) == set(KNOBS)


def test_an_engine_gets_every_knob_by_its_name() -> None:
    args = ops.GenerateArgs(rid="r", prompt=[1, 2], max_tokens=4, sampling=CHANGED)
    kinds: tuple[EngineKind, ...] = ("llama-server", "command")
    for kind in kinds:
        body = request_body(EngineSpec(name="e", kind=kind), args)
        assert {k: body[k] for k in KNOBS} == CHANGED.model_dump()
    body = request_body(EngineSpec(name="e", kind="llama-server"), ops.GenerateArgs(rid="r", prompt=[1], max_tokens=1))
    assert "seed" not in body and body["top_k"] == 40, "a knob at its default is sent too; a random seed is not"


def test_the_worker_sampler_reads_every_knob() -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")
    from engine_bridge.worker.sampling import build_chain

    read: set[str] = set()

    class Reads(SamplingParams):
        def __getattribute__(self, name: str) -> Any:
            if name in KNOBS:
                read.add(name)
            return super().__getattribute__(name)

    knobs = Reads(**CHANGED.model_dump())
    read.clear()
    chain = build_chain(knobs, 64, 16)
    try:
        assert read == set(KNOBS), f"declared but not applied by the worker: {sorted(set(KNOBS) - read)}"
        assert llama_cpp.llama_sampler_chain_n(chain) == 6, "penalties, top-k, top-p, min-p, temperature, draw"
    finally:
        llama_cpp.llama_sampler_free(chain)


def test_greedy_is_temperature_zero_with_nothing_moving_logits() -> None:
    assert GREEDY.greedy() and SamplingParams(temperature=0.0, top_k=0, seed=3).greedy()
    assert not SamplingParams().greedy() and not SamplingParams(temperature=0.0, presence_penalty=0.5).greedy()


def test_the_clients_yield_typed_events(tmp_path: Path, tiny_dense: Path) -> None:
    pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")
    load = ops.ServeLoadArgs(model=str(tiny_dense), params=PARAMS)
    with WorkerClient(tmp_path / "w.log") as w:
        w.request(ops.SERVE_LOAD, load)
        prompt = w.tokenize("Hello there")
        sync = list(w.generate(ops.GenerateArgs(rid="s", prompt=prompt, max_tokens=5, sampling=GREEDY, progress=True)))

    async def main() -> list[ops.GenerateEvent]:
        async with AsyncWorkerClient(tmp_path / "a.log") as aw:
            await aw.request(ops.SERVE_LOAD, load)
            args = ops.GenerateArgs.model_construct(rid="a", prompt=prompt, max_tokens=5, sampling=GREEDY)
            return [ev async for ev in aw.generate(args)]

    for events in (sync, asyncio.run(main())):
        last = events[-1]
        assert last["type"] == "result" and isinstance(last["result"], ops.GenerateResult)
        tokens = [ev for ev in events if ev["type"] == "token"]
        assert last["result"].completion_tokens == len(tokens) > 0 and last["result"].prompt_tokens == len(prompt)
        assert all(ev["type"] != "result" for ev in events[:-1])
    assert [ev["token"] for ev in sync if ev["type"] == "token"] == [
        ev["token"] for ev in asyncio.run(main()) if ev["type"] == "token"], "greedy: the same tokens"
