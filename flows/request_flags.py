"""``flux plan``'s flags, built from :class:`artifacts.records.plan.PlanRequest`'s fields.

A field is a flag: ``--field-name`` (or its ``flag``; ``short`` adds a short form such as ``-d``), typed by the
field, its choices from a ``Literal``, its help the field's description; a bool that defaults to True is
``--no-...``. Every flag defaults to None, "left out", so :func:`flows.request.plan_request` (where every check on
the request lives) fills in the field's ``[plan]`` setting or default. Kept apart from :mod:`flows.request`
because this module only shapes the command line: it is no part of the planner's code id.
"""

from __future__ import annotations

import argparse
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic.fields import FieldInfo

from artifacts.config import Settings
from artifacts.records.plan import PlanRequest
from flows.request import extra, flag_name, plan_request, scalar


def flag_fields(request: type[PlanRequest] = PlanRequest) -> dict[str, str]:
    """Field name -> flag of every request field offered on the command line, in ``--help`` order."""
    return {name: flag for name in request.model_fields if (flag := flag_name(name, request)) is not None}


def _argument(flag: str, info: FieldInfo) -> dict[str, Any]:
    """``add_argument``'s keywords for one field's flag (its action or type, choices, metavar)."""
    if info.annotation is bool:
        return {"action": "store_false" if info.default else "store_true"}
    kind = scalar(info.annotation)
    if typing.get_origin(kind) is Literal:
        return {"choices": typing.get_args(kind)}
    if kind in (int, float):
        conv: Any = kind
    elif kind is str or typing.get_origin(kind) is list:  # a list is its text, "12,24": plan_request reads it
        conv = str
    else:
        raise TypeError(f"PlanRequest field of type {info.annotation!r} has no flag form; give it a flag of None")
    return {"type": conv, "metavar": flag.lstrip("-").replace("-", "_").upper()}


def add_plan_flags(p: argparse.ArgumentParser, request: type[PlanRequest] = PlanRequest) -> None:
    """One argument per request field offered as a flag (a name without dashes is an optional positional)."""
    for name, flag in flag_fields(request).items():
        info = request.model_fields[name]
        if not flag.startswith("-"):  # the command supplies it when left out (flux plan: the tiny-moe twin)
            p.add_argument(name, nargs="?", default=None, metavar=flag, help=info.description)
            continue
        if info.annotation is bool and info.default:
            flag = "--no-" + flag.removeprefix("--")
        short = extra(info).get("short")
        p.add_argument(*([short] if short else []), flag, dest=name, default=None, help=info.description,
                       **_argument(flag, info))


def request_from_args(settings: Settings, args: argparse.Namespace, model: Path,
                      request: type[PlanRequest] = PlanRequest) -> PlanRequest:
    """The request of ``flux plan``'s parsed flags for ``model`` (checked by :func:`plan_request`)."""
    given = {name: getattr(args, name) for name in flag_fields(request) if name != "model"}
    return plan_request(settings, model, request=request, **given)
