"""``python -m engine_bridge.engines SPEC_JSON``: an engine behind the worker's protocol, for ``flux serve``.

The server supervises this process exactly as it supervises the native worker (``serve_load``, ``generate``,
``cancel``, ``tokenize``, ``detokenize``, ``serve_stats``): the engine it starts (:class:`EngineProcess`)
serves the generations through OpenAI's ``/v1/completions`` (prompt as token ids, streamed, logprobs for the
token ids), and a vocabulary-only native worker tokenizes, so that prompts, admission and context limits are
counted in the model's own tokens. When the engine process exits, this process exits too: the server's
supervisor then ends the requests it held with ``worker_died`` and starts another.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import ValidationError

from artifacts.engine_spec import EngineSpec
from artifacts.gguf_header import read_header
from engine_bridge import ops
from engine_bridge.client import WorkerClient
from engine_bridge.engines.process import EngineProcess
from engine_bridge.engines.stream import chunk_tokens
from engine_bridge.errors import EngineError
from engine_bridge.grammar_spec import GrammarSpec
from engine_bridge.protocol import PROTOCOL_VERSION, decode, encode
from engine_bridge.sampling import SamplingParams

log = logging.getLogger(__name__)
ENGINE_EXIT = 3  # this process's exit code when its engine died


def grammar_fields(g: GrammarSpec) -> dict[str, Any]:
    """llama.cpp's grammar fields for ``g`` (its root renamed ``root``; a trigger as a lazy grammar)."""
    gbnf = g.gbnf if g.root == "root" else f"root ::= {g.root}\n{g.gbnf}"
    out: dict[str, Any] = {"grammar": gbnf}
    if g.trigger is not None:
        # llama.cpp's trigger type 1 is a word anywhere (at_start is not told apart: the grammar still holds)
        out |= {"grammar_lazy": True, "grammar_triggers": [{"type": 1, "value": w} for w in g.trigger.words]}
    return out


def sampling_fields(s: SamplingParams) -> dict[str, Any]:
    """Every knob of ``s`` as the request field of its name (llama-server's and OpenAI's names are the declaration's),
    a knob at "off" included: an engine's own default for a field left out is not off (llama-server's top_k is 40).
    Only a seed left to chance is left out (the engine draws its own)."""
    return s.model_dump(exclude_none=True)


def request_body(spec: EngineSpec, a: ops.GenerateArgs) -> dict[str, Any]:
    """The ``/v1/completions`` body of one ``generate``.

    Raises:
        EngineError: ``bad_request``: a grammar (tools, structured output) for an engine that takes none.
    """
    body: dict[str, Any] = {
        "prompt": a.prompt, "max_tokens": a.max_tokens, "stream": True, "stream_options": {"include_usage": True},
        "logprobs": max(1, a.top_logprobs), "cache_prompt": True, **sampling_fields(a.sampling)}
    if a.grammar is not None:
        if not spec.grammar:
            raise EngineError("bad_request", f"this plan's engine {spec.name} takes no grammar: tool_choice, forced "
                                             "tool calls and response_format need the native engine or llama-server")
        body |= grammar_fields(a.grammar)
    return body


