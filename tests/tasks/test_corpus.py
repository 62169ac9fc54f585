"""The bundled prompt corpus and agent conversations, and the loader around them."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from artifacts import corpus
from artifacts.corpus import Conversation, conversation_text, load_conversations, load_prompts, sized_prompts
from tasks import corpus_wikitext

# Length classes in estimated tokens (characters / 4) and the least number of prompts in each.
CLASSES = {(32, 128): 8, (128, 512): 10, (512, 1536): 10, (1536, 3000): 6, (3000, 10**9): 5}


def est_tokens(text: str) -> float:
    return len(text) / 4


def byte_tokenizer(s: str) -> list[int]:
    return list(s.encode())


def word_tokenizer(s: str) -> list[int]:
    return [len(w) for w in s.split()]


# -- prompts -----------------------------------------------------------------------------------------
def test_prompts_span_the_length_classes() -> None:
    prompts = load_prompts()
    assert len(prompts) >= 40
    for (lo, hi), least in CLASSES.items():
        in_class = [p for p in prompts if lo <= est_tokens(p.text) < hi]
        assert len(in_class) >= least, f"{lo}-{hi} tokens: {len(in_class)} prompts"
    assert min(est_tokens(p.text) for p in prompts) >= 32


def test_prompt_ids_unique_and_splits_spread() -> None:
    prompts = load_prompts()
    assert len({p.id for p in prompts}) == len(prompts)
    held = load_prompts("held_out")
    tune = load_prompts("tune")
    assert held and tune and len(held) + len(tune) == len(prompts)
    assert 0.15 <= len(held) / len(prompts) <= 0.35
    # held-out prompts exist among short and long prompts alike
    assert min(est_tokens(p.text) for p in held) < 512 < 3000 <= max(est_tokens(p.text) for p in held)


def test_prompt_kinds_are_varied() -> None:
    kinds = Counter(p.kind for p in load_prompts())
    assert set(kinds) == {"code", "prose", "log", "qa", "math", "config", "doc"}


def test_long_prompts_are_not_repeated_filler() -> None:
    for p in load_prompts():
        lines = [line for line in p.text.splitlines() if len(line) > 40]
        if len(lines) >= 20:
            assert len(set(lines)) / len(lines) > 0.9, p.id


def test_unknown_split_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown split"):
        load_prompts("train")


def test_malformed_file_names_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "prompts.jsonl"
    good = {"id": "p01-x", "kind": "code", "split": "tune", "text": "hello"}
    bad.write_text(json.dumps(good) + "\n" + json.dumps({**good, "kind": "poetry"}) + "\n")
    with pytest.raises(corpus.CorpusError) as info:
        corpus._read_jsonl(bad, corpus.CorpusPrompt)
    assert info.value.line == 2
    bad.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(corpus.CorpusError, match="duplicate id"):
        corpus._read_jsonl(bad, corpus.CorpusPrompt)


# -- conversations -----------------------------------------------------------------------------------
def test_conversations_are_agent_shaped() -> None:
    convs = load_conversations()
    assert len(convs) >= 8
    assert len({c.id for c in convs}) == len(convs)
    assert len({c.messages[0]["content"] for c in convs}) >= 2  # at least two distinct system prompts
    for c in convs:
        msgs = c.messages
        assert msgs[0]["role"] == "system" and len(msgs[0]["content"]) >= 6000, c.id
        assert 6 <= len(msgs) <= 15, c.id
        assert msgs[-1]["role"] in ("user", "tool"), c.id
        calls = [t for m in msgs if m["role"] == "assistant" for t in m.get("tool_calls") or []]
        results = [m for m in msgs if m["role"] == "tool"]
        assert calls and results, c.id
        assert len({t["id"] for t in calls}) == len(calls), c.id
        for t in calls:
            assert t["type"] == "function"
            assert isinstance(json.loads(t["function"]["arguments"]), dict)


def test_every_tool_result_answers_an_earlier_call() -> None:
    for c in load_conversations():
        open_calls: set[str] = set()
        for m in c.messages[1:]:
            if m["role"] == "assistant":
                assert not open_calls, f"{c.id}: assistant spoke before all tool results came back"
                open_calls = {t["id"] for t in m.get("tool_calls") or []}
            elif m["role"] == "tool":
                open_calls.remove(m["tool_call_id"])
            else:
                assert not open_calls, f"{c.id}: user spoke before all tool results came back"


def test_conversations_are_copies() -> None:
    first = load_conversations()[0]
    first.messages.append({"role": "user", "content": "mutated"})
    assert load_conversations()[0].messages[-1]["content"] != "mutated"


def test_conversation_text_is_chatml() -> None:
    for c in load_conversations():
        text = conversation_text(c)
        assert text.startswith("<|im_start|>system\n")
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert text.count("<|im_start|>") == len(c.messages) + 1
        assert "<|im_start|>tool\n" in text and "<tool_call>\n{" in text
    conv = Conversation(
        id="c99-tiny",
        messages=[
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "x = 1"},
        ],
    )
    assert conversation_text(conv) == (
        "<|im_start|>system\nsys<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\nx = 1<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_conversation_text_with_a_chat_template() -> None:
    template = (
        "{% for m in messages %}[{{ m.role }}]"
        "{% if m.tool_calls %}{% for t in m.tool_calls %}{{ t.function.name }} "
        "{{ t.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    conv = load_conversations()[0]
    text = conversation_text(conv, template=template)
    assert text.startswith("[system]") and text.endswith("[assistant]")
    assert '"path": "src/invoicely/terms.py"' in text  # arguments rendered as an object, not a string


def test_invalid_role_is_rejected() -> None:
    with pytest.raises(ValueError, match="role"):
        Conversation(id="c98-bad", messages=[{"role": "narrator", "content": "x"}])


# -- sized prompts -----------------------------------------------------------------------------------
@pytest.mark.parametrize("tokenize", [byte_tokenizer, word_tokenizer], ids=["bytes", "words"])
def test_sized_prompts_exact_lengths(tokenize) -> None:
    lengths = [1, 32, 128, 512, 1024, 4096, 16384, 100_000]
    out = sized_prompts(tokenize, lengths, split="tune", seed=0)
    assert [len(t) for t in out] == lengths
    assert out == sized_prompts(tokenize, lengths, split="tune", seed=0)  # deterministic


def test_sized_prompts_are_prefixes_of_corpus_text() -> None:
    texts = [p.text for p in load_prompts("held_out")]
    for toks in sized_prompts(byte_tokenizer, [50, 400, 2000], split="held_out", seed=5):
        prefix = bytes(toks).decode(errors="ignore")
        assert any(t.startswith(prefix[:-4]) for t in texts)


def test_sized_prompts_prefer_distinct_prompts_and_vary_with_seed() -> None:
    out = sized_prompts(byte_tokenizer, [64] * 10, seed=1)
    assert len({bytes(t) for t in out}) == 10  # no shared prompt, so no shared prefix cache hit
    assert out != sized_prompts(byte_tokenizer, [64] * 10, seed=2)


def test_sized_prompts_joins_prompts_with_blank_lines() -> None:
    longest = max(len(p.text.encode()) for p in load_prompts("tune"))
    (toks,) = sized_prompts(byte_tokenizer, [longest + 1000], seed=0)
    assert b"\n\n" in bytes(toks)


def test_sized_prompts_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        sized_prompts(byte_tokenizer, [0])
    with pytest.raises(ValueError, match="no tokens"):
        sized_prompts(lambda s: [], [10])


# -- WikiText-2 --------------------------------------------------------------------------------------
WIKI_SAMPLE = (
    " \n = Harbour Lights = \n \n"
    " The harbour lights were first lit in 1851 . \n"
    " They were converted to electricity in 1923 . \n \n"
    " = = Keepers = = \n \n"
    " Three families kept the lights over a century . \n"
)


def closed_port() -> int:
    """A loopback port with nothing listening (connections are refused at once; no traffic leaves the host)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_wikitext2_without_network_returns_none_quickly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(corpus_wikitext, "WIKITEXT2_URL", f"http://127.0.0.1:{closed_port()}/test.parquet")  # refused
    monkeypatch.setattr(logging.getLogger("tasks"), "propagate", True)  # flux's CLI logging may have turned it off
    with caplog.at_level(logging.INFO, logger="tasks.corpus_wikitext"):
        t0 = time.monotonic()
        assert corpus_wikitext.wikitext2(tmp_path, timeout_s=5.0) is None
        assert time.monotonic() - t0 < 10
    # one line logged (a record reaching the capture twice, through two of its handlers, is still one line)
    assert len({id(r) for r in caplog.records if "WikiText-2" in r.getMessage()}) == 1
    assert not (tmp_path / "corpora").exists() or not any((tmp_path / "corpora").rglob("*.txt"))


