"""A serving engine's sink for tests: what each request streamed and how it ended."""

from __future__ import annotations

from typing import Any


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
