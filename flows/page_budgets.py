"""`flux show`'s page budgets: the KV pages a plan implies (server/kv_pages.py) and the RAM for parked conversations.

The device pools come from the plan's KV placement and context; the host pool is an estimate from the RAM the
plan's machine probe found available, minus the weights the plan keeps in RAM and the host reserve: `flux serve`
sizes it again from the RAM available when it starts.
"""

from __future__ import annotations

from pathlib import Path

from artifacts.errors import FluxError
from artifacts.model_info import model_info
from artifacts.records.hardware import HardwareReport
from artifacts.records.kinds import PROBE
from artifacts.records.plan import Plan
from artifacts.records.store import Records
from server.kv_pages import HOST, PAGE_TOKENS, PARK_MAX_BYTES, HostRam, kv_page_bytes, page_budget

GIB = 2**30
KIB = 2**10


def page_budget_line(plan: Plan, reserve_percent: float, park_bytes: int) -> str:
    """The memory `flux serve` gives the plan's conversations: the KV cache committed at load (per device, for the
    plan's context and sequences) and the RAM for parked conversations, taken when it starts."""
    c = plan.candidate
    kv = ", ".join(f"{d} {b / GIB:.2f} GiB" for d, b in sorted(c.kv_bytes.items()) if b) or "none"
    return (f"page budgets: KV cache for {c.params.n_ctx} tokens x {c.params.n_seq_max} sequence(s), committed at "
            f"load: {kv}; parked conversations: the RAM available above the {reserve_percent:g}% host reserve when "
            f"`flux serve` starts, at most {PARK_MAX_BYTES / GIB:.2f} GiB ({park_bytes / GIB:.2f} GiB on this machine now)")


def probe_report(data_dir: Path | None, plan: Plan) -> HardwareReport | None:
    """The newest stored probe of the plan's machine and model (None: none is stored, or no store given)."""
    if data_dir is None:
        return None
    records = Records.at(data_dir)
    for row in reversed(records.rows(PROBE)):
        try:
            hw = records.get(PROBE, str(row["id"]))
        except FluxError:
            continue
        if hw.fingerprint == plan.hardware_fingerprint and hw.model_hash == plan.model_hash:
            return hw
    return None


def estimated_host_ram(plan: Plan, reserve_percent: float, hw: HardwareReport | None,
                       override: int | None = None) -> tuple[HostRam, str]:
    """The RAM the host pool would get, from the probe (else the plan's host budget), and how it was found;
    ``override``: ``serve.kv_host_bytes``, which `flux serve` takes instead."""
    weights = plan.candidate.weights_bytes.get("CPU", 0)
    if override is not None:
        return HostRam(available=0, weights=weights, reserve=0, override=override), (
            f"serve.kv_host_bytes = {override:,}")
    if hw is not None:
        reserve = int(hw.ram_total * reserve_percent / 100)
        return HostRam(available=hw.ram_available, weights=weights, reserve=reserve), (
            f"the probe's {hw.ram_available / GIB:.1f} GiB of available RAM - {weights / GIB:.2f} GiB of weights in RAM "
            f"- the {reserve_percent:g}% reserve ({reserve / GIB:.1f} GiB)")
    budget = plan.memory_budget.get("CPU", 0)
    return HostRam(available=budget, weights=weights, reserve=0), (
        f"the plan's host budget of {budget / GIB:.1f} GiB (its probe is not stored here) - {weights / GIB:.2f} GiB "
        "of weights in RAM")


def kv_pages_line(plan: Plan, reserve_percent: float, hw: HardwareReport | None, override: int | None = None) -> str:
    """The KV pages the plan implies, per pool; the host's an estimate `flux serve` makes again when it starts
    (``override``: ``serve.kv_host_bytes``)."""
    p = plan.candidate.params
    try:
        page = kv_page_bytes(model_info(Path(plan.model_path)), p.type_k, p.type_v)
    except (FluxError, OSError) as exc:
        return f"KV pages: not counted: the model's KV bytes per token cannot be read ({exc})"
    ram, how = estimated_host_ram(plan, reserve_percent, hw, override)
    budget = page_budget(plan.candidate.kv_bytes, p.n_ctx, plan.sequences, page, ram.kv_bytes, window=p.kv_vram_cells)
    parts = []
    for pool in budget.pools:
        size = f"{pool.pages:,} pages x {pool.page_bytes / KIB:,.1f} KiB"
        if pool.name != HOST:
            parts.append(f"{pool.name} {size} (the plan's KV placement)")
            continue
        cells = "its KV placement" if pool.role == "window" else "the cells past the devices' window: none yet"
        sized = (f"its RAM holds {pool.ram_pages or 0:,} pages: {how}" if override is not None else
                 f"its RAM holds ~{pool.ram_pages or 0:,} pages, an estimate: {how}; `flux serve` sizes it from the "
                 "RAM available when it starts")
        parts.append(f"host {size} ({cells}; {sized})")
    return (f"KV pages of {PAGE_TOKENS} tokens for {p.n_ctx} tokens x {plan.sequences} sequence(s): "
            + "; ".join(parts))
