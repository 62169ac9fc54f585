"""The probe stage: this machine measured once per model and backend build, reused unless ``--reprobe``, or unless the
stored probe was taken while other processes kept the CPUs busy and the machine is quiet now.

The store keeps the first record written under a key, so a probe measured again is stored under the next link of a
chain (the machine's key plus ``after``: the id of the key it replaces) and every look-up follows the chain to its
newest link: a re-probe is measured once, not at every plan after it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from artifacts.ids import content_id
from artifacts.records.hardware import HardwareReport
from artifacts.records.keys import probe_key
from artifacts.records.kinds import PROBE
from tasks import workload as wl
from tasks.errors import ImpossiblePlan
from tasks.probing.machine import load_words, probe, quiet_now, taken_under_load
from tasks.stage import NATIVE_OPS, PlanContext, Stage

_log = logging.getLogger(__name__)


def _next(ctx: PlanContext, key: dict[str, Any]) -> dict[str, Any]:
    """The key a probe measured again after the one stored under ``key`` is stored under."""
    return {**probe_key(ctx.facts, ctx.model_hash, ctx.backend_build, STAGE.code()), "after": content_id(key)}


def newest_key(ctx: PlanContext) -> dict[str, Any]:
    """The key of the newest probe stored for ``ctx``'s machine, model and build (the first one's when none is)."""
    key = probe_key(ctx.facts, ctx.model_hash, ctx.backend_build, STAGE.code())
    while ctx.records.has(PROBE, content_id(later := _next(ctx, key))):
        key = later
    return key


def stored_probe(ctx: PlanContext) -> HardwareReport | None:
    """The newest probe report stored for ``ctx``'s machine, model and build, if any (no decision, no measuring)."""
    pid = content_id(newest_key(ctx))
    return ctx.records.get(PROBE, pid) if ctx.records.has(PROBE, pid) else None


def _key(ctx: PlanContext) -> dict[str, Any]:
    """The newest stored probe's key, or the next link when it is to be measured again (:func:`measure_again`)."""
    newest = newest_key(ctx)
    if ctx.records.has(PROBE, content_id(newest)) and measure_again(ctx):
        return _next(ctx, newest)
    return newest


def _run(ctx: PlanContext, log: Any) -> HardwareReport:
    return probe(ctx.model, ctx.model_hash, ctx.settings, ctx.backend_build, ctx.facts.rpc)


def measure_again(ctx: PlanContext,
                  quiet: Callable[[HardwareReport], tuple[bool, float]] = quiet_now) -> bool:
    """Whether the stored probe is measured again rather than reused: ``--reprobe``, or a stored probe taken under load
    (:func:`tasks.probing.machine.taken_under_load`) on a machine that ``quiet(hw) -> (bool, others' CPUs)`` finds quiet now.
    A machine still busy reuses it (a probe now would be as slow) and the stage's report says so."""
    if ctx.reprobe:
        return True
    hw = stored_probe(ctx)
    if hw is None or not taken_under_load(hw):
        return False
    calm, others = quiet(hw)
    if calm:
        _log.warning("probe: the stored probe was taken under load (%s); other processes keep %.1f CPUs busy now: "
                     "measuring this machine again", load_words(hw), others)
    return bool(calm)


def under_load_warning(hw: HardwareReport) -> str | None:
    """What the stage warns of when ``hw`` was taken under load (None when it was not)."""
    if not taken_under_load(hw):
        return None
    return (f"the probe was taken while the machine was busy ({load_words(hw)}): its speeds, and the cost model's "
            "predictions and the budget's sizing made from them, are too slow; `flux plan --reprobe` on a quiet "
            "machine measures it again")


def _check_budget(ctx: PlanContext, log: Any, hw: HardwareReport) -> None:
    """Right after the probe (computed or reused): say that it was taken under load, and refuse a ``--budget-s``
    that cannot measure two finalists twice even at this machine's fastest, naming one that works (and, when the
    probe's speeds may be a busy machine's, ``--reprobe``), not after it has been spent."""
    warning = under_load_warning(hw)
    if warning:
        log.warning("probe: %s", warning)
    try:
        wl.check_feasible(hw, ctx.req.ctx or ctx.info.n_ctx_train or 4096, ctx.req)
    except ImpossiblePlan as exc:
        if warning is None and hw.others_cpus is not None:
            raise
        why = (f"the probe was taken while the machine was busy ({load_words(hw)})" if warning else
               "the stored probe does not say whether the machine was busy when it was taken")
        raise ImpossiblePlan(exc.problem, f"{exc.fix}; or, since {why}, `flux plan --reprobe` on a quiet machine "
                             "measures it again (a busy machine's probe predicts it slow)") from None


STAGE: Stage[HardwareReport] = Stage(
    name="probe", version=1, result=HardwareReport, run=_run, kind=PROBE, key=_key,
    inputs=("machine facts", "model hash", "backend build", "code", "newest probe stored"), report=_check_budget,
    sources=NATIVE_OPS)