def test_wikitext2_gives_up_at_the_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as silent:  # a loopback server that accepts and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        monkeypatch.setattr(corpus_wikitext, "WIKITEXT2_URL", f"http://127.0.0.1:{silent.getsockname()[1]}/test.parquet")
        t0 = time.monotonic()
        assert corpus_wikitext.wikitext2(tmp_path, timeout_s=1.0) is None
        assert time.monotonic() - t0 < 10


def test_wikitext2_reads_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus_wikitext, "WIKITEXT2_URL", f"http://127.0.0.1:{closed_port()}/test.parquet")
    cached = tmp_path / "corpora" / "wikitext-2" / "test.txt"
    cached.parent.mkdir(parents=True)
    cached.write_text(WIKI_SAMPLE, encoding="utf-8")
    assert corpus_wikitext.wikitext2(tmp_path) == [
        "The harbour lights were first lit in 1851 . They were converted to electricity in 1923 .",
        "Three families kept the lights over a century .",
    ]


def test_wikitext2_downloads_parquet_and_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "test-00000-of-00001.parquet"
    pq.write_table(pa.table({"text": WIKI_SAMPLE.splitlines(keepends=True)}), source)
    monkeypatch.setattr(corpus_wikitext, "WIKITEXT2_URL", source.as_uri())
    cache = tmp_path / "cache"
    first = corpus_wikitext.wikitext2(cache)
    assert first is not None and len(first) == 2
    assert (cache / "corpora" / "wikitext-2" / "test.txt").read_text() == WIKI_SAMPLE
    assert not list((cache / "corpora" / "wikitext-2").glob(".*.tmp"))
    monkeypatch.setattr(corpus_wikitext, "WIKITEXT2_URL", f"http://127.0.0.1:{closed_port()}/test.parquet")
    assert corpus_wikitext.wikitext2(cache) == first  # served from the cache, no network needed


def test_sized_prompts_with_a_tokenizer_that_is_not_additive() -> None:
    # A fixed 1,000-token preamble per call: the joined text counts it once, the per-prompt counts
    # once per prompt, so estimates from the separate counts are far too high.
    def preamble_tokenizer(s: str) -> list[int]:
        return [0] * 1000 + list(s.encode())

    longest = max(len(p.text.encode()) for p in load_prompts("tune"))
    lengths = [longest + 1001, 3 * longest]
    out = sized_prompts(preamble_tokenizer, lengths, seed=0)
    assert [len(t) for t in out] == lengths
