"""The visits of ``flux bench run --via serve`` (tasks/bench/served.py): one contender resident at a time.

A round visits every contender once, in an order that alternates over the rounds (a seeded shuffle, then
reversed on every odd round: ABC, CBA, ABC, ...), so no contender always runs first or last. A visit starts
the contender alone (the one before it stopped and its processes verified gone), reads its GPU memory once
warm, runs one untimed turn of each kind, times :data:`TURNS_PER_VISIT` distinct prompts of each kind, and
stops it. A visit's reading of a turn kind is the median of its timed turns; the plan's and a baseline's
readings of one round pair up.

Why alone: on an H100 with every contender resident, the baselines (16 host threads on 16 cores, experts on
the CPU) decoded 41% slower than each timed alone, and the race printed 3.73x where solo timings gave 2.22x
(docs/benchmarks/race.md). :func:`solo_check` compares a baseline's race reading with a reading of it
started alone outside the race (its sweep probe); more than :data:`AGREE` apart, its row is not a result.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from typing import Any, Literal

import psutil
import pyarrow as pa

from engine_bridge.gpumem import GpuMemoryMeter, tree_pids
from tasks.bench.context import Progress
from tasks.bench.errors import BenchError
from tasks.bench.served_contenders import Contender, Probe, Turn, streamed_completion

GIB = 2**30
AGREE = 0.05  # a baseline's solo and race readings of decode must agree within this, or its row is invalid
# Timed prompts of each turn kind per visit: a visit costs a model load (tens of seconds for a 30B model on a
# GPU host), two turns share it and give a visit's median something to stand on; more rounds, not more turns
# per visit, are what spread the readings over the host's drifts.
TURNS_PER_VISIT = 2
GONE_TIMEOUT_S = 30.0  # a stopped contender's processes must be gone within this (flux serve stops its worker)
TRIAL_SCHEMA = pa.schema([
    ("engine", pa.string()), ("round", pa.int32()), ("visit", pa.int32()), ("turn", pa.int32()),
    ("prompt_index", pa.int32()), ("prompt_tokens", pa.int32()), ("prompt_ms", pa.float64()),
    ("gen_tokens", pa.int32()), ("gen_ms", pa.float64()), ("prefill_tps", pa.float64()),
    ("decode_tps", pa.float64()), ("turn_s", pa.float64()), ("start_s", pa.float64()), ("gpu_bytes", pa.int64()),
    ("error", pa.string()),
    # the server's own timing of the turn where it sends one (llama-server), the context the contender held that
    # visit, and why a turn was not run (its prompt and reply past that context: not held, not a failure)
    ("server_prefill_tps", pa.float64()), ("server_decode_tps", pa.float64()), ("n_ctx", pa.int64()),
    ("not_held", pa.string()),
])
Warmup = Literal["each", "first"]  # a visit's untimed turn: one of each kind, or of the first kind it holds


def visit_order(n: int, rounds: int, seed: int) -> list[list[int]]:
    """The contenders' indexes in each round: a seeded shuffle, reversed on every odd round."""
    first = list(range(n))
    random.Random(seed).shuffle(first)
    return [first if r % 2 == 0 else first[::-1] for r in range(rounds)]


def race_solo(contenders: list[Contender], prompts: dict[str, list[list[int]]], turns: Sequence[Turn],
              rounds: int, timeout_s: float, seed: int, progress: Progress, meter: GpuMemoryMeter | None = None,
              turns_per_visit: int = TURNS_PER_VISIT, gone_timeout_s: float = GONE_TIMEOUT_S,
              warmup: Warmup = "each") -> pa.Table:
    """Every contender visited alone once a round (module docstring); one row per timed turn.

    ``prompts[turn.name][0]`` is the warm-up prompt of every visit (``warmup="first"``: of the first turn kind
    the contender holds only, where a warm-up of every kind would cost as much as the timing, e.g. prompts of
    100k tokens); round ``r`` times ``prompts[turn.name][1 + r * turns_per_visit + k]`` (wrapping around), the
    same prompts for every contender of the round. A turn past the context the started contender holds
    (:meth:`Contender.holds`) is one row a visit saying so (``not_held``), not a failure. A contender that
    fails to start is an error row (turn -1) and is not visited again; ``c.gpu`` ends as the largest of its
    visits' readings. A stopped contender's processes must be gone within ``gone_timeout_s``
    (:func:`stopped_alone`).

    Raises:
        BenchError: too few prompts for one visit, or a stopped contender's process that could not be killed.
    """
    short = [t.name for t in turns if len(prompts[t.name]) < 1 + turns_per_visit]
    if short:
        raise BenchError(f"too few prompts for {', '.join(short)}: a visit needs {1 + turns_per_visit} of each")
    meter = meter or GpuMemoryMeter()
    rows: list[dict[str, Any]] = []
    failed: set[str] = set()
    visit = 0
    for rnd, order in enumerate(visit_order(len(contenders), rounds, seed)):
        for i in order:
            c = contenders[i]
            if c.name in failed:
                continue
            picked = {t.name: [(0, prompts[t.name][0])] + [
                (p, prompts[t.name][p]) for k in range(turns_per_visit)
                for p in [1 + (rnd * turns_per_visit + k) % (len(prompts[t.name]) - 1)]] for t in turns}
            got = _visit(c, rnd, visit, picked, turns, timeout_s, meter, progress, gone_timeout_s, warmup)
            if got and got[0]["turn"] == -1:
                failed.add(c.name)
            rows += got
            visit += 1
        progress(f"round {rnd + 1}/{rounds} done")
    return pa.Table.from_pylist([{f.name: r.get(f.name) for f in TRIAL_SCHEMA} for r in rows], schema=TRIAL_SCHEMA)


