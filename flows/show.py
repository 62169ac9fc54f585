"""How a plan reads to a person: `flux show`, `flux plans`, and the Prefect plan artifact."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from rich import box
from rich.console import Console
from rich.table import Table

from artifacts.logs import console
from artifacts.records.evidence import MeasureSummary
from artifacts.records.kinds import TRIALS_TABLE
from artifacts.records.plan import Plan, StorageStreaming
from artifacts.records.search import Prediction
from artifacts.store import Store
from flows.fit import first_fitting, whole_table

if TYPE_CHECKING:
    import pyarrow as pa

GIB = 2**30


def _placement_lines(plan: Plan) -> list[str]:
    c = plan.candidate
    p = c.placement
    where = "RPC servers' devices" if c.params.rpc_servers else "GPU"
    lines = [f"family {c.family}; layers on {where} {p.gpu_layers()}/{len(p.layer_device)}; output on {p.output_device}"]
    if p.expert_device:
        parts: dict[str, int] = {}
        for ex in p.expert_device:
            for part, dev in ex.items():
                if dev != "CPU":
                    parts[part] = parts.get(part, 0) + 1
        lines.append("expert tensors on GPU: " + (", ".join(f"{k} {v}/{len(p.expert_device)}" for k, v in sorted(parts.items())) or "none"))
    split = c.params.expert_split
    if split is not None:
        n_hot = sum(len(h.experts) for h in split.layers)
        share = sum(c.hot_share) / max(1, len(c.hot_share))
        lines.append(f"per-expert split: {n_hot} experts of {len(split.layers)} layers copied to "
                     f"{', '.join(sorted({h.device for h in split.layers}))}, taking {share:.0%} of the picks "
                     + ("(the rest read by the GPU from pinned host memory at decode: FLUX_MOE_MAPPED; the whole "
                        "expert tensors stay on the host)" if c.params.expert_mapped else
                        "(the rest on the host; the whole expert tensors stay there)"))
    if plan.routing_coverage:
        lines.append("routing (trace " + (plan.routing_trace or "?")[:12] + "): each layer's busiest " + ", ".join(
            f"{k} of experts take {v:.0%}" for k, v in plan.routing_coverage.items()) + " of its picks"
            + (f"; {plan.routing_repeat:.0%} of a token's picks are the previous token's" if plan.routing_repeat
               is not None else "") + " (median)")
    if plan.routing_shift:  # --domains TRACE:MEASURE
        lines.append(f"GPU copies' share of the picks (--domains {plan.request.domains}): "
                     f"{plan.routing_shift['trace']:.0%} on the traced traffic, {plan.routing_shift['measured']:.0%} on the "
                     "measured rounds'")
    lines.append(kv_line(plan))
    # llama-server's flags: its -c is the whole context, split among -np slots (a plan's n_ctx is per sequence)
    lines.append("llama.cpp flags: " + " ".join(c.params.server_args()))
    return lines


def kv_line(plan: Plan) -> str:
    """Where the plan's KV cache lives, and for how many tokens."""
    c = plan.candidate
    total = sum(c.kv_bytes.values())
    where = ", ".join(f"{d} {b / GIB:.2f} GiB" for d, b in sorted(c.kv_bytes.items()) if b) or "none"
    w = c.params.kv_vram_cells
    mode = (f"each layer's first {w} cells on the GPU, every cell in pinned host memory the GPU reads past them"
            if w else "every layer's with its attention on the GPU" if c.params.offload_kqv and c.params.n_gpu_layers > len(
        c.placement.layer_device) else "on the host (attention computed by the CPU)" if not c.params.offload_kqv or
        not c.placement.gpus() else f"the {c.params.n_gpu_layers - 1} offloaded layers' on "
        f"{'their remote devices' if c.params.rpc_servers else 'the GPU'}, the rest on the host")
    return (f"KV cache: {total / GIB:.2f} GiB for {c.params.n_ctx} tokens x {c.params.n_seq_max} sequence(s), "
            f"{c.params.type_k}: {where} ({mode})")


