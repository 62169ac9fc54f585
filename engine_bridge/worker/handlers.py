"""One handler per op of :mod:`engine_bridge.ops`: typed arguments in, a typed result out.

:data:`HANDLERS` maps each op's name to its spec and handler; :func:`engine_bridge.worker.process.handle`
validates a request's arguments with the spec's model before calling the handler. ``generate`` streams:
its handler admits the request into the serving engine, which sends the events and the result itself.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel

from engine_bridge import ops
from engine_bridge.errors import EngineError
from engine_bridge.protocol import PROTOCOL_VERSION, packed

if TYPE_CHECKING:
    from engine_bridge.worker.state import Worker

Handler = Callable[["Worker", Any], BaseModel]
StreamHandler = Callable[["Worker", int, Any], None]
# Result fields that are token arrays: they travel packed (engine_bridge.protocol.packed), a long prompt's tokens
# in a millisecond instead of several
TOKEN_FIELDS: dict[str, tuple[str, ...]] = {ops.TOKENIZE.name: ("tokens",), ops.GREEDY.name: ("tokens",),
                                            ops.SPEC_GREEDY.name: ("tokens",)}


def hello(w: Worker, a: ops.NoArgs) -> ops.HelloResult:
    """Versions, so the client can refuse a stale worker."""
    return ops.HelloResult(protocol=PROTOCOL_VERSION, pid=os.getpid(), python=sys.version.split()[0])


def devices(w: Worker, a: ops.NoArgs) -> ops.DevicesResult:
    """The ggml devices this build sees."""
    from engine_bridge.worker.load import list_devices

    return ops.DevicesResult(devices=list_devices())


def load(w: Worker, a: ops.LoadArgs) -> ops.LoadResult:
    """Load a model with EngineParams for measuring; replaces a loaded one."""
    from engine_bridge.worker.native import NativeModel, VocabModel

    w.unload()
    if w.fault == "abort-on-load":
        os.abort()
    t0 = time.perf_counter()
    w.model = VocabModel(Path(a.model)) if a.vocab_only else NativeModel(Path(a.model), a.params)
    return ops.LoadResult(load_ms=(time.perf_counter() - t0) * 1e3, n_ctx=w.model.n_ctx, n_vocab=w.model.n_vocab)


def check_structure(w: Worker, a: ops.StructureArgs) -> ops.StructureResult:
    """What llama.cpp's loader finds wrong with a model's tensors and hyperparameters, reading no weights."""
    from engine_bridge.worker.load import check_structure as check

    return ops.StructureResult(problem=check(Path(a.model)))


def tokenize(w: Worker, a: ops.TokenizeArgs) -> ops.TokenizeResult:
    """Tokens of a text (special tokens parsed unless ``special`` is false; BOS only with ``add_special``)."""
    if w.engine is not None:  # llama.cpp's own ids, packed straight from its array (see payload): not validated
        return ops.TokenizeResult.model_construct(tokens=w.engine.vocab.tokenize_array(a.text, a.special, a.add_special))
    return ops.TokenizeResult(tokens=w.need_model().tokenize(a.text, special=a.special))


def detokenize(w: Worker, a: ops.DetokenizeArgs) -> ops.DetokenizeResult:
    """Text of tokens (invalid UTF-8 replaced; control tokens rendered only with ``special``)."""
    if w.engine is not None:
        return ops.DetokenizeResult(text=w.engine.vocab.detokenize(a.tokens, a.special))
    return ops.DetokenizeResult(text=w.need_model().detokenize(a.tokens))


def timed_run(w: Worker, a: ops.TimedRunArgs) -> ops.Timing:
    """Prefill + greedy decode, timed."""
    return w.need_model().timed_run(a.prompt, a.n_gen)


def greedy(w: Worker, a: ops.GreedyArgs) -> ops.GreedyResult:
    """Greedy continuation tokens and their text."""
    m = w.need_model()
    toks = m.greedy(a.prompt, a.n_gen, a.stop_eog)
    return ops.GreedyResult(tokens=toks, text=m.detokenize(toks))


def spec_greedy(w: Worker, a: ops.SpecGreedyArgs) -> ops.SpecGreedyResult:
    """Greedy speculative decoding: the loaded model's greedy tokens, drafted by ``a.draft_model`` (loaded with
    the draft's parameters beside the model's the first time, then kept with it) or by prompt lookup."""
    from artifacts.drafting import draft_params
    from engine_bridge.worker.native import NativeModel
    from engine_bridge.worker.speculative import Drafter, ModelDrafter, NgramDrafter, speculative_greedy

    m = w.need_model()
    if not isinstance(m, NativeModel):
        raise EngineError("not_loaded", "spec_greedy needs a model's weights: send 'load' without vocab_only")
    drafter: Drafter = NgramDrafter(a.ngram)
    if a.draft_model is not None:
        draft = m.drafts.get(a.draft_model)
        if draft is None:
            if not Path(a.draft_model).is_file():
                raise EngineError("model_missing", f"the draft model {a.draft_model} is not a file")
            draft = m.drafts[a.draft_model] = NativeModel(Path(a.draft_model), draft_params(m.params))
        drafter = ModelDrafter(m, draft)
    return speculative_greedy(m, drafter, a.prompt, a.n_gen, a.n_draft, a.stop_eog)


def logprobs(w: Worker, a: ops.LogprobsArgs) -> ops.LogprobsResult:
    """Write the log-softmax rows before each continuation token to an .npy file (too big for JSON)."""
    model = w.need_model()
    if a.threads_file:
        from engine_bridge.worker.threads import SharedThreads

        SharedThreads(a.threads_file).apply(model.ctx)
    lp = model.logprobs(a.prompt, a.continuation)
    out = Path(a.out)
    tmp = out.with_suffix(".tmp.npy")
    np.save(tmp, lp.astype(np.float32))
    os.replace(tmp, out)
    return ops.LogprobsResult(rows=int(lp.shape[0]), path=str(out))


def chat(w: Worker, a: ops.ChatArgs) -> ops.ChatResult:
    """One non-streaming chat completion."""
    return ops.ChatResult.model_validate(w.need_model().chat(a.messages, a.max_tokens, a.temperature))


def serve_load(w: Worker, a: ops.ServeLoadArgs) -> ops.ServeInfo:
    """Load a model for serving: one context with n_seq_max sequences of n_ctx tokens each."""
    from engine_bridge.worker.serve_routing import ServeRoutingCounter
    from engine_bridge.worker.serving import ServeEngine

    w.unload()
    routing = ServeRoutingCounter(a.routing_every, a.routing_window) if a.routing_every else None
    with w.engine_lock:
        w.engine = ServeEngine(Path(a.model), a.params, a.park_bytes, w, a.drafting, routing)
    return ops.ServeInfo.model_validate(w.engine.info())


def generate(w: Worker, key: int, a: ops.GenerateArgs) -> None:
    """Admit a generation; its events and result are sent by the engine as it runs."""
    w.need_engine().submit(key, a)


def cancel(w: Worker, a: ops.CancelArgs) -> ops.CancelResult:
    """Finish a running generation now (finish_reason "cancelled")."""
    return ops.CancelResult(cancelled=w.need_engine().cancel(a.rid))


def serve_stats(w: Worker, a: ops.NoArgs) -> ops.ServeStats:
    """Counters and memory of the serving engine."""
    return ops.ServeStats.model_validate(w.need_engine().stats())


def serve_routing(w: Worker, a: ops.NoArgs) -> ops.ServeRouting:
    """The expert picks the serving engine counted on its sampled decode steps (all zero when it counts none)."""
    counter = w.need_engine().routing
    if counter is None:
        return ops.ServeRouting(architecture="", n_layer=0, n_expert=0, n_expert_used=0, every=0)
    return counter.report()


def routing_counts(w: Worker, a: ops.RoutingRequest) -> ops.RoutingCounts:
    """Per-layer expert selection counts over prompts prefilled and decoded.

    The model is loaded for the trace with the request's params and freed after; a loaded model is unloaded first.
    """
    from engine_bridge.worker.routing import trace

    w.unload()
    if w.fault == "abort-on-trace":
        os.abort()
    return trace(a)


def abort(w: Worker, a: ops.NoArgs) -> ops.Empty:
    """Die like a native crash would (fault injection for tests and the soak suite)."""
    os.abort()


HANDLERS: dict[str, tuple[ops.OpSpec[Any, Any], Handler]] = {spec.name: (spec, fn) for spec, fn in (
    (ops.HELLO, hello), (ops.DEVICES, devices), (ops.LOAD, load), (ops.CHECK_STRUCTURE, check_structure),
    (ops.TOKENIZE, tokenize),
    (ops.DETOKENIZE, detokenize), (ops.TIMED_RUN, timed_run), (ops.GREEDY, greedy), (ops.SPEC_GREEDY, spec_greedy),
    (ops.LOGPROBS, logprobs),
    (ops.CHAT, chat), (ops.SERVE_LOAD, serve_load), (ops.CANCEL, cancel), (ops.SERVE_STATS, serve_stats),
    (ops.SERVE_ROUTING, serve_routing), (ops.ROUTING_COUNTS, routing_counts), (ops.ABORT, abort))}
STREAM_HANDLERS: dict[str, tuple[ops.OpSpec[Any, Any], StreamHandler]] = {ops.GENERATE.name: (ops.GENERATE, generate)}


def payload(op: str, result: BaseModel) -> dict[str, Any]:
    """``result`` as it travels: JSON, with its token arrays packed."""
    fields = TOKEN_FIELDS.get(op, ())
    out = result.model_dump(mode="json", exclude=set(fields))
    out.update({f: packed(getattr(result, f)) for f in fields})
    return out


def unhandled() -> list[str]:
    """Ops declared in :mod:`engine_bridge.ops` with no handler here (a test keeps this empty)."""
    return sorted(set(ops.OPS) - set(HANDLERS) - set(STREAM_HANDLERS) - {ops.SHUTDOWN.name})


def check(spec: ops.OpSpec[Any, Any], raw: dict[str, Any]) -> Any:
    """The request's arguments as the op's model, or ``bad_request``."""
    from pydantic import ValidationError

    try:
        return spec.args.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors()
        where = ".".join(str(p) for p in errors[0]["loc"]) if errors else ""
        why = errors[0]["msg"] if errors else str(exc)
        raise EngineError("bad_request", f"{spec.name}: {where or 'arguments'}: {why}") from None
