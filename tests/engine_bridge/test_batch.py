"""The serving engine in-process: real llama.cpp batching several sequences in one context.

The model is tiny-dense with a larger attention-output scale (``attn_out_std``), so that its greedy
continuations depend on the context, not only on the last token: a wrong KV restore shows up as
different tokens. One thread: this 2-core box is shared and ggml's spinning thread pool stalls when a
core is taken away.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from artifacts.engine_params import EngineParams, TensorOverride
from artifacts.synth import synthesize
from engine_bridge.errors import EngineError
from engine_bridge.gbnf import GrammarBuilder, Trigger, schema_grammar
from engine_bridge.worker.native import NativeModel
from engine_bridge.worker.sampling import new_text_decoder
from engine_bridge.worker.serving import MIN_PARK_TOKENS, ServeEngine
from tests.engine_bridge.sinks import WHOLE_VOCABULARY, gen_args

PARAMS = EngineParams(n_ctx=512, n_seq_max=4, n_batch=128, n_ubatch=128, n_threads=1, n_threads_batch=1)
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly zebras".split()


@pytest.fixture(scope="module")
def ctx_model(models_dir: Path) -> Path:
    """tiny-dense whose attention matters (its continuations depend on the whole prompt)."""
    path = models_dir / "tiny-dense-attn.gguf"
    if not path.exists():
        synthesize("tiny-dense", path, quant="Q4_0", overrides={"attn_out_std": "0.1"})
    return path


class Recorder:
    """A Sink that keeps everything."""

    def __init__(self) -> None:
        self.events: dict[int, list[dict[str, Any]]] = {}
        self.results: dict[int, dict[str, Any]] = {}

    def event(self, key: int, event: dict[str, Any]) -> None:
        self.events.setdefault(key, []).append(event)

    def done(self, key: int, result: dict[str, Any]) -> None:
        self.results[key] = result

    def fail(self, key: int, code: str, message: str) -> None:
        self.results[key] = {"error": code, "message": message}

    def tokens(self, key: int) -> list[int]:
        return [e["token"] for e in self.events.get(key, []) if e["type"] == "token"]


def make(model: Path, **kw: Any) -> tuple[ServeEngine, Recorder]:
    rec = Recorder()
    park = kw.pop("park_bytes", 64 << 20)
    return ServeEngine(model, PARAMS.model_copy(update=kw), park, rec), rec


def text(i: int, n_words: int) -> str:
    rng = np.random.default_rng(i)
    return f"Story {i}: " + " ".join(rng.choice(WORDS, n_words)) + "."


def run(engine: ServeEngine, key: int, prompt: list[int], n: int = 24, **kw: Any) -> None:
    engine.submit(key, gen_args(f"r{key}", prompt, n, **kw))
    while engine.has_work():
        engine.step()


def test_batched_greedy_matches_each_alone(ctx_model: Path) -> None:
    engine, rec = make(ctx_model)
    prompts = [engine.vocab.tokenize(text(i, 10 + 7 * i)) for i in range(4)]
    alone = []
    for i, p in enumerate(prompts):
        solo, srec = make(ctx_model, n_seq_max=1)
        run(solo, i, p)
        alone.append(srec.tokens(i))
        solo.close()
    assert len({tuple(a) for a in alone}) > 1, "the model must be context-sensitive for this test to mean anything"
    for i, p in enumerate(prompts):
        engine.submit(i, gen_args(f"b{i}", p, 24))
    while engine.has_work():
        engine.step()
    assert [rec.tokens(i) for i in range(4)] == alone, "batched greedy decoding is exact on CPU"
    assert all(rec.results[i]["finish_reason"] == "length" for i in range(4))
    stats = engine.stats()
    assert stats["max_batch_seqs"] == 4 and stats["tokens_generated"] == 96 and stats["active"] == 0
    engine.close()


def test_long_prefill_is_chunked_while_others_keep_decoding(ctx_model: Path) -> None:
    engine, rec = make(ctx_model, n_seq_max=2, n_batch=64, n_ubatch=64)
    engine.submit(1, gen_args("a", engine.vocab.tokenize(text(8, 5)), 40))
    engine.step()
    assert len(rec.events[1]) == 1
    long_prompt = engine.vocab.tokenize(text(9, 100))
    assert len(long_prompt) > 5 * 64
    engine.submit(2, {"rid": "b", "prompt": long_prompt, "max_tokens": 4, "progress": True})
    steps = 0
    while not any(e["type"] == "token" for e in rec.events.get(2, [])):
        engine.step()
        steps += 1
        assert len(rec.events[1]) == 1 + steps, "the running request gets a token every step"
    assert steps == -(-len(long_prompt) // 63), "the prompt took the rest of n_batch each step"
    progress = [e for e in rec.events[2] if e["type"] == "prefill"]
    assert [e["done"] for e in progress] == [63 * (i + 1) for i in range(steps - 1)]
    assert all(e["total"] == len(long_prompt) for e in progress)
    engine.close()


def test_cancel_busy_and_refusals(ctx_model: Path) -> None:
    engine, rec = make(ctx_model, n_seq_max=2)
    p = engine.vocab.tokenize(text(1, 20))
    for k in (1, 2):
        engine.submit(k, {"rid": f"r{k}", "prompt": p, "max_tokens": 100})
    for _ in range(3):
        engine.step()
    with pytest.raises(EngineError) as busy:
        engine.submit(3, {"rid": "r3", "prompt": p, "max_tokens": 4})
    assert busy.value.code == "busy"
    assert engine.cancel("r1") and not engine.cancel("r1") and not engine.cancel("nope")
    assert rec.results[1]["finish_reason"] == "cancelled" and 1 <= rec.results[1]["completion_tokens"] < 100
    assert engine.stats()["active"] == 1
    engine.submit(3, {"rid": "r3", "prompt": p, "max_tokens": 4})  # the freed sequence is usable at once
    for code, bad in [("context_overflow", {"prompt": p, "max_tokens": 512}),
                      ("bad_request", {"prompt": [10**6], "max_tokens": 1}),
                      ("bad_request", {"prompt": p, "max_tokens": 1, "temprature": 0}),
                      ("bad_request", {"rid": "r2", "prompt": p, "max_tokens": 1})]:
        engine.cancel("r3")
        with pytest.raises(EngineError) as exc:
            engine.submit(9, {"rid": "x", **bad})
        assert exc.value.code == code, bad
    engine.close()


def test_text_pieces_are_valid_utf8_and_eog_stops(ctx_model: Path) -> None:
    engine, rec = make(ctx_model, n_seq_max=1)
    prompt = engine.vocab.tokenize(text(2, 12))
    for seed in range(6):  # hot sampling over a byte-level vocabulary: stray UTF-8 lead bytes, EOG tokens
        run(engine, seed, prompt, n=120, temperature=1.5, seed=seed, **WHOLE_VOCABULARY)
        events, result = rec.events.get(seed, []), rec.results[seed]
        pieces = b"".join(engine.vocab.piece(e["token"]) for e in events)
        streamed = "".join(e["text"] for e in events) + result["text_tail"]
        assert streamed.encode("utf-8").decode("utf-8") == pieces.decode("utf-8", errors="replace") == streamed
        assert result["completion_tokens"] == len(events) and not any(engine.vocab.is_eog(e["token"]) for e in events)
    everything = [e for k in rec.events for e in rec.events[k]]
    assert any(e["text"] == "" and engine.vocab.piece(e["token"]) for e in everything), "some bytes were held back"
    assert {r["finish_reason"] for r in rec.results.values()} == {"stop", "length"}
    # a multi-byte character split over byte tokens comes out whole, once its last byte arrives
    toks = engine.vocab.tokenize("héllo, 你好")
    dec = new_text_decoder()
    outs = [dec.decode(engine.vocab.piece(t)) for t in toks]
    assert "".join(outs) == "héllo, 你好" and "" in outs and all("\ufffd" not in o for o in outs)
    engine.close()


def test_seeded_sampling_is_reproducible(ctx_model: Path) -> None:
    engine, rec = make(ctx_model, n_seq_max=1)
    p = engine.vocab.tokenize(text(3, 15))
    for key, seed in [(1, 11), (2, 11), (3, 12)]:
        run(engine, key, p, n=16, temperature=1.0, top_k=40, top_p=0.95, min_p=0.01, seed=seed,
            presence_penalty=0.5, frequency_penalty=0.5)
    assert rec.tokens(1) == rec.tokens(2) != rec.tokens(3)
    engine.close()


def test_logprobs_match_log_softmax_of_logits(ctx_model: Path) -> None:
    engine, rec = make(ctx_model, n_seq_max=2)
    p = engine.vocab.tokenize(text(4, 20))
    run(engine, 1, p, n=6, logprobs=True, top_logprobs=5)
    events = rec.events[1]
    for e in events:
        top = e["top_logprobs"]
        assert len(top) == 5 and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["token"] == e["token"] and top[0]["logprob"] == e["logprob"] <= 0.0
        assert sum(np.exp(t["logprob"]) for t in top) <= 1.0 + 1e-9 and isinstance(top[0]["text"], str)
    native = NativeModel(ctx_model, EngineParams(n_ctx=512, n_batch=128, n_ubatch=128, n_threads=1, n_threads_batch=1))
    rows = native.logprobs(p, [e["token"] for e in events])
    native.close()
    want = rows[np.arange(len(events)), [e["token"] for e in events]]
    np.testing.assert_allclose([e["logprob"] for e in events], want, atol=1e-4)
    np.testing.assert_allclose(np.exp(rows).sum(axis=1), 1.0, rtol=1e-6)
    engine.close()


def test_logprobs_of_a_continuation_longer_than_a_batch_come_in_batches(ctx_model: Path) -> None:
    """A continuation of 3 batches' length at n_batch 4 (the split path's decode-sized batches on a GPU) gives
    the rows one 128-token batch gives."""
    native = NativeModel(ctx_model, EngineParams(n_ctx=512, n_batch=128, n_ubatch=128, n_threads=1, n_threads_batch=1))
    p = native.vocab.tokenize(text(5, 12))
    cont = native.vocab.tokenize(text(6, 4))[:11]
    whole = native.logprobs(p, cont)
    native.close()
    small = NativeModel(ctx_model, EngineParams(n_ctx=512, n_batch=4, n_ubatch=4, n_threads=1, n_threads_batch=1))
    got = small.logprobs(p, cont)
    small.close()
    assert got.shape == whole.shape == (11, whole.shape[1])
    np.testing.assert_allclose(got, whole, atol=2e-3)
    assert (got.argmax(axis=1) == whole.argmax(axis=1)).all()


def test_prefix_reuse(ctx_model: Path) -> None:
    engine, rec = make(ctx_model, n_seq_max=2)
    a = engine.vocab.tokenize(text(5, 40))
    run(engine, 1, a, n=8)
    assert rec.results[1]["cached_tokens"] == 0
    turn = a + rec.tokens(1) + engine.vocab.tokenize(" And then? ")
    run(engine, 2, turn, n=8)
    assert rec.results[2]["cached_tokens"] == len(a) + 8 - 1, "the reply's KV is reused too (all but its last token)"
    run(engine, 3, a + engine.vocab.tokenize(" A different ending."), n=8)
    assert rec.results[3]["cached_tokens"] >= len(a)
    assert engine.stats()["prefix_hits"] == 2
    engine.close()


def test_parked_conversation_restores_exactly(ctx_model: Path) -> None:
    engine, rec = make(ctx_model, n_ctx=2048, n_seq_max=1)
    a = engine.vocab.tokenize(text(6, 280))
    assert len(a) > 900
    b = engine.vocab.tokenize(text(7, 30))
    suffix = engine.vocab.tokenize(" What happened next?")
    run(engine, 1, a, n=4)
    run(engine, 2, b, n=4)  # B takes the only sequence: A is parked
    parked = engine.stats()["parked"]
    assert parked["count"] == 1 and 0 < parked["bytes"] <= parked["limit"]
    run(engine, 3, a + suffix, n=24, logprobs=True)
    assert rec.results[3]["cached_tokens"] >= len(a)
    assert engine.stats()["parked"]["hits"] == 1
    cold, crec = make(ctx_model, n_ctx=2048, n_seq_max=1)
    run(cold, 1, a + suffix, n=24, logprobs=True)
    assert crec.results[1]["cached_tokens"] == 0
    assert rec.tokens(3) == crec.tokens(1)
    np.testing.assert_allclose([e["logprob"] for e in rec.events[3]], [e["logprob"] for e in crec.events[1]],
                               atol=1e-5)
    run(cold, 2, b + suffix, n=24)
    assert rec.tokens(3) != crec.tokens(2), "another context gives other tokens: the comparison above has power"
    cold.close()
    engine.close()


def test_parking_is_bounded_and_restores_into_another_sequence(ctx_model: Path) -> None:
    probe, _ = make(ctx_model, n_ctx=1024, n_seq_max=1)
    convs = [probe.vocab.tokenize(text(10 + i, 100)) for i in range(4)]
    run(probe, 1, convs[0], n=2)
    one_state = probe.stats()["kv_bytes"]
    probe.close()
    engine, rec = make(ctx_model, n_ctx=1024, n_seq_max=2, park_bytes=int(1.5 * one_state))
    for key, conv in enumerate(convs[:3]):  # 0 and 1 fill the sequences, 2 parks 0 (the LRU one)
        run(engine, key, conv, n=2)
    assert engine.stats()["parked"]["count"] == 1
    run(engine, 3, convs[3], n=2)  # parks 1: over the limit, 0 is evicted
    parked = engine.stats()["parked"]
    assert parked["count"] == 1 and parked["evictions"] == 1 and parked["bytes"] <= parked["limit"]
    run(engine, 4, convs[1] + [5, 6, 7], n=2)  # restored into sequence 0; it was parked from sequence 1
    assert rec.results[4]["cached_tokens"] >= len(convs[1])
    assert engine.stats()["parked"]["hits"] == 1
    run(engine, 5, convs[0] + [5, 6, 7], n=2)
    assert rec.results[5]["cached_tokens"] < MIN_PARK_TOKENS, "evicted: prefilled again"
    engine.close()


def test_moe_with_tensor_overrides_serves_the_same_tokens(tiny_moe: Path) -> None:
    outs = []
    # no_host (--no-host) goes through the same load-call wrapper; without a GPU it changes no buffer
    cpu_experts = (TensorOverride(pattern=r"^blk\.(0|2)\.ffn_(gate|up)_exps\.", device="CPU"),)
    for overrides, no_host in [((), False), (cpu_experts, True)]:
        engine, rec = make(tiny_moe, n_seq_max=2, tensor_overrides=overrides, no_host=no_host)
        run(engine, 1, engine.vocab.tokenize(text(12, 20)), n=12)
        outs.append(rec.tokens(1))
        engine.close()
    assert outs[0] == outs[1] and len(outs[0]) > 0
    with pytest.raises(EngineError) as exc:
        make(tiny_moe, tensor_overrides=(TensorOverride(pattern="exps", device="CUDA7"),))
    assert exc.value.code == "bad_override"


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 0}},
           "required": ["city", "unit"], "additionalProperties": False}


def _reply(engine: ServeEngine, rec: Recorder, key: int) -> str:
    return "".join(e["text"] for e in rec.events.get(key, []) if e["type"] == "token") + \
        rec.results[key].get("text_tail", "")


def test_grammar_constrains_every_reply_to_the_schema(ctx_model: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    engine, rec = make(ctx_model)
    spec = schema_grammar(WEATHER).model_dump()
    prompt = engine.vocab.tokenize(text(3, 12))
    for seed in range(6):
        run(engine, seed, prompt, n=120, temperature=1.0, seed=seed, grammar=spec, **WHOLE_VOCABULARY)
        assert rec.results[seed]["finish_reason"] == "stop", "a complete value ends the reply"
        jsonschema.validate(json.loads(_reply(engine, rec, seed)), WEATHER)
    run(engine, 10, prompt, n=120, temperature=0.0, grammar=spec)
    jsonschema.validate(json.loads(_reply(engine, rec, 10)), WEATHER)
    engine.close()


def test_lazy_grammar_starts_at_its_trigger(ctx_model: Path) -> None:
    engine, rec = make(ctx_model)
    g = GrammarBuilder()
    body = g.schema("args", {"enum": [1, 2]})
    # the reply is free until "e" appears; from there it must be 1 or 2, then it ends
    spec = g.build(body, Trigger(words=["e"])).model_dump()
    prompt = engine.vocab.tokenize(text(4, 12))
    hits = 0
    for seed in range(8):
        run(engine, seed, prompt, n=60, temperature=1.0, seed=seed, grammar=spec, **WHOLE_VOCABULARY)
        out = _reply(engine, rec, seed)
        if "e" in out:
            hits += 1
            assert out[out.index("e"):] in ("e1", "e2") and rec.results[seed]["finish_reason"] == "stop", out
    assert hits, "some reply contained the trigger"
    engine.close()


def test_a_grammar_llama_cpp_refuses_is_a_typed_error(ctx_model: Path) -> None:
    engine, _ = make(ctx_model)
    with pytest.raises(EngineError) as exc:
        engine.submit(1, {"rid": "g", "prompt": [1, 2], "max_tokens": 4, "grammar": {"gbnf": "root ::= undefined-rule"}})
    assert exc.value.code == "bad_grammar" and not engine.has_work()
    engine.close()


def test_served_greedy_tokens_are_llama_cpps_greedy_samplers(ctx_model: Path) -> None:
    """Greedy requests take the logits' argmax instead of running llama.cpp's greedy sampler chain (which copies
    the vocabulary into candidates each token): the tokens are the chain's, step for step."""
    import llama_cpp

    from engine_bridge.sampling import GREEDY
    from engine_bridge.worker.sampling import build_chain

    engine, rec = make(ctx_model, n_seq_max=1)
    prompt = engine.vocab.tokenize(text(3, 12))
    run(engine, 1, prompt, n=32)
    engine.close()
    m = NativeModel(ctx_model, PARAMS.model_copy(update={"n_seq_max": 1}))
    chain = build_chain(GREEDY, m.n_vocab, 32)
    try:
        m._clear()
        m._decode(prompt, 0)
        chosen: list[int] = []
        for _ in range(32):
            tok = int(llama_cpp.llama_sampler_sample(chain, m.ctx, -1))
            chosen.append(tok)
            m._decode([tok], len(prompt) + len(chosen) - 1)
    finally:
        llama_cpp.llama_sampler_free(chain)
        m.close()
    assert rec.tokens(1) == chosen[:len(rec.tokens(1))] and len(rec.tokens(1)) >= 8


