"""Drafting settings (speculative decoding) and the prompt-lookup proposer, shared by planning and serving.

A :class:`Drafting` says how a plan drafts tokens for greedy decoding: ``model`` (a separate draft model sharing
the target's vocabulary), ``ngram`` (prompt lookup: the tokens that followed the last time the context's last
``ngram`` tokens appeared) or ``mtp`` (next-token heads, the model's own or grafted from a file of their own:
on llama-server only); the first two run in Flux's worker and on llama-server alike
(:meth:`Drafting.server_args`). The target verifies every proposal, so the output is its greedy output either
way; drafting only changes how many target steps it takes.

The pinned llama.cpp has n-gram drafting only in its ``common`` library (``common/ngram-*.cpp``,
``common/speculative.cpp``), which llama-server uses and llama-cpp-python does not bind; :func:`ngram_proposals`
is the same simple lookup, run in the worker's loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from artifacts.engine_params import EngineParams

DraftKind = Literal["model", "ngram", "mtp"]
NGRAM_MIN = 2  # the shortest key prompt lookup matches: a single token repeats too often to predict much


class Drafting(BaseModel):
    """How a plan drafts (its candidate's ``draft``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: DraftKind
    model: str | None = Field(None, description=(
        "the draft model's .gguf (kind 'model'), or next-token heads grafted onto the model (kind 'mtp')"))
    model_hash: str | None = Field(None, description="content hash of that file")
    n_draft: int = Field(4, ge=1, le=32, description="tokens proposed per verification step")
    ngram: int = Field(3, ge=1, le=16, description="context tokens a lookup matches (kind 'ngram')")

    @property
    def label(self) -> str:
        """The suffix of a drafting candidate's id (``c3+draft``, ``c3+ngram``, ``c3@llama-server+mtp``)."""
        return "draft" if self.kind == "model" else self.kind

    def server_args(self, target: EngineParams | None = None) -> list[str]:
        """llama-server's flags for this drafting, the same drafting Flux's worker does: the draft model's greedy
        tokens (``--spec-type draft-simple``, every proposal kept whatever the draft's confidence, the whole
        draft on the GPU when ``target`` uses one), prompt lookup (``ngram-simple``: the ``n_draft`` tokens that
        followed the context's last ``ngram`` tokens), or next-token (MTP) heads (``draft-mtp``: the model's own,
        or ``model``'s grafted onto it)."""
        n = ["--spec-draft-n-max", str(self.n_draft)]
        gpu = ["-ngld", "all"] if target is not None and target.n_gpu_layers else []
        if self.kind == "mtp":  # the model's own block, or one grafted from a file of its own
            return ["--spec-type", "draft-mtp", *n, *(["-md", self.model, *gpu] if self.model else [])]
        if self.kind == "ngram":
            return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(self.ngram),
                    "--spec-ngram-simple-size-m", str(self.n_draft), "--spec-ngram-simple-min-hits", "1"]
        return ["--spec-type", "draft-simple", "-md", str(self.model), *n, "--spec-draft-p-min", "0", *gpu]


def draft_params(target: EngineParams) -> EngineParams:
    """The draft model's parameters beside ``target``: its context, batch and threads, the whole draft on the
    target's main GPU when the target uses one (a draft is small), none of the target's per-tensor placement."""
    return EngineParams(n_ctx=target.n_ctx, n_seq_max=target.n_seq_max, n_batch=target.n_batch,
                        n_ubatch=target.n_ubatch, n_threads=target.n_threads, n_threads_batch=target.n_threads_batch,
                        n_gpu_layers=-1 if target.n_gpu_layers else 0, main_gpu=target.main_gpu, split_mode="none",
                        flash_attn=target.flash_attn, load_mode=target.load_mode, seed=target.seed)


def ngram_proposals(history: Sequence[int], n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``history``'s last ``n`` tokens
    (down to :data:`NGRAM_MIN` tokens when the longer key never occurred before); empty when none did."""
    for size in range(min(n, len(history) - 1), NGRAM_MIN - 1, -1):
        key = list(history[-size:])
        first = key[0]
        for start in range(len(history) - size - 1, -1, -1):
            if history[start] == first and list(history[start:start + size]) == key:
                return [int(t) for t in history[start + size:start + size + k]]
    return []
