"""The worker's operations, typed: one argument model and one result model per op, declared once.

Both sides use these declarations. A client sends ``w.request(ops.LOAD, ops.LoadArgs(...))`` and gets a
:class:`LoadResult` back (:meth:`engine_bridge.client.WorkerClient.request`); the worker validates the
arguments with the same model before its handler runs (``engine_bridge.worker.handlers``), and a request
whose arguments do not validate is answered ``bad_request``. Adding an op is one :class:`OpSpec` here (with
its two models) and one handler in the worker, registered under the spec; no client changes.

Nothing here imports llama_cpp. The line format is :mod:`engine_bridge.protocol`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Generic, Literal, NotRequired, TypedDict, TypeVar

import numpy as np
from numpy.typing import NDArray
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from artifacts.drafting import Drafting
from artifacts.engine_params import EngineParams
from engine_bridge.grammar_spec import GrammarSpec
from engine_bridge.sampling import SamplingParams

MAX_TOP_LOGPROBS = 20


def _absolute(path: str) -> str:
    """A model path as the caller meant it: workers run in another directory, so a relative path is made
    absolute where the request is made (an absolute one is unchanged when the worker reads the request)."""
    return str(Path(path).expanduser().absolute())


ModelFile = Annotated[str, AfterValidator(_absolute)]


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Open(BaseModel):
    """A result whose fields are the engine's own report (counters, an OpenAI-shaped reply)."""

    model_config = ConfigDict(frozen=True, extra="allow")


class NoArgs(_Msg):
    """An op without arguments."""


class Empty(_Msg):
    """An op without a result."""


# -- process ----------------------------------------------------------------------------------------
class HelloResult(_Msg):
    protocol: int
    pid: int
    python: str


class Device(_Msg):
    """A ggml backend device as llama.cpp sees it."""

    name: str
    description: str
    kind: str
    memory_free: int
    memory_total: int


class DevicesResult(_Msg):
    devices: list[Device]


# -- one model for measuring (load, then timed_run / greedy / logprobs / chat) ---------------------
class LoadArgs(_Msg):
    model: ModelFile
    params: EngineParams
    vocab_only: bool = Field(False, description="the vocabulary alone (tokenize/detokenize only; params ignored)")


class LoadResult(_Msg):
    load_ms: float
    n_ctx: int
    n_vocab: int


class StructureArgs(_Msg):
    """Arguments of ``check_structure``: the model whose tensors and hyperparameters llama.cpp reads."""

    model: ModelFile


class StructureResult(_Msg):
    problem: str | None = Field(description="why llama.cpp's loader refuses the file (its own words), or None")


class TokenizeArgs(_Msg):
    text: str
    special: bool = Field(True, description="parse control tokens written in the text")
    add_special: bool = Field(False, description="add BOS when the model asks for one (serving engine only)")


class TokenizeResult(_Msg):
    tokens: list[int]


class DetokenizeArgs(_Msg):
    tokens: list[int]
    special: bool = Field(False, description="render control tokens (serving engine only)")


class DetokenizeResult(_Msg):
    text: str


class TimedRunArgs(_Msg):
    prompt: list[int] = Field(min_length=1)
    n_gen: int = Field(ge=0)


class Timing(_Msg):
    """Wall-clock timing of one prompt + generation, with llama.cpp's perf counters beside it."""

    prompt_tokens: int
    prompt_ms: float
    gen_tokens: int
    gen_ms: float
    counter_prompt_tokens: int | None = None
    counter_prompt_ms: float | None = None
    counter_gen_tokens: int | None = None
    counter_gen_ms: float | None = None

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens per second."""
        return self.prompt_tokens / self.prompt_ms * 1e3 if self.prompt_ms > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Generated tokens per second."""
        return self.gen_tokens / self.gen_ms * 1e3 if self.gen_ms > 0 else 0.0


class GreedyArgs(_Msg):
    prompt: list[int] = Field(min_length=1)
    n_gen: int = Field(ge=0)
    stop_eog: bool = True


class GreedyResult(_Msg):
    tokens: list[int]
    text: str


class SpecGreedyArgs(_Msg):
    """Greedy speculative decoding on the loaded model, drafted by another model sharing its tokenizer
    (``draft_model``) or by prompt lookup (``ngram``: the context's last tokens looked up in the context)."""

    prompt: list[int] = Field(min_length=1)
    n_gen: int = Field(ge=1)
    draft_model: ModelFile | None = Field(None, min_length=1, description=(
        "the draft's .gguf (loaded once, kept with the model)"))
    ngram: int = Field(0, ge=0, le=16, description="without a draft model: prompt lookup of this many tokens")
    n_draft: int = Field(4, ge=1, le=64, description="tokens the draft proposes per verification")
    stop_eog: bool = False

    @model_validator(mode="after")
    def _one_drafter(self) -> SpecGreedyArgs:
        if (self.draft_model is None) == (self.ngram == 0):
            raise ValueError("give a draft_model or an ngram length (not both)")
        return self


