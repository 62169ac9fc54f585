"""Startup check: is this plan still valid on this machine? (FFTW's wisdom is refused, never re-derived.)

A plan is valid for exactly what it was measured with: its own content (a hand-edited plan no longer
hashes to its id), the backend build, the NVIDIA driver, the hardware fingerprint and the model's file
hashes. The first field that differs is reported in one line, expected vs found, with the command that
makes a new plan. The checks are ordered cheapest first; the model hash is remembered by (path, size,
mtime), so only a changed model file is read again.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from artifacts.config import Settings
from artifacts.errors import FluxError, ModelFileError
from artifacts.filehash import model_hash
from artifacts.model_info import shard_paths
from artifacts.records.keys import facts_fingerprint
from artifacts.records.kinds import MODEL_PATH, PLAN, ROUTING_TABLE
from artifacts.records.plan import Plan, plan_id
from artifacts.records.store import Records
from engine_bridge import rpc
from engine_bridge.backend import backend_info
from engine_bridge.machine_facts import machine_facts

log = logging.getLogger(__name__)


class PlanMismatch(FluxError):
    """The plan does not match this machine (or was edited); serving it would be serving a guess."""

    def __init__(self, plan_id: str, field: str, expected: object, found: object, model: str,
                 hint: str = "") -> None:
        self.plan_id = plan_id
        self.field = field
        self.expected = expected
        self.found = found
        super().__init__(f"plan {plan_id[:12]} cannot be served here: {field} differs (plan: {_short(expected)}, "
                         f"this machine: {_short(found)}){hint}; run `flux plan {model} --replan`")


def _short(value: object) -> str:
    text = "none" if value is None else str(value)
    return text[:16] + "…" if len(text) > 24 and all(c in "0123456789abcdef" for c in text) else text


def check_integrity(raw: dict[str, Any]) -> None:
    """A plan's id is the content id of its body: anything else was edited after it was saved.

    Raises:
        PlanMismatch: field ``content``.
    """
    found = plan_id(raw)
    stored = str(raw.get("id", ""))
    if found != stored:
        raise PlanMismatch(stored or "?", "content (the plan file was edited by hand)", stored, found,
                           str(raw.get("model_path", "<model>")))


def _model_hash(model: Path, settings: Settings) -> str | None:
    """This machine's hash of the model files at ``model``; None when they are missing."""
    try:
        return model_hash(shard_paths(model), settings.cache_dir)
    except ModelFileError as exc:
        log.info("plan check: %s", exc)
        return None


def current_facts(plan: Plan, settings: Settings, model: Path | None = None) -> dict[str, object]:
    """This machine's values of the fields a plan is keyed by (cheap: no measurement); the model's hash is
    that of ``model`` when given, else of the plan's own model path."""
    build = backend_info(settings.cache_dir).build_id
    # a plan over RPC servers is keyed by them too: each must answer, with this build (one line otherwise)
    facts = machine_facts().model_copy(update={"rpc": [rpc.identify(e, build)
                                                       for e in plan.candidate.params.rpc_servers]})
    return {
        "backend_build": build,
        "driver": facts.driver,
        "hardware_fingerprint": facts_fingerprint(facts),
        "model_hash": _model_hash(model or Path(plan.model_path), settings),
    }


def check_plan(plan: Plan, settings: Settings, model: Path | None = None) -> None:
    """Refuse a plan that was measured on another machine, build, driver or model file (an edited plan is
    refused as it is read: :func:`check_integrity`).

    Args:
        model: serve the plan's model from this file instead of the path the plan records: allowed when
            its content hashes to the plan's model hash (a copy, a move, a rename).

    Raises:
        PlanMismatch: the first field that differs.
    """
    found = current_facts(plan, settings, model)
    for field in ("backend_build", "driver", "hardware_fingerprint", "model_hash"):
        expected = getattr(plan, field)
        if found[field] != expected:
            raise PlanMismatch(plan.id, field, expected, found[field], str(model or plan.model_path),
                               _model_hint(plan, model, found[field]) if field == "model_hash" else "")
    log.info("plan %s matches this machine (build %s, driver %s)", plan.id[:12], plan.backend_build,
             plan.driver or "none")