def ranking_line(plan: Plan) -> str:
    """What the finalists were ranked on, with the winner's time and spread."""
    m = plan.measured
    work = (f"{len(plan.workload_lengths)} prompts of {'/'.join(map(str, plan.workload_lengths))} tokens + "
            f"{plan.workload_n_gen} generated each" if plan.workload_lengths else "the measurement prompts")
    spread = f" (spread {m.workload_iqr:.2f} s over {m.n_rounds} rounds)" if m.workload_iqr is not None else \
        f" ({m.n_rounds or 1} round: no spread)"
    return f"ranked by the workload's time, one round of {work}: chosen {m.candidate_id} {m.workload_s or 0:.2f} s{spread}"


def depth_line(plan: Plan) -> str | None:
    """What a deep conversation costs: measured decode speed by context depth."""
    if len(plan.decode_by_depth) < 2:
        return None
    pairs = sorted(plan.decode_by_depth)
    (d0, v0), (d1, v1) = pairs[0], pairs[-1]
    return ("decode by context depth (measured): " + ", ".join(f"{d}: {v:.1f}" for d, v in pairs)
            + f" tok/s; at {d1} tokens {v1 / v0:.0%} of the speed at {d0}")


def plan_trials(data_dir: Path, plan: Plan) -> pa.Table | None:
    """The plan's measured trials (one row per finalist, round and prompt), None where the store lacks them."""
    store = Store(data_dir)
    return store.get_table(TRIALS_TABLE, plan.trials_table) if store.has(TRIALS_TABLE, plan.trials_table) else None


def prefill_by_length(trials: pa.Table, candidate_id: str) -> list[tuple[int, float]]:
    """A candidate's median measured prefill speed (each trial's prompt tokens over its prompt time) by prompt length."""
    by: dict[int, list[float]] = {}
    for r in trials.select(["candidate_id", "prompt_tokens", "prompt_ms", "error"]).to_pylist():
        if r["candidate_id"] == candidate_id and not r["error"] and r["prompt_ms"] and r["prompt_tokens"]:
            by.setdefault(int(r["prompt_tokens"]), []).append(r["prompt_tokens"] / r["prompt_ms"] * 1e3)
    return [(n, statistics.median(v)) for n, v in sorted(by.items())]


def prefill_line(plan: Plan, trials: pa.Table | None) -> str | None:
    """What a long prompt costs (a coding agent's wait): the chosen plan's measured prefill speed by prompt length,
    at its micro-batch, and how long its longest prompt took."""
    pairs = prefill_by_length(trials, plan.candidate.id) if trials is not None else []
    if not pairs:
        return None
    n, tps = pairs[-1]
    return (f"prefill by prompt length (measured, -ub {plan.candidate.params.n_ubatch}): "
            + ", ".join(f"{k}: {v:.0f}" for k, v in pairs) + f" tok/s; a {n}-token prompt took {n / tps:.2f} s")


def _spread(lo: float | None, rounds: int = 0) -> str:
    """The spread and which statistic it is (measure._iqr: the IQR from 4 rounds, the full range under 4)."""
    if lo is None:
        return " (one round: no spread)"
    return f" (spread {lo:.1f}: {'IQR over' if rounds >= 4 else 'range of'} {rounds} rounds)"


def _paired(plan: Plan) -> list[tuple[MeasureSummary, Prediction | None]]:
    """Each measured finalist with the cost model's prediction for it, matched by candidate id (the finalists
    are listed as measured, the predictions as pruned; a finalist timed on another engine, ``c028@llama-server``,
    has its placement's prediction)."""
    preds = {p.candidate_id: p for p in plan.predictions}
    return [(s, preds.get(s.candidate_id) or preds.get(s.candidate_id.split("@")[0])) for s in plan.finalists]