class Host:
    """The protocol loop: requests on stdin, answers and events on stdout (one writer lock)."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.engine: EngineProcess | None = None
        self.vocab: WorkerClient | None = None
        self.vocab_lock = threading.Lock()
        self.out_lock = threading.Lock()
        self.cancels: dict[str, threading.Event] = {}
        self.bos: int = -1
        self.add_bos = False
        self.counters = {"requests": 0, "tokens_generated": 0}

    def send(self, msg: dict[str, Any]) -> None:
        line = encode(msg)
        with self.out_lock:
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()

    # -- ops ------------------------------------------------------------------------------------------
    def serve_load(self, a: ops.ServeLoadArgs) -> ops.ServeInfo:
        """Start the vocabulary worker and the engine; watch the engine."""
        meta = read_header(Path(a.model)).metadata
        self.bos = int(meta.get("tokenizer.ggml.bos_token_id", -1))
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        self.vocab = WorkerClient(log_path=None)
        self.vocab.start()
        got = self.vocab.request(ops.LOAD, ops.LoadArgs(model=a.model, params=a.params, vocab_only=True))
        self.engine = EngineProcess(self.spec, a.model, a.params, log_path=None, drafting=a.drafting)
        load_s = self.engine.start()
        threading.Thread(target=self._watch, name="engine-watch", daemon=True).start()
        return ops.ServeInfo(n_ctx=a.params.n_ctx, n_seq_max=a.params.n_seq_max, n_vocab=got.n_vocab,
                             n_ctx_seq_cells=a.params.n_ctx, load_ms=load_s * 1e3, model_bytes=0, park_bytes=0,
                             bos=self.bos, eos=int(meta.get("tokenizer.ggml.eos_token_id", -1)), eot=-1,
                             add_bos=self.add_bos, max_token_bytes=0, engine=self.spec.name)

    def _watch(self) -> None:
        engine = self.engine
        if engine is not None and engine.proc is not None:
            code = engine.proc.wait()
            log.error("engine %s exited with code %s", self.spec.name, code)
            os._exit(ENGINE_EXIT)

    def tokenize(self, a: ops.TokenizeArgs) -> ops.TokenizeResult:
        with self.vocab_lock:
            got = self._vocab().request(ops.TOKENIZE, ops.TokenizeArgs(text=a.text, special=a.special))
        bos = [self.bos] if a.add_special and self.add_bos and self.bos >= 0 else []
        return ops.TokenizeResult(tokens=bos + got.tokens)

    def detokenize(self, a: ops.DetokenizeArgs) -> ops.DetokenizeResult:
        with self.vocab_lock:
            return self._vocab().request(ops.DETOKENIZE, ops.DetokenizeArgs(tokens=a.tokens))

    def _vocab(self) -> WorkerClient:
        if self.vocab is None:
            raise EngineError("not_loaded", "serve_load first")
        return self.vocab

    def cancel(self, a: ops.CancelArgs) -> ops.CancelResult:
        ev = self.cancels.get(a.rid)
        if ev is not None:
            ev.set()
        return ops.CancelResult(cancelled=ev is not None)

    def stats(self) -> ops.ServeStats:
        return ops.ServeStats(engine=self.spec.name, engine_pid=self.engine.pid if self.engine else None,
                              running=len(self.cancels), **self.counters)

    # -- generate -------------------------------------------------------------------------------------
    def generate(self, rid: int, a: ops.GenerateArgs) -> None:
        """Stream one generation from the engine (its own thread)."""
        stop = self.cancels.setdefault(a.rid, threading.Event())
        self.counters["requests"] += 1
        try:
            result = self._stream(rid, a, stop)
            self.send({"id": rid, "ok": True, "result": result.model_dump(mode="json")})
        except EngineError as exc:
            self.send({"id": rid, "ok": False, "error": {"code": exc.code, "message": exc.message}})
        finally:
            self.cancels.pop(a.rid, None)

    def _stream(self, rid: int, a: ops.GenerateArgs, stop: threading.Event) -> ops.GenerateResult:
        engine = self.engine
        if engine is None:
            raise EngineError("not_loaded", "serve_load first")
        body = request_body(self.spec, a)
        usage: dict[str, Any] = {}
        finish: Literal["stop", "length"] = "stop"
        n = 0
        try:
            with httpx.Client(timeout=None, limits=httpx.Limits(max_keepalive_connections=0)) as http, \
                    http.stream("POST", f"{engine.base}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise EngineError("bad_request" if r.status_code == 400 else "engine_error",
                                      f"engine {self.spec.name} answered {r.status_code}: {r.read().decode()[:300]}")
                for line in r.iter_lines():
                    if stop.is_set():
                        return ops.GenerateResult(finish_reason="cancelled", prompt_tokens=len(a.prompt),
                                                  completion_tokens=n)
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    chunk = decode_chunk(line[5:])
                    text, toks, reason = chunk_tokens(chunk)
                    usage = chunk.get("usage") or usage
                    finish = "length" if reason == "length" else finish
                    if text or toks:
                        n += 1
                        self.counters["tokens_generated"] += 1
                        self.send({"id": rid, "event": token_event(text, toks, a)})
        except httpx.HTTPError as exc:
            if engine.exited(wait_s=2.0):  # the engine died under this request: so does its host (worker_died)
                os._exit(ENGINE_EXIT)
            raise EngineError("engine_error", f"engine {self.spec.name}: {type(exc).__name__}: {exc}") from exc
        return ops.GenerateResult(finish_reason=finish, prompt_tokens=int(usage.get("prompt_tokens", len(a.prompt))),
                                  completion_tokens=int(usage.get("completion_tokens", n)),
                                  cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)))


def decode_chunk(data: str) -> dict[str, Any]:
    """One SSE data payload."""
    import json

    out = json.loads(data)
    return out if isinstance(out, dict) else {}


def token_event(text: str, toks: list[Any], a: ops.GenerateArgs) -> ops.TokenEvent:
    """The worker-shaped token event of one chunk (a chunk can hold tokens merged into one character)."""
    last = toks[-1] if toks else None
    ev: ops.TokenEvent = {"type": "token", "token": last.id if last is not None and last.id is not None else -1,
                          "text": text, "logprob": None, "top_logprobs": []}
    if a.logprobs and last is not None:
        ev["logprob"] = last.logprob
        ev["bytes"] = list(text.encode())
        ev["top_logprobs"] = [{"token": t, "text": "", "bytes": [], "logprob": lp}
                              for t, lp in sorted(last.top.items(), key=lambda kv: -kv[1])[:a.top_logprobs]]
    return ev


def main(argv: list[str]) -> int:
    """Answer the protocol on stdin/stdout until EOF or ``shutdown``."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    host = Host(EngineSpec.model_validate_json(argv[0]))
    handlers: dict[str, tuple[ops.OpSpec[Any, Any], Any]] = {
        ops.SERVE_LOAD.name: (ops.SERVE_LOAD, host.serve_load), ops.TOKENIZE.name: (ops.TOKENIZE, host.tokenize),
        ops.DETOKENIZE.name: (ops.DETOKENIZE, host.detokenize), ops.CANCEL.name: (ops.CANCEL, host.cancel),
        ops.SERVE_STATS.name: (ops.SERVE_STATS, lambda _a: host.stats())}
    try:
        for line in sys.stdin.buffer:
            msg = decode(line)
            rid, op, raw = msg["id"], msg.get("op", ""), msg.get("args") or {}
            if op == ops.HELLO.name:
                host.send({"id": rid, "ok": True, "result": {"protocol": PROTOCOL_VERSION, "pid": os.getpid(),
                                                             "python": sys.version.split()[0]}})
            elif op == ops.SHUTDOWN.name:
                host.send({"id": rid, "ok": True, "result": {}})
                break
            elif op == ops.GENERATE.name:
                try:
                    args = ops.GenerateArgs.model_validate(raw)
                except ValidationError as exc:
                    host.send({"id": rid, "ok": False, "error": {"code": "bad_request", "message": str(exc)}})
                    continue
                threading.Thread(target=host.generate, args=(rid, args), daemon=True).start()
            else:
                threading.Thread(target=_answer, args=(host, handlers, rid, op, raw), daemon=True).start()
    finally:
        for ev in list(host.cancels.values()):
            ev.set()
        if host.engine is not None:
            host.engine.stop()
        if host.vocab is not None:
            host.vocab.close(timeout=5)
    return 0


def _answer(host: Host, handlers: dict[str, tuple[ops.OpSpec[Any, Any], Any]], rid: int, op: str,
            raw: dict[str, Any]) -> None:
    """One non-streaming op on its own thread (serve_load takes a while; tokenize must not wait for it)."""
    try:
        if op not in handlers:
            raise EngineError("unknown_op", f"engine {host.spec.name} does not answer op {op!r}")
        spec, fn = handlers[op]
        host.send({"id": rid, "ok": True, "result": fn(spec.args.model_validate(raw)).model_dump(mode="json")})
    except EngineError as exc:
        host.send({"id": rid, "ok": False, "error": {"code": exc.code, "message": exc.message}})
    except Exception as exc:  # noqa: BLE001 - any failure of one request is reported, the host lives on
        host.send({"id": rid, "ok": False, "error": {"code": "internal", "message": f"{type(exc).__name__}: {exc}"}})
