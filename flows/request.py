"""The plan request: every check on the planning flags, in one place, for the CLI and the flow alike.

``flux plan`` (whose flags :mod:`flows.request_flags` builds from :class:`PlanRequest`'s fields) and the
``plan-model`` flow (whose Prefect deployment takes plain parameters) both call :func:`plan_request`; a flag
the request refuses is one line naming the flag, never a traceback. :func:`check_for_model` holds the one
check that needs the model's own facts.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from artifacts.config import Settings
from artifacts.engine_spec import EngineSpec
from artifacts.errors import FluxError
from artifacts.records.plan import PlanRequest
from engine_bridge.backend import llama_server_path
from engine_bridge.engines.registry import EngineRefused, resolve
from engine_bridge.rpc import parse_endpoints
from tasks.errors import ImpossiblePlan


class BadPlanFlag(FluxError):
    """A planning flag the request cannot take."""


def extra(info: FieldInfo) -> dict[str, Any]:
    """A request field's ``json_schema_extra`` (how it differs from a plain ``--field-name`` flag)."""
    return dict(info.json_schema_extra) if isinstance(info.json_schema_extra, dict) else {}


def flag_name(name: str, request: type[PlanRequest] = PlanRequest) -> str | None:
    """The command-line name of request field ``name``: ``--field-name`` unless its ``flag`` says otherwise."""
    meta = extra(request.model_fields[name])
    return meta["flag"] if "flag" in meta else "--" + name.replace("_", "-")


def scalar(annotation: Any) -> Any:
    """A field's type without its ``None``: ``X | None`` -> X."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


def _from_text(flag: str, info: FieldInfo, value: object) -> object:
    """A list field given as the flag's text (``12,24``) as its list; other values as they are."""
    kind = scalar(info.annotation)
    if not isinstance(value, str) or typing.get_origin(kind) is not list:
        return value
    if not value:
        return None
    item = typing.get_args(kind)[0]
    try:
        return [item(x) for x in value.split(",")]
    except ValueError:
        raise BadPlanFlag(f"{flag} {value!r}: expected {info.description}") from None


def plan_request(settings: Settings, model: str | Path, *, request: type[PlanRequest] = PlanRequest,
                 **given: object) -> PlanRequest:
    """The request for ``model`` with these flags; a flag left out (None) takes its ``[plan]`` setting, if it
    names one, else the field's default.

    Args:
        settings: where the ``[plan]`` defaults come from.
        model: the .gguf file (resolved to an absolute path).
        request: the request model (a subclass in tests).
        **given: field name -> value; a list field may be given as its flag's text (``"12,24"``).

    Raises:
        BadPlanFlag: a flag out of range or of an unknown value, named with what it takes.
    """
    values: dict[str, object] = {name: v for name, v in given.items() if v is not None}
    for name, info in request.model_fields.items():
        if name in values:
            values[name] = _from_text(flag_name(name, request) or name, info, values[name])
        elif (setting := extra(info).get("setting")) is not None:
            values[name] = getattr(settings.plan, setting)
    values["model"] = str(Path(model).expanduser().resolve())
    for name in ("draft_model", "heads"):
        if isinstance(values.get(name), str | Path):
            values[name] = str(Path(str(values[name])).expanduser().resolve())
    rpc = values.get("rpc") or list(settings.rpc.servers) or None
    servers = list(parse_endpoints([str(e) for e in rpc])) if isinstance(rpc, list) else []
    values["rpc"] = servers or None
    budgets = values.get("rpc_mem_budget_gib")
    if isinstance(budgets, list) and len(budgets) > len(servers):
        raise BadPlanFlag(f"--rpc-mem-budget {','.join(f'{b:g}' for b in budgets)}: {len(budgets)} budget(s) for "
                          f"{len(servers)} RPC server(s); give one per --rpc server, in order")
    try:
        req = request.model_validate(values)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else ""
        flag = flag_name(field, request) if field in request.model_fields else None
        given = err.get("input")
        shown = ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in given) if isinstance(given, list) \
            else repr(given)
        msg = err["msg"].removeprefix("Value error, ")
        raise BadPlanFlag(f"{flag or field} {shown}: {msg[:1].lower()}{msg[1:]}; see `flux plan --help`") from None
    engine_specs(settings, req)
    if req.draft_model is not None and not req.speculation:
        raise BadPlanFlag(f"--draft-model {req.draft_model}: drafting is measured with --speculation; add it")
    if req.domains is not None:
        from artifacts.corpus import parse_domains

        try:
            parse_domains(req.domains)
        except ValueError as exc:
            raise BadPlanFlag(f"--domains {req.domains}: {exc}") from None
    if req.heads is not None and not req.speculation:
        raise BadPlanFlag(f"--heads {req.heads}: drafting is measured with --speculation; add it")
    if req.serving_p95_ms is not None and req.concurrency < 2:
        raise BadPlanFlag(f"--serving-p95-ms {req.serving_p95_ms:g}: it chooses among 1 to --concurrency sequences; "
                          "give --concurrency N, the most to try (e.g. --concurrency 8)")
    if req.heads is not None and "llama-server" not in req.engines:
        raise BadPlanFlag(f"--heads {req.heads}: next-token heads draft on llama-server only; add "
                          f"--engines {','.join([*req.engines, 'llama-server'])}")
    return req


