"""The command that starts an engine a plan records (:class:`artifacts.engine_spec.EngineSpec`).

``native`` is Flux's own worker (``python -m engine_bridge.worker``); every other engine is a process that
answers OpenAI's ``/v1/completions`` on a loopback port: llama.cpp's ``llama-server``, started with the
placement's flags (:meth:`EngineParams.cli_args`) and environment (``FLUX_MOE_SPLIT``), or a configured
``[engines.NAME]`` whose command template names ``{port}``, ``{model}`` and ``{ctx}``.
"""

from __future__ import annotations

import string
from collections.abc import Sequence

from artifacts.drafting import Drafting
from artifacts.engine_params import EngineParams
from artifacts.engine_spec import EngineSpec

TEMPLATE_FIELDS = frozenset({"port", "model", "ctx"})
HOST = "127.0.0.1"


class BadEngineTemplate(ValueError):
    """A command template naming a field other than ``{port}``, ``{model}`` or ``{ctx}`` (or malformed)."""


def template_fields(command: tuple[str, ...] | list[str]) -> set[str]:
    """The ``{fields}`` a command template names.

    Raises:
        BadEngineTemplate: a malformed template (an unclosed brace, a positional or formatted field).
    """
    found: set[str] = set()
    for part in command:
        try:
            parsed = list(string.Formatter().parse(part))
        except ValueError as exc:
            raise BadEngineTemplate(f"{part!r}: {exc}") from None
        for _, name, spec, conv in parsed:
            if name is None:
                continue
            if not name or spec or conv:
                raise BadEngineTemplate(f"{part!r}: write fields as {{port}}, {{model}} or {{ctx}}")
            found.add(name)
    return found


def check_template(command: tuple[str, ...] | list[str]) -> None:
    """Refuse a template with a field other than ``{port}``, ``{model}``, ``{ctx}``, or without ``{port}``.

    Raises:
        BadEngineTemplate: what is wrong, in words.
    """
    if not command:
        raise BadEngineTemplate("the command is empty")
    names = template_fields(command)
    unknown = sorted(names - TEMPLATE_FIELDS)
    if unknown:
        raise BadEngineTemplate(f"unknown template field(s) {', '.join('{' + n + '}' for n in unknown)}: only "
                                "{port}, {model} and {ctx} are substituted")
    if "port" not in names:
        raise BadEngineTemplate("the command does not name {port}: Flux picks the port the engine listens on")


def llama_server_argv(exe: Sequence[str], model: str, args: Sequence[str], port: int) -> list[str]:
    """llama-server's command line (the one place it is built): ``exe`` serving ``model`` with ``args`` on
    127.0.0.1:``port``, without its web UI."""
    return [*exe, "-m", model, *args, "--host", HOST, "--port", str(port), "--no-webui"]


def launch(spec: EngineSpec, model: str, params: EngineParams, port: int,
           drafting: Drafting | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and extra environment that start ``spec`` on ``model`` with the placement ``params``.

    llama-server holds ``n_seq_max`` slots of ``n_ctx`` tokens each (its ``-c`` is split among ``-np`` slots),
    and drafts as ``drafting`` says (a draft model, prompt lookup or the model's next-token head); a configured engine gets its
    template with ``{ctx}`` the context per sequence.
    """
    ctx = params.n_ctx
    env = params.environment()
    if spec.kind == "llama-server":
        return [*llama_server_argv(spec.command, model, params.server_args(), port),
                *(drafting.server_args(params) if drafting else [])], env
    values = {"port": str(port), "model": model, "ctx": str(ctx)}
    return [part.format(**values) for part in spec.command], env
