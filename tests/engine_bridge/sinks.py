"""A serving engine's sink for tests: what each request streamed and how it ended; and the arguments of a request."""

from __future__ import annotations

from typing import Any

from engine_bridge.sampling import SamplingParams

# top-k, top-p and min-p off: temperature alone draws from the whole vocabulary (rare bytes, EOG tokens, long replies)
WHOLE_VOCABULARY: dict[str, Any] = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}


def gen_args(rid: str, prompt: Any, n: int, **kw: Any) -> dict[str, Any]:
    """A ``generate`` request's arguments as they travel: greedy unless ``kw`` says otherwise (the sampling knobs
    among ``kw``, :class:`SamplingParams`' fields, go into its ``sampling``)."""
    sampling = {"temperature": 0.0} | {k: kw.pop(k) for k in list(kw) if k in SamplingParams.model_fields}
    return {"rid": rid, "prompt": prompt, "max_tokens": n, "sampling": sampling, **kw}


class Recorder:
    """A Sink that keeps each request's tokens, their log-probabilities (when asked for) and its result."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[float | None]] = {}
        self.results: dict[int, dict[str, Any]] = {}

    def event(self, key: int, event: dict[str, Any]) -> None:
        if event["type"] == "token":
            self.tokens.setdefault(key, []).append(event["token"])
            self.logprobs.setdefault(key, []).append(event.get("logprob"))

    def done(self, key: int, result: dict[str, Any]) -> None:
        self.results[key] = result

    def fail(self, key: int, code: str, message: str) -> None:
        self.results[key] = {"error": code, "message": message}