def speculation_lines(plan: Plan) -> list[str]:
    """Each drafting candidate's acceptance and speed-up over its placement without drafting (--speculation)."""
    d = plan.candidate.draft
    how = ("" if d is None else f" with {d.model}" if d.kind == "model" else f", {d.ngram}-token lookup"
           if d.kind == "ngram" else f" (next-token heads grafted from {d.model})" if d.model
           else " (the model's own next-token heads)")
    head = [f"drafting: {d.kind}{how}, {d.n_draft} tokens per step (greedy requests)"] if d is not None else []
    return head + [
        f"speculation {t.candidate_id}: "
        + (f"acceptance {t.acceptance:.0%}, " if t.acceptance is not None else
           "no token proposed, " if t.proposed == 0 else "acceptance ?, ")
        + f"speedup {'?' if t.speedup is None else f'{t.speedup:.2f}x'}"
        + (f" (95% CI {t.speedup_ci[0]:.2f}-{t.speedup_ci[1]:.2f})" if t.speedup_ci else "")
        + f" over {t.base_id}: decode {t.base_decode_tps or 0:.1f} -> {t.decode_tps or 0:.1f} tok/s"
        for t in plan.speculation]


def serving_lines(plan: Plan) -> list[str]:
    """The serving curve (--serving-p95-ms): aggregate tok/s and per-token latency by sequences served at once."""
    s = plan.serving
    if s is None:
        return []
    head = (f"serving curve of {s.candidate_id} (--serving-p95-ms {s.p95_ms:g}): serves {plan.sequences} "
            f"sequence(s){'' if s.met else ', none met the limit'}")
    rows = [f"  {p.sequences:>3} at once: " + (f"error: {p.error}" if p.error else
                                                f"{p.aggregate_tps or 0:.1f} tok/s, p95 {p.p95_token_ms or 0:.1f} ms"
                                                f"/token (p50 {p.p50_token_ms or 0:.1f})")
            + ("  <- served" if p.sequences == plan.sequences and not p.error else "") for p in s.curve]
    return [head, *rows]


def _rate(p: Prediction | None, field: str) -> str:
    return "" if p is None else f"{getattr(p, field):.1f}"


def plan_markdown(plan: Plan) -> str:
    """The plan as markdown (Prefect artifact, docs)."""
    m, v = plan.measured, plan.validation
    rows = "\n".join(
        f"| {s.candidate_id}{' (chosen)' if s.candidate_id == plan.candidate.id else ''} | {_num(s.workload_s, 2)} | "
        f"{'' if s.workload_iqr is None else f'{s.workload_iqr:.2f}'} | {_num(s.prefill_tps, 1)} | "
        f"{_num(s.decode_tps, 1)} | {_rate(p, 'prefill_tps')} | {_rate(p, 'decode_tps')} | {s.error or ''} |"
        for s, p in _paired(plan))
    return (f"# Plan {plan.id[:12]}\n\nModel **{plan.model_name}** ({plan.model_hash[:12]}), hardware "
            f"{plan.hardware_fingerprint[:12]}, backend {plan.backend_build}\n\n"
            + "\n".join(f"- {x}" for x in _placement_lines(plan))
            + f"\n- measured: prefill {m.prefill_tps or 0:.1f} tok/s, decode {m.decode_tps or 0:.1f} tok/s"
            f"\n- {ranking_line(plan)}"
            f"\n- quality vs reference: mean KL {v.mean_kl:.2e}, top-1 {v.top1_agreement:.3f} ({plan.quality_profile})"
            + "".join(f"\n- note: {n}" for n in plan.notes)
            + "\n\n| candidate | workload s | spread s | prefill tok/s | decode tok/s | predicted prefill | "
            "predicted decode | error |\n|---|---:|---:|---:|---:|---:|---:|---|\n" + rows + "\n")


def streaming_line(s: StorageStreaming, decode_tps: float | None) -> str:
    """The drive's decode limit of a plan that reads weights from it, beside the decode measured."""
    measured = f"measured decode {decode_tps:.2f} tok/s" if decode_tps else "decode not measured"
    share = f" ({decode_tps / s.decode_limit_tps:.0%} of it)" if decode_tps and s.decode_limit_tps else ""
    return (f"storage streaming: {s.weights_bytes / GIB:.2f} GiB of mapped weights, {s.ram_for_weights / GIB:.2f} "
            f"GiB of RAM left to them; {s.limit_words()}; {measured}{share}")


