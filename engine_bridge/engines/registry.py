"""The engines a name can mean: ``native`` (the worker), ``llama-server`` (the backend's build), and every
configured ``[engines.NAME]`` of flux.toml. Engines declare themselves here once; ``flux plan --engines``
and the docs read this table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from artifacts.config import EngineSettings
from artifacts.engine_spec import LLAMA_SERVER, NATIVE, NATIVE_SPEC, EngineSpec
from artifacts.errors import FluxError
from engine_bridge.engines.spec import BadEngineTemplate, check_template

BUILTIN: dict[str, str] = {
    NATIVE: "Flux's own worker (llama-cpp-python on the pinned, patched llama.cpp)",
    LLAMA_SERVER: "llama.cpp's llama-server of the same build, started with the placement's flags and FLUX_MOE_SPLIT",
}


class EngineRefused(FluxError):
    """An engine ``flux plan`` cannot measure: unknown, badly configured, not starting, or missing a feature."""

    def __init__(self, name: str, problem: str) -> None:
        self.name = name
        self.problem = problem
        super().__init__(f"engine {name}: {problem}")


def resolve(names: Sequence[str], configured: Mapping[str, EngineSettings], llama_server: Path | None,
            start_timeout_s: float = 120.0) -> list[EngineSpec]:
    """The specs of ``names``, in order (a configured engine of a built-in's name replaces it).

    Raises:
        EngineRefused: an unknown name, a name twice, or a template naming a field other than {port}, {model},
            {ctx}; llama-server asked for and not built.
    """
    out: list[EngineSpec] = []
    for name in names:
        if any(s.name == name for s in out):
            raise EngineRefused(name, "named twice in --engines")
        conf = configured.get(name)
        if conf is not None:
            command = (*conf.command, *conf.args)
            try:
                check_template(command)
            except BadEngineTemplate as exc:
                raise EngineRefused(name, f"[engines.{name}] command: {exc}") from None
            out.append(EngineSpec(name=name, kind="command", command=command, start_timeout_s=conf.start_timeout_s,
                                  grammar=conf.grammar))
        elif name == NATIVE:
            out.append(NATIVE_SPEC)
        elif name == LLAMA_SERVER:
            if llama_server is None:
                raise EngineRefused(name, "llama-server is not built for this backend: run scripts/build-backend.sh")
            out.append(EngineSpec(name=name, kind="llama-server", command=(str(llama_server),),
                                  start_timeout_s=start_timeout_s, grammar=True))
        else:
            known = [*BUILTIN, *(n for n in configured if n not in BUILTIN)]
            raise EngineRefused(name, f"not a known engine (known: {', '.join(known)}); configure it as "
                                      f"[engines.{name}] in flux.toml")
    return out
