"""Startup check: is this plan still valid on this machine? (FFTW's wisdom is refused, never re-derived.)

A plan is valid for exactly what it was measured with: its own content (a hand-edited plan no longer
hashes to its id), the backend build, the NVIDIA driver, the hardware fingerprint and the model's file
hashes. The first field that differs is reported in one line, expected vs found, with the command that
makes a new plan. The checks are ordered cheapest first; the model hash is remembered by (path, size,
mtime), so only a changed model file is read again.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import psutil

from artifacts.config import Settings
from artifacts.errors import FluxError, ModelFileError
from artifacts.filehash import file_hash, model_hash
from artifacts.ids import content_id
from artifacts.model_info import shard_paths
from artifacts.store import Store
from engine_bridge.backend import backend_info
from tasks.models import Plan
from tasks.probe import hardware_fingerprint
from tasks.probe_gpu import nvml_inventory
from tasks.probe_host import cpu_info

log = logging.getLogger(__name__)
PLAN_KIND = "plan"
_SHARD = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


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
    body = {k: v for k, v in raw.items() if k != "id"}
    found = content_id(body)
    plan_id = str(raw.get("id", ""))
    if found != plan_id:
        raise PlanMismatch(plan_id or "?", "content (the plan file was edited by hand)", plan_id, found,
                           str(raw.get("model_path", "<model>")))


def _model_hash(model: Path, settings: Settings) -> str | None:
    """This machine's hash of the model files at ``model``; None when they are missing."""
    try:
        return model_hash(shard_paths(model), settings.cache_dir)
    except ModelFileError as exc:
        log.info("plan check: %s", exc)
        return None


def _content_hash_as(plan: Plan, model: Path, settings: Settings) -> str | None:
    """The model hash the files at ``model`` would have under the plan's file names (the hash covers
    names): equal to the plan's when they hold the same bytes. None when they are missing."""
    try:
        shards = shard_paths(model)
        names = [_SHARD.sub("", Path(plan.model_path).name) + (m.group(0) if (m := _SHARD.search(p.name)) else "")
                 for p in shards] if len(shards) > 1 else [Path(plan.model_path).name]
        pairs = sorted((name, file_hash(p, settings.cache_dir)) for name, p in zip(names, shards, strict=True))
    except ModelFileError as exc:
        log.info("plan check: %s", exc)
        return None
    return content_id([list(pair) for pair in pairs])


def current_facts(plan: Plan, settings: Settings, model: Path | None = None) -> dict[str, object]:
    """This machine's values of the fields a plan is keyed by (cheap: no measurement); the model's hash is
    that of ``model`` when given, else of the plan's own model path."""
    nvml = nvml_inventory()
    return {
        "backend_build": backend_info(settings.cache_dir).build_id,
        "driver": nvml.driver,
        "hardware_fingerprint": hardware_fingerprint(cpu_info(), int(psutil.virtual_memory().total), nvml.gpus,
                                                     nvml.driver),
        "model_hash": _served_model_hash(plan, settings, model),
    }


def _served_model_hash(plan: Plan, settings: Settings, model: Path | None) -> str | None:
    if model is None:
        return _model_hash(Path(plan.model_path), settings)
    found = _model_hash(model, settings)
    if found is None or found == plan.model_hash:
        return found
    renamed = _content_hash_as(plan, model, settings)
    return plan.model_hash if renamed == plan.model_hash else found


def check_plan(plan: Plan, raw: dict[str, Any], settings: Settings, model: Path | None = None) -> None:
    """Refuse a plan that was edited or was measured on another machine, build, driver or model file.

    Args:
        model: serve the plan's model from this file instead of the path the plan records: allowed when
            its content hashes to the plan's model hash (a copy, a move, a rename).

    Raises:
        PlanMismatch: the first field that differs.
    """
    check_integrity(raw)
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
    store = Store(settings.data_dir)
    raw = store.get_json(PLAN_KIND, store.find(PLAN_KIND, prefix))
    check_integrity(raw)
    plan = Plan.model_validate(raw)
    model = model.expanduser().resolve() if model is not None else None
    check_plan(plan, raw, settings, model)
    return plan, model or Path(plan.model_path)
