"""What one soak request's client saw, reduced to an outcome and its reason, and whether an injected
worker kill was recovered from (``flux bench soak``).

Pure: it reads :class:`~tasks.bench.http.Exchange` records (the request, its resume, the journal's
replay) and the soak's rows, and never touches the network.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal

from tasks.bench.http import Exchange, Outcome, error_body, finish_reason, json_object
from tasks.bench.record import SummaryRow


def _ids_problem(events: list[tuple[int | None, str]], start: int) -> str | None:
    ids = [i for i, _ in events]
    want = list(range(start, start + len(ids)))
    return None if ids == want else f"event ids {ids[:8]}... where {want[:8]}... were due (missed or repeated)"


def _resumed(first: Exchange, resume: Exchange, replay: Exchange | None, cancel: bool) -> tuple[Outcome, str]:
    """The outcome of a stream that ended early and was read again from its last event."""
    if resume.hung or (replay is not None and replay.hung):
        return "hung", "the resume got no byte within the hang timeout"
    if resume.status != 200:
        code = (error_body(resume) or {}).get("code")
        return "lost", f"resume after event {len(first.events)} answered HTTP {resume.status} ({code})"
    problem = _ids_problem(resume.events, len(first.events) + 1) or (
        None if resume.done else f"the resume ended without [DONE] ({resume.transport})")
    if problem is None and replay is not None and [d for _, d in replay.events] != [
            d for _, d in first.events + resume.events]:
        problem = "the journal replayed from event 0 differs from what the client was sent"
    if problem:
        return "lost", problem
    err, reason = error_body(resume), finish_reason(resume.events)
    if cancel:
        if err is not None:
            return "errored", f"ended with error {err.get('code')}"
        return ("cancelled" if reason == "cancelled" else "completed"), f"server ended it: finish_reason {reason}"
    how = f"error {err.get('code')}" if err else f"finish_reason {reason}"
    return "resumed", f"{len(resume.events)} events after event {len(first.events)}, each once; {how}"


def classify(first: Exchange, resume: Exchange | None, replay: Exchange | None, cancel: bool) -> tuple[Outcome, str]:
    """One request's outcome and why, from what the client saw (and its resume, if it resumed).

    Args:
        first: The request itself.
        resume: ``GET events?after=<last seen>`` when the first answer ended without ``[DONE]``.
        replay: ``GET events?after=0`` (the whole journal), to check the resume against it.
        cancel: The client closed the stream on purpose and only checks that the server ended it.
    """
    if first.hung:
        return "hung", "no byte within the hang timeout"
    if first.status is not None and first.status != 200:
        err = error_body(first)
        if err is None:
            return "lost", f"HTTP {first.status} without an OpenAI error body"
        retry = f", Retry-After {first.retry_after}" if first.retry_after else ""
        return "errored", f"HTTP {first.status} {err.get('code')}{retry}"
    if first.status == 200 and not first.sse and first.transport is None:
        err = error_body(first)
        if err is not None:
            return "errored", f"error {err.get('code')} in a 200 body"
        return ("completed", "") if json_object(first.body).get("choices") else ("lost", "200 without choices")
    problem = _ids_problem(first.events, 1)
    if problem:
        return "lost", problem
    if first.done:
        err = error_body(first)
        return ("errored", f"stream ended with error {err.get('code')}") if err else ("completed", "")
    if resume is None:
        return "lost", first.transport or "the stream ended without [DONE]"
    return _resumed(first, resume, replay, cancel)


@dataclass
class Fault:
    """One injected worker kill and whether the server got a new worker afterwards."""

    kind: Literal["kill-idle", "kill-mid"]
    wave: int
    pid: int | None = None
    new_pid: int | None = None
    recover_s: float | None = None
    error: str | None = None
    watcher: asyncio.Task[None] | None = None


def fault_row(f: Fault, rows: list[dict[str, Any]], common: dict[str, Any]) -> SummaryRow:
    """A kill passes when a new worker came up, and (mid-request) the request under it ended explicitly."""
    metrics = {**common, "pid": f.pid, "new_pid": f.new_pid, "recover_s": f.recover_s, "wave": f.wave}
    name = f"fault:{f.kind}"
    if f.error:
        return SummaryRow(baseline=name, verdict="fail", detail=f.error, metrics=metrics)
    back = f"worker {f.pid} killed; new worker {f.new_pid} up after {f.recover_s:.1f} s" if f.new_pid \
        else f"worker {f.pid} killed; no new worker came up"
    if f.kind == "kill-idle":  # the worker was idle: a request should wait for its successor, not fail
        died = [r["index"] for r in rows if r["wave"] == f.wave and r.get("error_code") == "worker_died"]
        metrics["worker_died_requests"] = died
        back += f"; {len(died)} requests sent after the kill got worker_died" if died else ""
    victim = next((r for r in rows if r["behavior"] == "victim"), None) if f.kind == "kill-mid" else None
    ok = f.new_pid is not None
    if victim is not None:
        metrics["victim"] = {k: victim.get(k) for k in ("rid", "outcome", "error_code", "detail")}
        ok = ok and victim["outcome"] in ("errored", "resumed") and bool(victim.get("error_code"))
        back += f"; the request under it: {victim['outcome']} ({victim.get('error_code')})"
    return SummaryRow(baseline=name, verdict="pass" if ok else "fail", detail=back, metrics=metrics)
