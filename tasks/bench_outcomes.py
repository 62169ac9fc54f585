"""What one soak request's client saw, reduced to an outcome and its reason (``flux bench soak``).

Pure: it reads :class:`~tasks.bench_http.Exchange` records (the request, its resume, the journal's
replay) and never touches the network.
"""

from __future__ import annotations

from tasks.bench_http import Exchange, Outcome, error_body, finish_reason, json_object


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
