"""``flux bench conformance``: the native engine and llama.cpp's llama-server must agree.

Both run the plan's configuration (llama-server with the plan's own llama.cpp flags, one slot; the
native engine in a worker). "Ours" is what Flux serves: the worker's serving engine (``serve_load`` +
``generate``) for tokens and generation, llama-cpp-python's formatter (the worker's ``chat`` op) for chat
completions, and the GGUF's Jinja template rendered the way llama-cpp-python renders it.

Checks (a registry, :data:`CHECKS`): chat template rendering (``/apply-template``), special tokens
(``/props``, ``/detokenize`` and the GGUF header), tokenization (``/tokenize``) of the corpus and of
unicode/edge strings, greedy outputs, stop sequences, and usage counts. Every disagreement is a row;
the verdict is ``pass`` when there is none, or when each is explained by a rule in
:data:`tasks.bench.conformance_rules.EXPLAINED`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from artifacts.corpus import load_conversations, load_prompts, sized_prompts
from artifacts.gguf_header import read_header
from engine_bridge import ops
from engine_bridge.client import WorkerClient
from engine_bridge.errors import EngineError
from engine_bridge.llama_server import LlamaServer
from engine_bridge.sampling import GREEDY
from tasks.bench.conformance_rules import Finding, explain
from tasks.bench.context import BenchContext, Progress
from tasks.bench.host import load_avg
from tasks.bench.record import BenchRun, SummaryRow
from tasks.bench.registry import Suite

RAW_SCHEMA = pa.schema([("check", pa.string()), ("case", pa.string()), ("ok", pa.bool_()),
                        ("explained", pa.string()), ("ours", pa.string()), ("theirs", pa.string())])
SHOWN_CHARS = 400  # of each side of a finding, in the stored rows
NEAR_TIE = "near-tie"
TIE_NATS = 5e-3  # two tokens whose log-probabilities differ by less are a tie that rounding may break either way
NEAR_TIE_REASON = ("the engines agree up to a position where the two best tokens are (nearly) equally likely; "
                   "rounding or tie-breaking (llama-server's sampler and ours pick differently among exact ties) "
                   "picks the other one, and the outputs part from there")
EDGE_STRINGS = (
    "", " ", "  two leading spaces", "trailing spaces   ", "\n\n\t\r\n", "naïve café déjà vu", "日本語のテキスト",
    "emoji 😀👍🏽 family 👨‍👩‍👧", "e\u0301 combining", "שלום עולם", "zero\u200bwidth", "nul\x00byte",
    "tab\tand\\backslash", "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", "<|im_start", "x" * 300,
    "def f(x):\n    return x ** 2  # ok\n", "{\"json\": [1, 2.5e-3, null]}",
)
CHAT_CASES: tuple[tuple[str, list[dict[str, Any]]], ...] = (
    ("user", [{"role": "user", "content": "Hello"}]),
    ("system-user", [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List 3 primes."}]),
    ("multi-turn", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": "Wie geht's? 😀"}]),
)


class ConformanceOptions(BaseModel):
    """How much ``flux bench conformance`` checks."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    n_gen: int = Field(24, ge=4, le=512, description="greedy tokens compared per prompt")
    prompts: tuple[int, ...] = (32, 128)
    conversations: int = Field(8, ge=0)
    corpus_chars: int = Field(4000, ge=1, description="characters of each corpus prompt tokenized")
    seed: int = 0