def print_plan(plan: Plan, con: Console | None = None, reserve_percent: float = 10.0,
               trials: pa.Table | None = None, data_dir: Path | None = None, kv_host_bytes: int | None = None) -> None:
    """`flux show`: placement, measured speeds with spread, decode by depth and (given the plan's ``trials``,
    :func:`plan_trials`) prefill by prompt length, predicted vs measured, roofline, budgets, key
    (``reserve_percent``: the host reserve `flux serve` leaves, for the page budgets; ``data_dir``: the store
    whose probe of the plan's machine estimates the host's KV pages; ``kv_host_bytes``: ``serve.kv_host_bytes``)."""
    from flows.page_budgets import kv_pages_line, page_budget_line, probe_report
    from server.chat import template_line
    from server.kv_pages import park_budget

    con = con or console()
    m, v, r = plan.measured, plan.validation, plan.request
    con.print(f"[bold]plan {plan.id}[/]  created {plan.created_at}")
    con.print(f"model {plan.model_name}  {plan.model_path}")
    con.print(template_line(Path(plan.model_path)), markup=False)
    con.print(f"request: ctx {plan.candidate.params.n_ctx}, concurrency {r.concurrency}, kv {r.kv}, "
              f"budget {r.budget_s:.0f} s; quality profile {plan.quality_profile}")
    con.print(f"workload mix: {r.workload}, {plan.workload_prefill_share:.0%} prefill tokens" + (
        f"; --domains {r.domains} (the routing trace on the first, the measured rounds on the last)" if r.domains else ""))
    for line in _placement_lines(plan):
        con.print("  " + line, markup=False)
    con.print(f"measured: prefill {m.prefill_tps or 0:.1f} tok/s{_spread(m.prefill_iqr, m.n_rounds)}, decode "
              f"{m.decode_tps or 0:.1f} tok/s{_spread(m.decode_iqr, m.n_rounds)} over {m.n_rounds or m.n_trials} rounds")
    if plan.storage_streaming is not None:
        con.print(streaming_line(plan.storage_streaming, m.decode_tps), markup=False, soft_wrap=True)
    con.print(ranking_line(plan))
    for measured in (prefill_line(plan, trials), depth_line(plan)):
        if measured:
            con.print(measured, markup=False)
    if plan.roofline_decode_tps and m.decode_tps:
        con.print(f"roofline: decode bound {plan.roofline_decode_tps:.1f} tok/s (each device's bytes per token under "
                  f"this placement and split / its bandwidth): {m.decode_tps / plan.roofline_decode_tps:.0%} of it")
    ceiling = plan.all_gpu_decode
    if ceiling and m.decode_tps:
        tps = float(ceiling["decode_tps"])
        con.print(f"practical ceiling: the whole model on {ceiling['device']} decodes {tps:.1f} tok/s (the probe, same "
                  f"engine and build): this plan {m.decode_tps / tps:.0%} of it")
    con.print(f"quality vs reference: mean KL {v.mean_kl:.2e}, max {v.max_kl:.2e}, top-1 {v.top1_agreement:.3f} "
              f"over {v.n_tokens} tokens" + (f" (limits: mean KL {plan.kl_limit:.2e}, top-1 {plan.top1_limit:.3f}, "
                                             "from the noise floor of correct kernels)" if plan.kl_limit is not None
                                             and plan.top1_limit is not None else ""))
    for line in [*speculation_lines(plan), *serving_lines(plan)]:
        con.print(line, markup=False)
    for note in plan.notes:
        con.print(f"note: {note}", markup=False)
    print_finalists(plan, con)
    if plan.stage_seconds:
        order = ("probe", "route", "enumerate", "prune", "reference", "measure", "validate", "total")
        stages = sorted(plan.stage_seconds.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 99)
        con.print("planning: " + ", ".join(f"{k} {v:.0f} s" for k, v in stages))
    if plan.median_prediction_error is not None:
        con.print(f"cost model median error (workload time): {plan.median_prediction_error:.0%}")
    con.print("memory budget: " + ", ".join(f"{d} {b / GIB:.1f} GiB" for d, b in plan.memory_budget.items())
              + "; chosen uses " + ", ".join(f"{d} {b / GIB:.2f} GiB weights" for d, b in plan.candidate.weights_bytes.items()))
    con.print(page_budget_line(plan, reserve_percent, park_budget(reserve_percent)), markup=False)
    con.print(kv_pages_line(plan, reserve_percent, probe_report(data_dir, plan), kv_host_bytes), markup=False)
    if plan.measured.gpu_bytes:
        con.print(f"measured GPU memory of the chosen plan (NVML, after its runs, {plan.measured.gpu_method or 'per-process'}"
                  f"): {plan.measured.gpu_bytes / GIB:.2f} GiB")
    con.print(f"key: model {plan.model_hash[:16]}, hardware {plan.hardware_fingerprint[:16]}, backend "
              f"{plan.backend_build}, driver {plan.driver or 'none'}")