def test_a_prompt_that_keeps_most_of_a_sequence_trims_it_without_parking(ctx_model: Path) -> None:
    """The same prompt again computes its last token only, and one a few tokens longer computes those: the reply's
    tail is trimmed, never parked (parking copies the whole state on the way to the first token). A prompt that
    replaces the conversation still parks it, and a return to that conversation restores it exactly."""
    engine, rec = make(ctx_model, n_ctx=1024, n_seq_max=1)
    a = engine.vocab.tokenize(text(20, 120))
    b = engine.vocab.tokenize(text(21, 120))
    assert len(a) > 4 * MIN_PARK_TOKENS

    def prefilled(key: int, prompt: list[int], n: int = 2 * MIN_PARK_TOKENS) -> int:
        before = engine.stats()["prefill_tokens"]
        run(engine, key, prompt, n=n)
        assert rec.results[key]["prompt_tokens"] == len(prompt)
        return int(engine.stats()["prefill_tokens"] - before)

    assert prefilled(1, a) == len(a) and rec.results[1]["completion_tokens"] == 2 * MIN_PARK_TOKENS
    assert prefilled(2, a) == 1 and rec.results[2]["cached_tokens"] == len(a) - 1
    assert rec.tokens(2) == rec.tokens(1), "the cached prefix gives the same greedy reply"
    extra = [t for t in engine.vocab.tokenize(" and then?") if t != rec.tokens(2)[0]][:3]
    assert prefilled(3, a + extra) == len(extra) and rec.results[3]["cached_tokens"] == len(a)
    assert engine.stats()["parked"]["parked_total"] == 0, "a prompt that keeps most of the sequence parks nothing"
    assert prefilled(4, b) == len(b)
    assert engine.stats()["parked"]["parked_total"] == 1, "another conversation parks this one"
    assert prefilled(5, a, n=8) == 1 and rec.results[5]["cached_tokens"] == len(a) - 1
    assert engine.stats()["parked"]["hits"] == 1
    assert rec.tokens(5) == rec.tokens(1)[:8], "the restored state is the state that was parked"
    engine.close()