@dataclass
class Session:
    """Both engines, running, plus what the checks need."""

    ctx: BenchContext
    opts: ConformanceOptions
    srv: LlamaServer
    w: WorkerClient
    metadata: dict[str, Any]
    engine: dict[str, Any]  # the serving engine's info (bos, eos, eot, add_bos)
    chats: dict[str, dict[str, Any]]  # case -> llama-cpp-python chat completion (load mode, before serving)

    def tokenize(self, text: str, special: bool = True, add_special: bool = False) -> list[int]:
        """The serving engine's tokens of ``text``."""
        return self.w.tokenize(text, special=special, add_special=add_special, timeout=self.ctx.timeout_s)

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        """The serving engine's text of ``tokens``."""
        return self.w.detokenize(tokens, special=special, timeout=self.ctx.timeout_s)

    def generate(self, prompt: list[int], max_tokens: int) -> tuple[list[int], str, dict[str, Any]]:
        """Greedy generation in the serving engine: (tokens, text, result)."""
        tokens, text, result = [], [], {}
        args = ops.GenerateArgs(rid=f"conf-{time.monotonic_ns()}", prompt=prompt, max_tokens=max_tokens, sampling=GREEDY)
        for msg in self.w.generate(args, timeout=self.ctx.timeout_s):
            if msg["type"] == "result":
                result = msg["result"].model_dump()
            elif msg["type"] == "token":
                tokens.append(msg["token"])
                text.append(msg["text"])
        return tokens, "".join(text) + str(result.get("text_tail", "")), result


def _cmp(check: str, case: str, ours: Any, theirs: Any) -> Finding:
    return Finding(check=check, case=case, ok=ours == theirs, ours=_show(ours), theirs=_show(theirs))