class SpecGreedyResult(_Msg):
    """The tokens (the loaded model's greedy continuation) and what drafting did."""

    tokens: list[int]
    drafted: int
    accepted: int
    steps: int
    prompt_ms: float
    gen_ms: float


class LogprobsArgs(_Msg):
    prompt: list[int] = Field(min_length=1)
    continuation: list[int]
    out: str = Field(description="an .npy path: the rows are too big for a protocol line")
    threads_file: str | None = Field(None, description=(
        "a file holding the CPU threads to use, read before scoring (engine_bridge.worker.threads)"))


class LogprobsResult(_Msg):
    rows: int
    path: str


class ChatArgs(_Msg):
    messages: list[dict[str, Any]]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0.0)


class ChatResult(_Open):
    """An OpenAI chat completion (``choices``, ``usage``, ...)."""

    choices: list[dict[str, Any]]


# -- the serving engine (serve_load, then generate / cancel / serve_stats) --------------------------
class ServeLoadArgs(_Msg):
    model: ModelFile
    params: EngineParams
    park_bytes: int = Field(0, ge=0, description="host memory for parked conversations' KV cache")
    drafting: Drafting | None = Field(None, description="greedy requests are drafted this way (the plan's draft)")
    routing_every: int = Field(0, ge=0, description=(
        "count a MoE model's expert picks on one decode step in this many (0: never; serve_routing reports them)"))
    routing_window: int = Field(256, ge=1, description="sampled tokens in serve_routing's recent window")


class ServeInfo(_Open):
    n_ctx: int
    n_seq_max: int
    n_vocab: int
    n_ctx_seq_cells: int
    load_ms: float
    model_bytes: int
    park_bytes: int
    bos: int
    eos: int
    eot: int
    add_bos: bool
    max_token_bytes: int


class GenerateArgs(_Msg):
    """The arguments of one ``generate`` request (its events stream before the result)."""

    rid: str = Field(min_length=1, description="request id, unique among running generations; used by cancel")
    prompt: list[int] = Field(min_length=1, description="prompt token ids")
    max_tokens: int = Field(ge=1)
    sampling: SamplingParams = Field(default_factory=SamplingParams, description=(
        "how tokens are drawn (engine_bridge.sampling: llama-server's defaults; GREEDY for measuring)"))
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    conversation: str | None = Field(None, description="an opaque conversation label (reported, not required)")
    progress: bool = Field(False, description="also stream prefill progress events (type 'prefill')")
    grammar: GrammarSpec | None = Field(None, description="constrain the reply to this grammar (GBNF)")


class TopLogprob(TypedDict):
    """One alternative of a token event's ``top_logprobs``."""

    token: int
    text: str
    bytes: list[int]
    logprob: float


class TokenEvent(TypedDict):
    """A ``generate`` stream's token event (a plain dict on the hot path: one per token, not validated twice).
    ``logprob`` and ``top_logprobs`` are filled when the request asked for log-probabilities; ``bytes`` then too."""

    type: Literal["token"]
    token: int
    text: str
    logprob: float | None
    top_logprobs: list[TopLogprob]
    bytes: NotRequired[list[int]]


class PrefillEvent(TypedDict):
    """A ``generate`` stream's prefill progress event (with ``progress``)."""

    type: Literal["prefill"]
    done: int
    total: int


class GenerateResult(_Msg):
    """How a generation ended: why, its token counts and timings, and the bytes of an incomplete UTF-8 character
    the worker's decoder still held (``text_tail``)."""

    finish_reason: Literal["stop", "length", "cancelled"]
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(0, ge=0)
    cached_tokens: int = Field(0, ge=0)
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    text_tail: str = ""


class ResultEvent(TypedDict):
    """A ``generate`` stream's last event, as the clients yield it: the op's result (its own protocol line)."""

    type: Literal["result"]
    result: GenerateResult


GenerateEvent = TokenEvent | PrefillEvent | ResultEvent  # what a client's ``generate`` yields, the result last


class CancelArgs(_Msg):
    rid: str


class CancelResult(_Msg):
    cancelled: bool


class ServeStats(_Open):
    """Counters and memory of the serving engine."""


class ServeRouting(_Msg):
    """The expert picks a serving engine counted on its sampled decode steps (``serve_routing``).

    ``hot``/``picks``: picks of experts with a copy on the plan's device (``EngineParams.expert_split``) and all
    picks, over every layer; ``window_*``: the same over the last ``routing_window`` sampled tokens."""

    architecture: str
    n_layer: int = Field(ge=0)
    n_expert: int = Field(ge=0)
    n_expert_used: int = Field(ge=0)
    every: int = Field(ge=0, description="one decode step in this many is counted (0: counting is off)")
    steps: int = Field(0, ge=0, description="decode steps counted")
    tokens: int = Field(0, ge=0, description="tokens of the counted steps")
    counts: tuple[tuple[int, ...], ...] = Field((), description="[n_layer][n_expert] picks")
    hot: int = Field(0, ge=0)
    picks: int = Field(0, ge=0)
    window_tokens: int = Field(0, ge=0)
    window_hot: int = Field(0, ge=0)
    window_picks: int = Field(0, ge=0)
    error: str | None = Field(None, description="why the counts stopped (an unreadable routing tensor)")