def test_another_conversation_sharing_a_long_prefix_still_parks_the_first(ctx_model: Path) -> None:
    """Two agents with one long system prompt: the second keeps most of the first's sequence but leaves its prompt,
    so the first is parked (not trimmed away), and its return restores it (into the empty sequence)."""
    engine, rec = make(ctx_model, n_ctx=1024, n_seq_max=2)
    shared = engine.vocab.tokenize(text(24, 150))
    a = shared + engine.vocab.tokenize(text(25, 40))
    b = shared + engine.vocab.tokenize(text(26, 40))
    assert len(shared) > 2 * (len(a) - len(shared)) > 4 * MIN_PARK_TOKENS
    run(engine, 1, a, n=8)
    run(engine, 2, b, n=8)
    assert rec.results[2]["cached_tokens"] >= len(shared) and engine.stats()["parked"]["parked_total"] == 1
    run(engine, 3, a, n=8)
    assert rec.results[3]["cached_tokens"] == len(a) - 1 and engine.stats()["parked"]["hits"] == 1
    assert rec.tokens(3) == rec.tokens(1)
    run(engine, 4, b, n=8)
    assert rec.results[4]["cached_tokens"] == len(b) - 1, "each conversation now has a sequence of its own"
    engine.close()


def test_a_parked_state_is_restored_only_when_it_saves_enough(ctx_model: Path) -> None:
    """A restore copies a whole state in: it must save MIN_PARK_TOKENS more than the sequence already holds, else
    the few tokens are computed. The lot knows what it holds, so nothing is copied out twice."""
    engine, rec = make(ctx_model, n_ctx=1024, n_seq_max=1)
    a = engine.vocab.tokenize(text(22, 120))
    b = engine.vocab.tokenize(text(23, 40))
    run(engine, 1, a, n=40)
    reply = rec.tokens(1)
    run(engine, 2, b, n=4)  # parks a + its reply
    y = [t for t in engine.vocab.tokenize(" Yes.") if t != reply[0]][:2]
    run(engine, 3, a + y, n=4)  # restored: it saves all of a
    assert engine.stats()["parked"]["hits"] == 1 and rec.results[3]["cached_tokens"] == len(a)
    before = engine.stats()["prefill_tokens"]
    run(engine, 4, a + reply[:5] + y, n=4)  # the parked state would save 5 tokens more than the sequence holds
    assert engine.stats()["parked"]["hits"] == 1, "not restored for 5 tokens"
    assert rec.results[4]["cached_tokens"] == len(a) and engine.stats()["prefill_tokens"] - before == 5 + len(y)
    engine.close()

    from engine_bridge.worker.parking import Parked, ParkingLot

    lot = ParkingLot(1 << 20)
    lot.put(Parked(tokens=np.arange(100, dtype=np.int32), data=bytes(64)))
    assert lot.covers(np.arange(60, dtype=np.int32)) and lot.covers(np.arange(100, dtype=np.int32))
    assert not lot.covers(np.arange(101, dtype=np.int32)) and not lot.covers(np.arange(1, 50, dtype=np.int32))