def check_draft(req: PlanRequest) -> None:
    """The draft model's and the grafted heads' checks that read files (before anything is measured).

    Raises:
        BadPlanFlag: the draft is not a file, not a model, or has another vocabulary than the model's; the heads
            are not a file or do not fit the model (:func:`artifacts.synth.heads.heads_mismatch`).
    """
    from artifacts.synth.draft import vocabulary_mismatch
    from artifacts.synth.heads import heads_mismatch

    checks = (("--heads", req.heads, heads_mismatch, "",
               "give the model's next-token block as a .gguf (e.g. `flux synth --heads-of MODEL_WITH_HEADS -o "
               "heads.gguf`)"),
              ("--draft-model", req.draft_model, vocabulary_mismatch, "; a draft must share the model's tokenizer",
               "give a .gguf sharing the model's vocabulary (e.g. `flux synth --draft-of MODEL --layers 1 -o "
               "draft.gguf`)"))
    for flag, path, mismatch, then, fix in checks:
        if path is None:
            continue
        if not Path(path).is_file():
            what = "not a regular file" if Path(path).exists() else "no such file"
            raise BadPlanFlag(f"{flag} {path}: {what}; {fix}")
        why = mismatch(Path(req.model), Path(path))
        if why is not None:
            raise BadPlanFlag(f"{flag} {path}: {why}{then}")


def engine_specs(settings: Settings, req: PlanRequest) -> list[EngineSpec]:
    """The engines ``req`` names (``--engines``), resolved against the configured ones.

    Raises:
        BadPlanFlag: an unknown engine, one named twice, a bad command template, llama-server not built.
    """
    if req.prefer_engine is not None and req.prefer_engine not in req.engines:
        raise BadPlanFlag(f"--prefer-engine {req.prefer_engine}: not one of --engines {','.join(req.engines)}")
    try:
        return resolve(req.engines, settings.engines, llama_server_path(settings.cache_dir) if
                       "llama-server" in req.engines else None, settings.plan.measure_timeout_s)
    except EngineRefused as exc:
        raise BadPlanFlag(f"--engines {','.join(req.engines)}: {exc}") from None


def check_for_model(req: PlanRequest, n_ctx_train: int | None) -> None:
    """The checks that need the model's facts (read before anything is measured).

    Raises:
        ImpossiblePlan: ``--ctx`` beyond the model's trained context.
    """
    if req.ctx and n_ctx_train and req.ctx > n_ctx_train:
        raise ImpossiblePlan(f"--ctx {req.ctx} exceeds the model's trained context {n_ctx_train}",
                             f"use --ctx {n_ctx_train} or less")


def gpu_budget_unused(req: PlanRequest, n_gpus: int) -> str | None:
    """What to say, before anything is measured, of a ``--gpu-mem-budget`` on a machine with ``n_gpus`` GPUs (NVML's
    count; Flux's backend builds are CPU or CUDA): nothing unless there is none. Such a budget is left out of the
    plan's key (:func:`artifacts.records.keys.plan_key`), so the plan of the same request without it is reused."""
    if not req.gpu_mem_budget_gib or n_gpus:
        return None
    given = ",".join(f"{b:g}" for b in req.gpu_mem_budget_gib)
    return (f"--gpu-mem-budget {given}: this machine has no GPU, so the plan runs on the CPU and the budget is not "
            "used (a saved plan of the same request without it is the same plan)")


F = TypeVar("F", bound=Callable[..., Any])


def flow_signature(fn: F, request: type[PlanRequest] = PlanRequest) -> F:
    """Give the ``plan-model`` flow one keyword parameter per flag field of ``request``, so that a deployment run
    (``--param NAME=VALUE``, the Prefect UI's form) takes the names ``flux plan`` does and a new field is a new
    parameter with no edit here: ``model`` is required, every other parameter defaults to None (left out:
    :func:`plan_request` fills it from ``[plan]`` or the field's default, as for a flag)."""
    params = []
    for name, info in request.model_fields.items():
        if flag_name(name, request) is None:
            continue
        required = info.is_required()
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                        default=inspect.Parameter.empty if required else None,
                                        annotation=info.annotation if required else typing.Optional[info.annotation]))  # noqa: UP045
    fn.__signature__ = inspect.Signature(params, return_annotation=str)  # type: ignore[attr-defined]
    return fn


def flow_params(req: PlanRequest) -> dict[str, Any]:
    """The ``plan-model`` flow's parameters for this request: its flags (the flow's deployment takes them plain)."""
    return {name: getattr(req, name) for name in type(req).model_fields if flag_name(name, type(req)) is not None}
