"""The expert picks a serving engine sees, counted on a sampled share of its decode steps.

The serving context is made with :class:`~engine_bridge.worker.routing.TopkRecorder`'s eval callback, which asks
llama.cpp for nothing (``asking`` False) except on one decode step in ``every``: then it reads every layer's
``ffn_moe_topk-<layer>`` tensor, the kernels' own choice, as a routing trace does. Only steps of decode tokens
alone are sampled: a step that also prefills computes its last layer for the rows it outputs only, so its layers
would count different tokens. Per sampled step the picks of experts with a copy on the plan's device
(``EngineParams.expert_split``) and all picks add up; since every layer routes each token to ``n_expert_used``
experts, their ratio is the mean over layers of each layer's hot share, which is what the plan records
(``Candidate.hot_share``). A window of the last ``window`` sampled tokens keeps the recent share.
"""

from __future__ import annotations

import collections
from typing import Any

import llama_cpp
import numpy as np
from numpy.typing import NDArray

from artifacts.engine_params import EngineParams
from engine_bridge.ops import ServeRouting
from engine_bridge.worker.routing import TopkRecorder, _meta


class _Counts(TopkRecorder):
    """A recorder that counts picks and nothing else (serving needs no per-token pairs)."""

    def _record(self, tensor: int, layer: int) -> None:
        self._count(tensor, layer)


class ServeRoutingCounter:
    """Counts the expert picks of one decode step in ``every`` (see the module docstring)."""

    def __init__(self, every: int, window: int) -> None:
        self.every, self.window = every, window
        self.recorder = _Counts()
        self.recorder.asking = False
        self.arch, self.n_used = "", 0
        self.hot_mask: NDArray[np.bool_] = np.zeros((0, 0), dtype=bool)
        self.steps = self.tokens = self.hot = self.picks = 0
        self._eligible = 0  # decode-only steps seen, sampled or not
        self._before: NDArray[np.int64] | None = None
        self._n_tokens = 0
        self._recent: collections.deque[tuple[int, int, int]] = collections.deque()  # (tokens, hot, picks)

    @property
    def callback(self) -> Any:
        """The ``cb_eval`` to make the serving context with."""
        return self.recorder.callback

    def loaded(self, model: llama_cpp.llama_model_p, params: EngineParams) -> None:
        """Size the counts for the loaded model and mark the experts the plan copied to its device."""
        self.arch = _meta(model, "general.architecture") or ""
        n_expert = int(_meta(model, f"{self.arch}.expert_count") or 0)
        self.n_used = int(_meta(model, f"{self.arch}.expert_used_count") or 0)
        n_layer = int(llama_cpp.llama_model_n_layer(model))
        self.recorder.counts = np.zeros((n_layer, n_expert), dtype=np.int64)
        self.hot_mask = np.zeros((n_layer, n_expert), dtype=bool)
        for h in params.expert_split.layers if params.expert_split else ():
            if h.layer < n_layer:
                self.hot_mask[h.layer, [e for e in h.experts if e < n_expert]] = True
        if n_expert < 1:
            self.every = 0  # a dense model: nothing to count

    def before(self, decode_only: bool, n_tokens: int) -> None:
        """Called before a step's llama_decode: ask for the routing tensors when this step is sampled."""
        self.recorder.asking = False
        if not self.every or not decode_only or self.recorder.error:
            return
        self._eligible += 1
        if self._eligible % self.every == 0:
            self.recorder.asking = True
            self._before = self.recorder.counts.copy()
            self._n_tokens = n_tokens

    def after(self, ok: bool) -> None:
        """Called after the step: add a sampled step's picks (a failed decode counts nothing)."""
        before, self._before = self._before, None
        if not self.recorder.asking or before is None:
            return
        self.recorder.asking = False
        if not ok or self.recorder.error:
            self.recorder.counts[:] = before
            return
        delta = self.recorder.counts - before
        hot, picks = int(delta[self.hot_mask].sum()), int(delta.sum())
        self.steps += 1
        self.tokens += self._n_tokens
        self.hot += hot
        self.picks += picks
        self._recent.append((self._n_tokens, hot, picks))
        while sum(t for t, _, _ in self._recent) - self._recent[0][0] >= self.window:
            self._recent.popleft()

    def report(self) -> ServeRouting:
        """What ``serve_routing`` answers."""
        counts = self.recorder.counts
        n_layer, n_expert = counts.shape
        return ServeRouting(
            architecture=self.arch, n_layer=n_layer, n_expert=n_expert, n_expert_used=self.n_used, every=self.every,
            steps=self.steps, tokens=self.tokens, counts=tuple(tuple(int(x) for x in row) for row in counts),
            hot=self.hot, picks=self.picks, window_tokens=sum(t for t, _, _ in self._recent),
            window_hot=sum(h for _, h, _ in self._recent), window_picks=sum(p for _, _, p in self._recent),
            error=self.recorder.error)
