"""Arrivals statistics: each engine's latency percentiles and throughput, Flux / llama-server ratios, and
the paired bootstrap verdict of one rate (or the chat) as a summary row."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from tasks.bench.record import SummaryRow
from tasks.bench.stats import RatioCI, paired_ratio

PCTS = (50, 95, 99)


def _pct(xs: Sequence[float]) -> dict[str, float | None]:
    return {f"p{p}": float(np.percentile(xs, p)) if len(xs) else None for p in PCTS}


def engine_stats(rows: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """One engine's percentiles over requests of ``kind`` and its throughput (tokens/s of each replay, median)."""
    mine = [r for r in rows if r["kind"] == kind]
    ok = [r for r in mine if not r["error"]]
    replays: dict[tuple[int, float], list[dict[str, Any]]] = {}
    for r in rows:
        if r["kind"] in ("arrival", "chat") and not r["error"]:
            replays.setdefault((r["round"], r["rate_factor"]), []).append(r)
    tps = [sum(r["completion_tokens"] for r in rs) / (max(r["end_s"] for r in rs) - min(r["sent_s"] for r in rs))
           for rs in replays.values()]
    return {"requests": len(mine), "errors": len(mine) - len(ok) + sum(r["kind"] == "start" for r in rows),
            "first_error": next((r["error"] for r in rows if r["error"]), None),
            "ttft_ms": _pct([r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]),
            "itl_ms": _pct([x for r in ok for x in r["itl_ms"]]),
            "tpot_ms": _pct([r["tpot_ms"] for r in ok if r["tpot_ms"] is not None]),
            "throughput_tps": statistics.median(tps) if tps and kind == "arrival" else None}


def _ratios(f: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    """Flux / llama-server of each percentile (below 1: Flux faster) and of throughput (above 1: Flux faster)."""
    out: dict[str, float | None] = {}
    for m in ("ttft_ms", "itl_ms", "tpot_ms"):
        for p in PCTS:
            x, y = f[m][f"p{p}"], b[m][f"p{p}"]
            out[f"{m[:-3]}_p{p}"] = x / y if x and y else None
    x, y = f["throughput_tps"], b["throughput_tps"]
    out["throughput"] = x / y if x and y else None
    return out


def _paired(rows: list[dict[str, Any]], metric: str, kind: str) -> tuple[list[float], list[float]]:
    """(llama-server, flux) values of ``metric`` for the same request (round, rate, index), both without error."""
    by: dict[str, dict[tuple[int, float, int], float]] = {"flux": {}, "llama-server": {}}
    for r in rows:
        if r["kind"] == kind and not r["error"] and r.get(metric) and r["engine"] in by:
            by[r["engine"]][(r["round"], r["rate_factor"], r["index"])] = r[metric]
    keys = sorted(by["flux"].keys() & by["llama-server"].keys())
    return [by["llama-server"][k] for k in keys], [by["flux"][k] for k in keys]


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "—" if x is None else format(x, fmt)


def summary_row(name: str, rows: list[dict[str, Any]], kind: str, n_boot: int, seed: int,
                common: dict[str, Any]) -> SummaryRow:
    """Flux vs llama-server on one rate (or the chat): percentiles, ratios, paired speed ratios, verdict."""
    f = engine_stats([r for r in rows if r["engine"] == "flux"], kind)
    base_rows = [r for r in rows if r["engine"] == "llama-server"]
    b = engine_stats(base_rows, kind) if base_rows else None
    metrics = {**common, "flux": f, "llama-server": b, "flux_over_llama_server": _ratios(f, b) if b else None}
    failed = f"{f['errors']} Flux requests failed ({f['first_error']})" if f["errors"] else ""
    text = (f"TTFT p50 {_f(f['ttft_ms']['p50'])}/{_f(b['ttft_ms']['p50'] if b else None)} ms, ITL p50 "
            f"{_f(f['itl_ms']['p50'])}/{_f(b['itl_ms']['p50'] if b else None)} ms" + (
                f", {_f(f['throughput_tps'])}/{_f(b['throughput_tps'] if b else None)} tok/s" if kind == "arrival" else ""))
    if b is None or b["errors"] and not _paired(rows, "ttft_ms", kind)[0]:
        why = "llama-server is not built (scripts/build-backend.sh)" if b is None else f"llama-server failed: {b['first_error']}"
        return SummaryRow(baseline=name, verdict="fail" if failed else "info", detail=f"{failed or text}; {why}",
                          metrics=metrics)
    ttft: RatioCI = paired_ratio(*_paired(rows, "ttft_ms", kind), n_boot=n_boot, seed=seed)
    dec: RatioCI = paired_ratio(*_paired(rows, "tpot_ms", kind), n_boot=n_boot, seed=seed + 1)
    slower = ttft.outcome == "slower" and dec.outcome == "slower"
    detail = (f"{text} (Flux/llama-server); Flux speed: TTFT {ttft.outcome} {ttft.text()}, decode {dec.outcome} "
              f"{dec.text()}" + (f"; FAIL: {failed}" if failed else "; FAIL: slower on both" if slower else ""))
    return SummaryRow(baseline=name, verdict="fail" if failed or slower else "pass", detail=detail,
                      ratio_prefill=ttft.ratio, ratio_decode=dec.ratio, ci_low=dec.low, ci_high=dec.high,
                      prefill_ci_low=ttft.low, prefill_ci_high=ttft.high, n_samples=min(ttft.n, dec.n),
                      metrics={**metrics, "ttft_speed": ttft.model_dump(), "decode_speed": dec.model_dump()})
