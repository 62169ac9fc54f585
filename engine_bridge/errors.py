"""Typed errors of the engine bridge. ``code`` is stable and travels over the worker protocol."""

from __future__ import annotations

from typing import Literal, get_args

from artifacts.errors import FluxError

# Every code an engine error can carry: the worker's refusals and failures, the client's own (a worker that died,
# timed out or speaks another protocol), and the typed ones below. The server maps each to HTTP once
# (server/errors.py: ENGINE_HTTP); a code the worker sends that is not here arrives as "engine_error".
EngineCode = Literal[
    "bad_request", "bad_params", "bad_override", "bad_grammar", "context_overflow",  # the request or its params
    "busy", "not_loaded",  # not ready for it
    "decode_failed", "sampling_failed", "load_failed", "model_missing", "probe_failed", "validation_failed",
    "routing_unreadable", "routing_mismatch", "expert_split_mismatch", "unknown_op", "internal",  # failures
    "rpc_unavailable",  # an RPC server of the plan does not answer (or the build has no RPC)
    "worker_died", "worker_timeout", "protocol_mismatch", "llama_server", "engine_error",  # the process around it
]
ENGINE_CODES: frozenset[str] = frozenset(get_args(EngineCode))


def engine_code(wire: object) -> EngineCode:
    """A code read from the worker protocol as one of :data:`EngineCode` ("engine_error" when unknown)."""
    return wire if isinstance(wire, str) and wire in ENGINE_CODES else "engine_error"  # type: ignore[return-value]


class EngineError(FluxError):
    """Something the engine refused or failed to do, with a stable machine-readable code."""

    def __init__(self, code: EngineCode, message: str) -> None:
        self.code: EngineCode = code
        self.message = message
        super().__init__(message)


def from_wire(err: dict[str, object]) -> EngineError:
    """The error a worker sent (``{"code", "message"}``); an unknown code keeps its name in the message."""
    wire, message = err.get("code"), str(err.get("message", ""))
    code = engine_code(wire)
    return EngineError(code, message if code != "engine_error" or wire in (None, "engine_error")
                       else f"{message} (worker code {wire})")


class WorkerDied(EngineError):
    """The worker process exited (crash, OOM kill, kill -9) while a call was in flight."""

    def __init__(self, returncode: int | None, detail: str = "") -> None:
        self.returncode = returncode
        msg = f"the engine worker exited (code {returncode})"
        super().__init__("worker_died", msg + (f": {detail}" if detail else ""))


class WorkerTimeout(EngineError):
    """The worker did not answer within its timeout; it has been killed."""

    def __init__(self, op: str, seconds: float) -> None:
        self.op = op
        self.seconds = seconds
        super().__init__("worker_timeout", f"the engine worker did not answer '{op}' within {seconds:g} s")


class ProtocolMismatch(EngineError):
    """The worker speaks another protocol version (a stale install)."""

    def __init__(self, ours: int, theirs: object) -> None:
        super().__init__("protocol_mismatch", f"worker protocol {theirs!r}, server expects {ours}: reinstall Flux")


class ExpertSplitMismatch(EngineError):
    """A plan's expert split does not fit the model file or where its tensors were placed: nothing is loaded."""

    def __init__(self, model: str, reason: str) -> None:
        self.model = model
        self.reason = reason
        super().__init__("expert_split_mismatch",
                         f"{model}: the expert split does not match the model: {reason}; run `flux plan {model} --replan`")


class RoutingMismatch(EngineError):
    """A routing trace recorded for another model, or with another layer or expert count, than the one asked."""

    def __init__(self, what: str, expected: object, got: object) -> None:
        self.what = what
        self.expected = expected
        self.got = got
        super().__init__("routing_mismatch", f"the routing trace is for another model: its {what} is {got!r}, "
                         f"this model's is {expected!r}; record a trace of this model (`routing_counts`)")


class GrammarError(EngineError):
    """A JSON schema (or grammar) that cannot be turned into a decoding constraint; ``where`` names it."""

    def __init__(self, where: str, reason: str) -> None:
        self.where = where
        self.reason = reason
        super().__init__("bad_grammar", f"{where}: {reason}")