def _visit(c: Contender, rnd: int, visit: int, picked: dict[str, list[tuple[int, list[int]]]],
           turns: Sequence[Turn], timeout_s: float, meter: GpuMemoryMeter, progress: Progress,
           gone_timeout_s: float, warmup: Warmup = "each") -> list[dict[str, Any]]:
    """Start ``c`` alone, read its memory once warm, time its turns, stop it and see its processes gone."""
    head: dict[str, Any] = {"engine": c.name, "round": rnd, "visit": visit}
    rows: list[dict[str, Any]] = []
    procs: list[psutil.Process] = []
    try:
        meter.rebase()
        t0 = time.monotonic()
        c.start()
        head.update(start_s=time.monotonic() - t0, n_ctx=c.n_ctx)
        held = [t for t in turns if c.holds(t)]
        for t in held if warmup == "each" else held[:1]:  # warm-up: untimed full-size turns (a cold one runs slow)
            streamed_completion(c.base, picked[t.name][0][1], t.gen, timeout_s)
        reading = meter.read(c.pid)
        if reading is not None and (c.gpu is None or reading.total > c.gpu.total):
            c.gpu = reading
        head["gpu_bytes"] = reading.total if reading else None
        procs = _tree(c.pid)
        rows += [{**head, "turn": j, "prompt_index": picked[t.name][1][0], "not_held": not_held(c, t)}
                 for j, t in enumerate(turns) if not c.holds(t)]
        for k in range(1, len(picked[turns[0].name])):
            for j, t in enumerate(turns):
                index, prompt = picked[t.name][k]
                if c.holds(t):
                    rows.append(_timed_row({**head, "turn": j, "prompt_index": index}, c, prompt, t, timeout_s))
    except Exception as exc:  # noqa: BLE001 - a contender that fails to start is an error row
        rows = [{**head, "turn": -1, "error": f"{type(exc).__name__}: {exc}"[:500]}]
    finally:
        seen = {p.pid for p in procs}
        procs += [p for p in _tree(c.pid) if p.pid not in seen]  # and any child started since
        c.stop()
        stopped_alone(c.name, procs, progress, gone_timeout_s)
    for r in rows:
        if r.get("not_held"):
            progress(f"round {rnd + 1}, {c.name}: {r['not_held']}")
    dec = [r["decode_tps"] for r in rows if r.get("decode_tps") and r["turn"] == 0]
    gpu = f"GPU {(head.get('gpu_bytes') or 0) / GIB:.2f} GiB{f' ({c.gpu.method})' if c.gpu else ''}, "
    progress(f"round {rnd + 1}, {c.name}: " + (rows[0]["error"] if rows and rows[0]["turn"] == -1 else
             f"{gpu}decode {statistics.median(dec) if dec else 0:.1f} tok/s ({c.note})"))
    return rows


def _timed_row(row: dict[str, Any], c: Contender, prompt: list[int], t: Turn, timeout_s: float) -> dict[str, Any]:
    """One timed turn as a row; a failed request is a row with its error (the race goes on)."""
    try:
        tm = streamed_completion(c.base, prompt, t.gen, timeout_s)
    except Exception as exc:  # noqa: BLE001 - one failed request is a row, the race goes on
        return {**row, "error": f"{type(exc).__name__}: {exc}"[:500]}
    srv = tm.server
    return {**row, "prompt_tokens": tm.prompt_tokens, "prompt_ms": tm.prompt_ms, "gen_tokens": tm.gen_tokens,
            "gen_ms": tm.gen_ms, "prefill_tps": tm.prompt_tokens / tm.prompt_ms * 1e3 if tm.prompt_ms else None,
            "decode_tps": tm.gen_tokens / tm.gen_ms * 1e3 if tm.gen_ms else None,
            "turn_s": (tm.prompt_ms + tm.gen_ms) / 1e3,
            "server_prefill_tps": srv.prompt_tokens / srv.prompt_ms * 1e3 if srv and srv.prompt_ms else None,
            "server_decode_tps": srv.gen_tokens / srv.gen_ms * 1e3 if srv and srv.gen_ms and srv.gen_tokens else None}