def _gib(n: int | None) -> str:
    return f"{n / GIB:.2f}" if n else ""


def _narrow_box(narrow: bool) -> dict[str, Any]:
    """A narrow layout's table: columns apart by two spaces, no rules between them (a character each)."""
    return {"box": box.SIMPLE_HEAD, "pad_edge": False, "collapse_padding": True} if narrow else {}


def _num(x: float | None, digits: int) -> str:
    """A measured figure, or a dash where the finalist was not measured (never 0.00)."""
    return "-" if x is None else f"{x:.{digits}f}"


ERROR_WIDTH = 30  # an error beside its row wraps in lines of at least this many characters, or moves under the table


class FinalistsLayout(NamedTuple):
    """How much of the finalists' table a width holds; what a narrower layout leaves out is printed below it."""

    short_headers: bool  # two-line headers ("pred" over "prefill")
    errors_inline: bool  # else each error is a line under the table, whole
    gpu: Literal["all", "measured", "none"]  # the GPU memory columns: always, when a finalist has a figure, never
    spread_rounds: bool


# richest first: the first that fits the console is printed (flows.fit)
FINALISTS_LAYOUTS = (FinalistsLayout(False, True, "all", True), FinalistsLayout(True, False, "measured", True),
                     FinalistsLayout(True, False, "none", True), FinalistsLayout(True, False, "none", False))


def _finalist_columns(plan: Plan, lay: FinalistsLayout) -> list[tuple[str, str, Callable[[MeasureSummary,
                                                                                          Prediction | None], str]]]:
    """(header, short header, cell) of each column ``lay`` shows."""
    gpu = lay.gpu == "all" or (lay.gpu == "measured" and any(s.gpu_bytes or s.predicted_gpu_bytes for s in plan.finalists))
    chosen = plan.candidate.id
    cols: list[tuple[str, str, Callable[[MeasureSummary, Prediction | None], str]]] = [
        ("candidate", "candidate", lambda s, p: s.candidate_id + ("*" if s.candidate_id == chosen else "")),
        ("workload s", "workload\ns", lambda s, p: _num(s.workload_s, 2)),
        ("spread", "spread\ns", lambda s, p: "" if s.workload_iqr is None else f"{s.workload_iqr:.2f}"),
        ("pred prefill", "pred\nprefill", lambda s, p: _rate(p, "prefill_tps")),
        ("meas prefill", "meas\nprefill", lambda s, p: _num(s.prefill_tps, 1)),
        ("pred decode", "pred\ndecode", lambda s, p: _rate(p, "decode_tps")),
        ("meas decode", "meas\ndecode", lambda s, p: _num(s.decode_tps, 1)),
        ("pred GPU GiB", "pred GPU\nGiB", lambda s, p: _gib(s.predicted_gpu_bytes)),
        ("meas GPU GiB", "meas GPU\nGiB", lambda s, p: _gib(s.gpu_bytes)),
        ("rounds", "rounds", lambda s, p: str(s.n_rounds)),
        ("error", "error", lambda s, p: s.error or ""),
    ]
    drop = ({"pred GPU GiB", "meas GPU GiB"} if not gpu else set()) | (set() if lay.errors_inline else {"error"}) | (
        set() if lay.spread_rounds else {"spread", "rounds"})
    return [c for c in cols if c[0] not in drop]