def _show(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + f"... ({len(text)} chars)"


def _first_diff(a: Sequence[Any], b: Sequence[Any]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"first difference at {i} of {len(a)} vs {len(b)}"


# -- checks -------------------------------------------------------------------------------------------
def render_template(source: str, messages: Sequence[dict[str, Any]], bos: str, eos: str) -> str:
    """A GGUF chat template rendered as llama-cpp-python's Jinja2ChatFormatter renders it."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True)
    return env.from_string(source).render(messages=list(messages), bos_token=bos, eos_token=eos,
                                          raise_exception=raise_exception, add_generation_prompt=True, tools=None,
                                          tool_choice=None, strftime_now=lambda f: datetime.now().strftime(f))


def _chat_cases(s: Session) -> list[tuple[str, list[dict[str, Any]]]]:
    convs = [(c.id, c.messages) for c in load_conversations()[:s.opts.conversations]]
    return [*((k, list(m)) for k, m in CHAT_CASES), *convs]


def check_template(s: Session) -> list[Finding]:
    """Our rendering of the GGUF's template vs llama-server's /apply-template."""
    source = s.metadata.get("tokenizer.chat_template")
    if not isinstance(source, str) or not source.strip():
        return [Finding(check="template", case="-", ok=True, ours="the GGUF has no chat template")]
    bos = s.detokenize([s.engine["bos"]], special=True) if s.engine.get("bos") is not None else ""
    eos = s.detokenize([s.engine["eos"]], special=True) if s.engine.get("eos") is not None else ""
    out = []
    for case, messages in _chat_cases(s):
        try:
            ours = render_template(source, messages, bos, eos)
        except Exception as exc:  # noqa: BLE001 - any template failure is a finding, not a crash
            ours = f"error: {type(exc).__name__}: {exc}"
        theirs = s.srv.apply_template(messages)
        f = _cmp("template", case, ours, theirs)
        out.append(f if f.ok else f.model_copy(update={"ours": f"{_first_diff(ours, theirs)}: {f.ours}"}))
    return out


def check_special_tokens(s: Session) -> list[Finding]:
    """Special token ids and texts: GGUF header vs the native engine vs llama-server."""
    props, md, out = s.srv.props(), s.metadata, []
    for name in ("bos", "eos"):
        out.append(_cmp("special_tokens", f"{name} id (engine vs GGUF header)", s.engine.get(name),
                        md.get(f"tokenizer.ggml.{name}_token_id")))
        tid = s.engine.get(name)
        if tid is None:
            continue
        ours = s.detokenize([tid], special=True)
        out.append(_cmp("special_tokens", f"{name} text (/props)", ours, props.get(f"{name}_token", "")))
        out.append(_cmp("special_tokens", f"{name} tokenized", s.tokenize(ours),
                        s.srv.tokenize(ours)))
    if s.engine.get("eot") is not None:
        tid = s.engine["eot"]
        out.append(_cmp("special_tokens", "eot text (/detokenize)", s.detokenize([tid], special=True),
                        s.srv.detokenize([tid])))
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False))
    out.append(_cmp("special_tokens", "add_bos (engine vs GGUF header)", bool(s.engine.get("add_bos")), add_bos))
    out.append(_cmp("special_tokens", "tokenize with add_special", s.tokenize("a", add_special=True),
                    s.srv.tokenize("a", add_special=True)))
    return out


def check_tokenize(s: Session) -> list[Finding]:
    """Token ids of corpus prompts and edge strings, with and without parsing special tokens."""
    out = []
    cases = [(p.id, p.text[:s.opts.corpus_chars]) for p in load_prompts()]
    cases += [(f"edge-{i}", t) for i, t in enumerate(EDGE_STRINGS)]
    for case, text in cases:
        for special in (True, False):
            ours = s.tokenize(text, special=special)
            theirs = s.srv.tokenize(text, parse_special=special)
            f = _cmp("tokenize", f"{case} special={special}", ours, theirs)
            out.append(f if f.ok else f.model_copy(update={"ours": f"{_first_diff(ours, theirs)}: {f.ours}"}))
    return out


def _greedy_prompts(s: Session) -> list[tuple[str, list[int]]]:
    got = sized_prompts(s.tokenize, list(s.opts.prompts), "held_out",
                        s.opts.seed)
    chat = s.tokenize(s.srv.apply_template(CHAT_CASES[1][1]))
    return [*((f"held_out-{len(p)}", p) for p in got), ("chat-system-user", chat)]


def near_tie(entry: dict[str, Any], ours: Callable[[dict[str, Any]], bool]) -> str | None:
    """Why llama-server's token at a divergence may legitimately differ from ours: a near-tie.

    ``entry`` is llama-server's record of that token (its id, logprob and ``top_logprobs``); ``ours`` says
    which alternative is the token our engine chose. When ours is llama-server's runner-up within
    :data:`TIE_NATS`, float rounding (another accumulation order) decides between them, not a bug.
    """
    top = [t for t in entry.get("top_logprobs") or [] if t.get("id") != entry.get("id")]
    alt = next((t for t in top if ours(t)), None)
    if alt is None or "logprob" not in entry:
        return None
    gap = float(entry["logprob"]) - float(alt["logprob"])
    why = f"llama-server's token {entry.get('id')} leads ours ({alt.get('id')}) by {gap:.2e} nats"
    return f"{NEAR_TIE}: {why} (under {TIE_NATS:g}): {NEAR_TIE_REASON}" if gap <= TIE_NATS else None


def _token_tie(probs: list[dict[str, Any]], ours: list[int], theirs: list[int]) -> str | None:
    i = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    if i is None or i >= len(probs):
        return None
    return near_tie(probs[i], lambda t: int(t.get("id", -1)) == ours[i])


def check_greedy(s: Session) -> list[Finding]:
    """Temperature-0 continuations: tokens, text, finish reason and usage of /completion vs ours."""
    out = []
    for case, prompt in _greedy_prompts(s):
        toks, text, res = s.generate(prompt, s.opts.n_gen)
        got = s.srv.completion(prompt, s.opts.n_gen, return_tokens=True, n_probs=2)
        theirs = [int(t) for t in got.get("tokens", [])]
        tie = _token_tie(got.get("completion_probabilities") or [], toks, theirs)
        f = _cmp("greedy", f"{case} tokens", toks, theirs)
        out.append(f if f.ok else f.model_copy(update={"ours": f"{_first_diff(toks, theirs)}: {f.ours}", "explained": tie}))
        f = _cmp("greedy", f"{case} text", text, got.get("content", ""))
        out.append(f if f.ok else f.model_copy(update={"explained": tie}))
        reason = {"limit": "length", "eos": "stop", "word": "stop"}.get(str(got.get("stop_type")), str(got.get("stop_type")))
        out.append(_cmp("greedy", f"{case} finish_reason", res.get("finish_reason"), reason))
        out.append(_cmp("usage", f"{case} completion prompt/completion tokens",
                        (res.get("prompt_tokens"), res.get("completion_tokens")),
                        (got.get("tokens_evaluated"), got.get("tokens_predicted"))))
        out += _stop_findings(s, case, prompt, os.path.commonprefix([text, str(got.get("content", ""))]))
    return out


def _stop_string(text: str) -> str | None:
    """A stop string from the middle of a generated text (clean characters only)."""
    mid = len(text) // 2
    for start in range(mid, len(text) - 2):
        cand = text[start:start + 2]
        if "\ufffd" not in cand and cand.strip() and cand.isprintable():
            return cand
    return None


def _stop_findings(s: Session, case: str, prompt: list[int], text: str) -> list[Finding]:
    """Stop at a string seen mid-output: the reply must end right before its first occurrence."""
    stop = _stop_string(text)
    if stop is None:
        return [Finding(check="stop", case=case, ok=True, ours="no clean stop string in this output")]
    got = s.srv.completion(prompt, s.opts.n_gen, stop=[stop])
    ours = text[:text.find(stop)]
    return [_cmp("stop", f"{case} stop={stop!r} text", ours, got.get("content", "")),
            _cmp("stop", f"{case} stop={stop!r} stopping_word", stop, got.get("stopping_word"))]


def _continues(want: bytes, done: bytes) -> Callable[[dict[str, Any]], bool]:
    """Whether a llama-server token record continues ``done`` the way ``want`` does."""
    return lambda t: want.startswith(done + bytes(t.get("bytes") or []))


def _chat_tie(ours: str, logprobs: dict[str, Any] | None) -> str | None:
    """A near-tie at the first llama-server token whose bytes leave our reply's bytes."""
    want, done = ours.encode("utf-8"), b""
    for entry in (logprobs or {}).get("content") or []:
        piece = bytes(entry.get("bytes") or [])
        if not want.startswith(done + piece):
            return near_tie(entry, _continues(want, done))
        done += piece
    return None


def check_chat(s: Session) -> list[Finding]:
    """llama-cpp-python's chat completion (worker ``chat``) vs llama-server's: usage, finish, content."""
    out = []
    for case, ours in s.chats.items():
        messages = dict(CHAT_CASES)[case]
        theirs = s.srv.chat(messages, s.opts.n_gen, logprobs=True, top_logprobs=2)
        ou, tu = ours.get("usage", {}), theirs.get("usage", {})
        out.append(_cmp("usage", f"chat {case} prompt/completion tokens", (ou.get("prompt_tokens"), ou.get("completion_tokens")),
                        (tu.get("prompt_tokens"), tu.get("completion_tokens"))))
        oc, tc = ours["choices"][0], theirs["choices"][0]
        out.append(_cmp("chat", f"{case} finish_reason", oc.get("finish_reason"), tc.get("finish_reason")))
        f = _cmp("chat", f"{case} content", oc["message"].get("content"), tc["message"].get("content"))
        tie = None if f.ok else _chat_tie(str(oc["message"].get("content") or ""), tc.get("logprobs"))
        out.append(f.model_copy(update={"explained": tie}) if tie else f)
    return out


Check = Callable[[Session], list[Finding]]
CHECKS: dict[str, Check] = {"template": check_template, "special_tokens": check_special_tokens,
                            "tokenize": check_tokenize, "greedy": check_greedy, "chat": check_chat}


# -- the suite ----------------------------------------------------------------------------------------
def _chat_completions(ctx: BenchContext, w: WorkerClient, n_gen: int) -> dict[str, dict[str, Any]]:
    """llama-cpp-python's chat completions (needs the model loaded with ``load``, not ``serve_load``)."""
    w.request(ops.LOAD, ops.LoadArgs(model=str(ctx.model), params=ctx.params), ctx.timeout_s)
    return {case: w.request(ops.CHAT, ops.ChatArgs(messages=m, max_tokens=n_gen, temperature=0.0), ctx.timeout_s).model_dump()
            for case, m in CHAT_CASES}


def run_checks(s: Session, progress: Progress | None = None) -> tuple[list[Finding], dict[str, float]]:
    """Every check (a check that errors is one failed finding) and the seconds each took."""
    findings: list[Finding] = []
    seconds: dict[str, float] = {}
    for name, check in CHECKS.items():
        if progress:
            progress(f"conformance: {name}")
        t0 = time.monotonic()
        try:
            findings += [explain(f) for f in check(s)]
        except EngineError as exc:
            findings.append(Finding(check=name, case="-", ok=False, ours=f"check failed: {exc.code}: {exc.message}"))
        seconds[name] = round(time.monotonic() - t0, 2)
    return findings, seconds


def bench_conformance(ctx: BenchContext, opts: ConformanceOptions, progress: Progress | None = None) -> BenchRun:
    """Run every check with both engines up; one summary row (baseline ``llama-server``)."""
    t0, load0 = time.monotonic(), load_avg()
    args = [*ctx.params.cli_args(), "-np", "1"]
    srv = LlamaServer(ctx.need_llama_server(), ctx.model, args, log_path=ctx.server_log, env=ctx.params.environment(),
                      start_timeout_s=ctx.timeout_s, request_timeout_s=ctx.timeout_s)
    with WorkerClient(log_path=ctx.worker_log, env=ctx.params.environment()) as w, srv:
        chats = _chat_completions(ctx, w, opts.n_gen)
        engine = w.request(ops.SERVE_LOAD, ops.ServeLoadArgs(model=str(ctx.model), params=ctx.params),
                           ctx.timeout_s).model_dump()
        session = Session(ctx=ctx, opts=opts, srv=srv, w=w, metadata=read_header(ctx.model).metadata,
                          engine=engine, chats=chats)
        findings, seconds = run_checks(session, progress)
    bad = [f for f in findings if not f.ok and not f.explained]
    explained = [f for f in findings if not f.ok and f.explained]
    by_check = {c: {"checked": sum(f.check == c for f in findings), "disagree": sum(f.check == c and not f.ok for f in findings)}
                for c in sorted({f.check for f in findings})}
    detail = (f"{len(findings)} comparisons, {len(bad)} unexplained disagreements, {len(explained)} explained"
              + (": " + "; ".join(f"{f.check} {f.case}" for f in bad[:5]) if bad else ""))
    metrics = {"checks": by_check, "disagreements": [f.model_dump() for f in bad][:50],
               "explained": sorted({f.explained or "" for f in explained}), "server_args": args,
               "options": opts.model_dump(mode="json"), "check_seconds": seconds, "seconds": time.monotonic() - t0, "load_avg_start": load0,
               "load_avg_end": load_avg()}
    row = SummaryRow(baseline="llama-server", verdict="fail" if bad else "pass", detail=detail,
                     n_samples=len(findings), metrics=metrics)
    raw = pa.Table.from_pylist([f.model_dump() for f in findings], schema=RAW_SCHEMA)
    return BenchRun(suite="conformance", ctx=ctx, rows=[row], raw=raw)


SUITE = Suite(
    name="conformance", help="check that the native engine and llama-server agree",
    description="Chat template rendering, special tokens, tokenization (corpus + unicode/edge strings), greedy "
                "outputs, stop sequences and usage counts; lists every disagreement. Pass when none is left "
                "unexplained. Exit 1 on fail.",
    options=ConformanceOptions, run=bench_conformance, flags=("n_gen", "conversations", "seed"),
    help_text={"conversations": "agent conversations rendered"})