def _model_hint(plan: Plan, model: Path | None, found: object) -> str:
    if model is not None:
        what = "is missing" if found is None else "holds another model"
        return f": --model {model} {what} (the plan was made for {plan.model_path})"
    if found is None:
        return (f": its model file {plan.model_path} is missing; if the same model is elsewhere, serve it with "
                "`--model PATH` (its content is checked)")
    return f": {plan.model_path} now holds another model"


def load_checked_plan(settings: Settings, prefix: str, model: Path | None = None) -> tuple[Plan, Path]:
    """The saved plan with this id prefix, checked against this machine, and the model file to serve.

    Args:
        model: serve the plan's model from this file (its content must be the plan's model); default: the
            path the plan records.

    Raises:
        NotFound / AmbiguousId: no plan or several plans start with ``prefix``.
        PlanMismatch: the plan is not valid here.
    """
    records = Records.at(settings.data_dir)
    plan = records.find_by_prefix(PLAN, prefix, check=check_integrity)
    model = model.expanduser().resolve() if model is not None else recorded_path(records, plan, settings)
    check_plan(plan, settings, model)
    return fit_to_memory(settings, records, plan, model or Path(plan.model_path)), model or Path(plan.model_path)


def device_free(device: str, settings: Settings) -> int | None:
    """Free bytes of a ggml device now (``serve.device_free_bytes`` overrides): NVML for ``CUDAk`` (the k-th
    GPU), available RAM for ``CPU``; None when unknown."""
    if device in settings.serve.device_free_bytes:
        return settings.serve.device_free_bytes[device]
    if device == "CPU":
        import psutil

        return int(psutil.virtual_memory().available)
    if device.startswith("CUDA") and device[4:].isdigit():
        from engine_bridge.gpu_inventory import nvml_inventory

        gpus = nvml_inventory().gpus
        k = int(device[4:])
        return gpus[k].memory_free if k < len(gpus) else None
    return None


def fit_to_memory(settings: Settings, records: Records, plan: Plan, model: Path) -> Plan:
    """The plan as it can be served now: with the least-routed GPU copies of its experts dropped when a device
    has less free memory than the plan measured there (a warning names how many and what it costs).

    Raises:
        SplitShortfall: dropping every copy on a device cannot cover its shortfall.
    """
    split = plan.candidate.params.expert_split
    if split is None:
        return plan
    from artifacts.model_info import model_info
    from artifacts.records.fit import fit_split
    from engine_bridge.routing_trace import check_routing_table

    info = model_info(model)
    free = {d: f for d in sorted({h.device for h in split.layers}) if (f := device_free(d, settings)) is not None}
    shares = None
    store = records.store
    if plan.routing_trace and store.has(ROUTING_TABLE, plan.routing_trace):
        counts = check_routing_table(store.get_table(ROUTING_TABLE, plan.routing_trace), plan.model_hash, info.n_layer,
                                     info.n_expert).astype(float)
        shares = counts / counts.sum(axis=1, keepdims=True).clip(min=1.0)
    params, dropped = fit_split(plan, info, free, shares)
    for d in dropped:
        log.warning("plan %s: %s", plan.id[:12], d.message())
    if not dropped:
        return plan
    return plan.model_copy(update={"candidate": plan.candidate.model_copy(update={"params": params})})


def recorded_path(records: Records, plan: Plan, settings: Settings) -> Path | None:
    """Where the plan's model bytes are now, when no longer at the plan's own path: the newest path a
    `flux plan` run saw them at (a rename or move reuses the plan and records the new path). None when the
    plan's path still holds them, or no recorded path does."""
    if _model_hash(Path(plan.model_path), settings) == plan.model_hash:
        return None
    seen = [r for r in records.rows(MODEL_PATH) if (r.get("meta") or {}).get("model_hash") == plan.model_hash]
    for row in sorted(seen, key=lambda r: (r.get("meta") or {}).get("seen_at", 0), reverse=True):
        path = Path(str(row["meta"]["path"]))
        if path != Path(plan.model_path) and _model_hash(path, settings) == plan.model_hash:
            log.info("plan %s: its model is now at %s (recorded by flux plan)", plan.id[:12], path)
            return path
    return None