# -- routing traces -------------------------------------------------------------------------------
class RoutingRequest(_Msg):
    """Arguments of the worker op ``routing_counts``."""

    model: ModelFile
    params: EngineParams
    prompts: tuple[tuple[int, ...], ...] = Field(min_length=1, description="token ids of each prompt")
    n_gen: int = Field(0, ge=0, description="greedy tokens decoded after each prompt, counted too")
    threads_file: str | None = Field(None, description=(
        "a file holding the CPU threads to use, read before each batch (engine_bridge.worker.threads)"))


class RoutingCounts(_Msg):
    """How often llama.cpp's router selected each expert of each layer over a workload."""

    architecture: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    n_tokens: int = Field(description="tokens evaluated: every prompt token and every decoded token")
    counts: tuple[tuple[int, ...], ...] = Field(description="[n_layer][n_expert] selections")
    repeats: tuple[int, ...] = Field((), description="[n_layer] picks the same sequence's previous token made too")
    pairs: tuple[int, ...] = Field((), description="[n_layer] (token, previous token) pairs behind repeats")

    def array(self) -> NDArray[np.int64]:
        """The counts as an int64 array [n_layer, n_expert]."""
        return np.asarray(self.counts, dtype=np.int64).reshape(self.n_layer, self.n_expert)

    def repeat_share(self) -> NDArray[np.float64]:
        """Per layer, the share of a token's picks that the previous token picked too (temporal locality: the
        uniform router's share is n_expert_used / n_expert); empty when the trace did not count pairs."""
        pairs = np.asarray(self.pairs, dtype=np.float64)
        return np.asarray(self.repeats, dtype=np.float64) / np.maximum(pairs * self.n_expert_used, 1.0)


# -- the registry -----------------------------------------------------------------------------------
A = TypeVar("A", bound=BaseModel)
R = TypeVar("R", bound=BaseModel)


@dataclass(frozen=True)
class OpSpec(Generic[A, R]):
    """One op: its wire name, argument and result models; ``stream``: events come before the result;
    ``reader``: answered by the worker's reader thread while a serving engine decodes."""

    name: str
    args: type[A]
    result: type[R]
    stream: bool = False
    reader: bool = False


HELLO = OpSpec("hello", NoArgs, HelloResult)
DEVICES = OpSpec("devices", NoArgs, DevicesResult)
LOAD = OpSpec("load", LoadArgs, LoadResult)
CHECK_STRUCTURE = OpSpec("check_structure", StructureArgs, StructureResult)
TOKENIZE = OpSpec("tokenize", TokenizeArgs, TokenizeResult, reader=True)
DETOKENIZE = OpSpec("detokenize", DetokenizeArgs, DetokenizeResult, reader=True)
TIMED_RUN = OpSpec("timed_run", TimedRunArgs, Timing)
GREEDY = OpSpec("greedy", GreedyArgs, GreedyResult)
SPEC_GREEDY = OpSpec("spec_greedy", SpecGreedyArgs, SpecGreedyResult)
LOGPROBS = OpSpec("logprobs", LogprobsArgs, LogprobsResult)
CHAT = OpSpec("chat", ChatArgs, ChatResult)
SERVE_LOAD = OpSpec("serve_load", ServeLoadArgs, ServeInfo)
GENERATE = OpSpec("generate", GenerateArgs, GenerateResult, stream=True)
CANCEL = OpSpec("cancel", CancelArgs, CancelResult)
SERVE_STATS = OpSpec("serve_stats", NoArgs, ServeStats)
ROUTING_COUNTS = OpSpec("routing_counts", RoutingRequest, RoutingCounts)
SERVE_ROUTING = OpSpec("serve_routing", NoArgs, ServeRouting)
ABORT = OpSpec("abort", NoArgs, Empty)
SHUTDOWN = OpSpec("shutdown", NoArgs, Empty)

OPS: dict[str, OpSpec[Any, Any]] = {s.name: s for s in (
    HELLO, DEVICES, LOAD, CHECK_STRUCTURE, TOKENIZE, DETOKENIZE, TIMED_RUN, GREEDY, SPEC_GREEDY, LOGPROBS, CHAT, SERVE_LOAD, GENERATE, CANCEL,
    SERVE_STATS, SERVE_ROUTING, ROUTING_COUNTS, ABORT, SHUTDOWN)}