def not_held(c: Contender, t: Turn) -> str:
    """Why ``t`` was not run on ``c``: its prompt and reply past the context ``c`` holds."""
    return (f"{t.name} not held: {t.prompt:,} prompt + {t.gen} generated tokens, {c.name} holds {c.n_ctx or 0:,} "
            "tokens per sequence")


def _tree(pid: int | None) -> list[psutil.Process]:
    """``pid`` and its descendants as processes (pid reuse cannot fool a later check)."""
    out = []
    for p in tree_pids(pid) if pid else []:
        try:
            out.append(psutil.Process(p))
        except psutil.Error:
            continue  # already gone
    return out


def _alive(procs: Sequence[psutil.Process]) -> list[psutil.Process]:
    """The processes still running (a zombie waiting for a parent that never reaps it counts as gone)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def stopped_alone(name: str, procs: Sequence[psutil.Process], progress: Progress,
                  timeout_s: float = GONE_TIMEOUT_S) -> list[int]:
    """Wait until every process of a stopped contender is gone; kill what outlives ``timeout_s``.

    Returns the pids that had to be killed (a contender whose stop leaves a process behind would run
    beside the next one).

    Raises:
        BenchError: a process that even SIGKILL did not end: the next contender could not run alone.
    """
    deadline = time.monotonic() + timeout_s
    while (left := _alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not left:
        return []
    names = ", ".join(f"{p.pid} ({_name(p)})" for p in left)
    progress(f"{name}: {len(left)} process(es) outlived its stop by {timeout_s:g} s: {names}; killed, so that the "
             "next contender runs alone")
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            continue
    end = time.monotonic() + 10.0
    while (still := _alive(left)) and time.monotonic() < end:
        time.sleep(0.1)
    if still:
        raise BenchError(f"{name}: process(es) {', '.join(str(p.pid) for p in still)} survived SIGKILL: the next "
                         "contender would not run alone; end them and run the bench again")
    return [p.pid for p in left]


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return "?"


# -- readings ----------------------------------------------------------------------------------------
def visit_readings(table: pa.Table, engine: str, turn: int, metric: str) -> dict[int, float]:
    """Round -> the median of ``metric`` over that round's visit of ``engine`` on ``turn``, rounds in order."""
    by: dict[int, list[float]] = {}
    for r in table.to_pylist():
        if r["engine"] == engine and r["turn"] == turn and not r["error"] and r.get(metric):
            by.setdefault(r["round"], []).append(r[metric])
    return {rnd: statistics.median(xs) for rnd, xs in sorted(by.items())}


def medians(table: pa.Table, engine: str, turn: int) -> dict[str, float]:
    """The race reading of one engine on one turn: the median over its visits of each visit's median."""
    out = {}
    for k in ("prefill_tps", "decode_tps", "turn_s"):
        xs = list(visit_readings(table, engine, turn, k).values())
        if xs:
            out[k] = statistics.median(xs)
    return out


def probe_decode(probe: Probe | None) -> float | None:
    """A sweep probe's decode tokens per second, ``None`` when it did not run."""
    t = probe.timing if probe is not None else None
    return t.gen_tokens / t.gen_ms * 1e3 if t is not None and t.gen_ms and t.gen_tokens else None


def solo_check(name: str, probe: Probe | None, table: pa.Table, turn: int = 0) -> dict[str, Any]:
    """A baseline's solo reading of decode (turn kind ``turn``, the first by default) beside its race reading, and
    whether they agree.

    The solo reading is the sweep's probe of the same configuration (started alone, one warm turn). A
    baseline without a probe (``fit``: nothing sweeps it) has its first visit as the solo reading, compared
    with the median of its later visits (with one visit there is nothing to compare). ``invalid`` says why
    the row cannot stand when the two are more than :data:`AGREE` apart: something else ran during one of
    them, or the host changed between them, and nothing tells which reading is the true one.
    """
    visits = visit_readings(table, name, turn, "decode_tps")
    race = statistics.median(visits.values()) if visits else None
    solo, against = probe_decode(probe), race
    source = "sweep probe (started alone before the race, one warm turn)"
    if solo is None:
        later = list(visits.values())[1:]
        solo = next(iter(visits.values()), None)
        against = statistics.median(later) if later else None
        source = ("first visit (no sweep times this baseline alone), against the median of its later visits"
                  if later else "first visit (no sweep times this baseline alone); no later visit to compare")
    diff = abs(solo - against) / against if solo and against else None
    invalid = None
    if diff is not None and solo is not None and against is not None and diff > AGREE:
        invalid = (f"{name}'s solo decode reading {solo:.1f} tok/s ({source}) and its race reading {against:.1f} "
                   f"are {diff:.0%} apart (more than {AGREE:.0%}): something else ran during one of them or the "
                   "host changed between them; no ratio of it is a result, run again on a quiet host")
    return {"solo_decode_tps": solo, "race_decode_tps": race, "race_visits_decode_tps": list(visits.values()),
            "solo_source": source, "solo_vs_race": diff, "invalid": invalid,
            "sweep_vs_race": diff if probe_decode(probe) is not None else None}