def finalists_table(plan: Plan, lay: FinalistsLayout) -> Table:
    """The finalists' predicted and measured figures in layout ``lay``."""
    cols = _finalist_columns(plan, lay)
    heads = [short if lay.short_headers else name for name, short, _ in cols]
    return whole_table(heads, [[cell(s, p) for _, _, cell in cols] for s, p in _paired(plan)], left=("candidate", "error"),
                       wraps={"error": ERROR_WIDTH}, title="finalists: predicted vs measured", show_edge=False,
                       **_narrow_box(lay.short_headers))


def finalists_below(plan: Plan, lay: FinalistsLayout) -> list[str]:
    """What ``lay`` leaves out of the table, as lines under it: each error whole, GPU memory, spread and rounds."""
    pairs = [s for s, _ in _paired(plan)]
    lines = [] if lay.errors_inline else [f"  {s.candidate_id}: {s.error}" for s in pairs if s.error]
    if lay.gpu == "none" and any(s.gpu_bytes or s.predicted_gpu_bytes for s in pairs):
        lines.append("  GPU GiB predicted / measured: " + ", ".join(
            f"{s.candidate_id} {_gib(s.predicted_gpu_bytes) or '-'} / {_gib(s.gpu_bytes) or '-'}" for s in pairs))
    if not lay.spread_rounds:
        lines.append("  spread s / rounds: " + ", ".join(
            f"{s.candidate_id} {_num(s.workload_iqr, 2)} / {s.n_rounds}" for s in pairs))
    return lines


def print_finalists(plan: Plan, con: Console) -> None:
    """The finalists' table in the richest layout that fits ``con`` (numbers never cut), what it leaves out below."""
    lay, table = first_fitting(con, FINALISTS_LAYOUTS, lambda lay: finalists_table(plan, lay))
    con.print(table)
    for line in finalists_below(plan, lay):
        con.print(line, markup=False)


class PlansLayout(NamedTuple):
    """How much of `flux plans` a width holds: the creation time's precision, the speeds' headers, ctx and kv."""

    created: Literal["iso", "minute", "day"]
    short_headers: bool
    ctx_kv: bool
    model_width: int  # the model's name is whole up to this many characters; longer, it folds over lines


PLANS_LAYOUTS = (PlansLayout("iso", False, True, 40), PlansLayout("minute", True, True, 40),
                 PlansLayout("minute", True, False, 40), PlansLayout("day", True, False, 40),
                 PlansLayout("day", True, False, 12))


def _created(iso: str, how: str) -> str:
    """A plan's creation time (ISO, UTC) at ``how``'s precision: whole, to the minute, or month-day and minute."""
    if how == "iso" or len(iso) < 16:
        return iso
    return f"{iso[:10] if how == 'minute' else iso[5:10]} {iso[11:16]}"


def plans_table(plans: list[Plan], lay: PlansLayout) -> Table:
    """`flux plans` in layout ``lay``: ids at 12 characters (what `flux show` takes) and model names whole (they wrap
    rather than being cut to stubs that all look alike)."""
    heads = ["plan", "created", "model", *(f"{n}{'' if lay.short_headers else ' tok/s'}" for n in ("prefill", "decode")),
             *(("ctx", "kv") if lay.ctx_kv else ())]
    rows = [[plan.id[:12], _created(plan.created_at, lay.created), plan.model_name, _num(plan.measured.prefill_tps, 1),
             _num(plan.measured.decode_tps, 1), *((str(plan.candidate.params.n_ctx), plan.request.kv) if lay.ctx_kv
                                                  else ())] for plan in plans]
    return whole_table(heads, rows, left=("plan", "created", "model", "kv"), wraps={"model": lay.model_width},
                       show_edge=False, caption="speeds in tok/s; times UTC" if lay.short_headers else None,
                       **_narrow_box(lay.short_headers))


def print_plans(plans: list[Plan], con: Console) -> None:
    """`flux plans`: every plan, newest last, in the richest layout that fits ``con``."""
    con.print(first_fitting(con, PLANS_LAYOUTS, lambda lay: plans_table(plans, lay))[1])
