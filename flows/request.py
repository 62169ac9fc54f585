"""The plan request: built in one place from the planning flags, for the CLI and the flow alike.

``flux plan`` and the ``plan-model`` flow (whose Prefect deployment takes plain parameters) both call
:func:`plan_request`; a flag the request model refuses is one line naming the flag, never a traceback.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from artifacts.config import Settings
from artifacts.errors import FluxError
from tasks.plan_types import PlanRequest

FLAGS = {"ctx": "--ctx", "concurrency": "--concurrency", "kv": "--kv", "budget_s": "--budget-s",
         "gpu_mem_budget_gib": "--gpu-mem-budget", "workload": "--workload", "seed": "--seed", "model": "model"}


class BadPlanFlag(FluxError):
    """A planning flag the request cannot take."""


def plan_request(settings: Settings, model: str | Path, *, ctx: int | None = None, concurrency: int = 1,
                 kv: str = "f16", budget_s: float | None = None, gpu_mem_budget_gib: list[float] | None = None,
                 allow_storage_streaming: bool = False, workload: str = "agent", seed: int = 0) -> PlanRequest:
    """The request for ``model`` with these flags (the settings' defaults for what is left out).

    Raises:
        BadPlanFlag: a flag out of range or of an unknown value, named with what it takes.
    """
    try:
        return PlanRequest.model_validate({
            "model": str(Path(model).expanduser().resolve()), "ctx": ctx, "concurrency": concurrency, "kv": kv,
            "budget_s": settings.plan.tuning_budget_s if budget_s is None else budget_s,
            "gpu_mem_budget_gib": gpu_mem_budget_gib, "allow_storage_streaming": allow_storage_streaming,
            "workload": workload, "finalists": settings.plan.finalists, "repeats": settings.plan.repeats, "seed": seed})
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else ""
        raise BadPlanFlag(f"{FLAGS.get(field, field)} {err.get('input')!r}: {err['msg'].lower()}; "
                          f"see `flux plan --help`") from None
