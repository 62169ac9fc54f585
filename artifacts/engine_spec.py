"""What a plan records of the engine that runs it: :class:`EngineSpec`.

``native`` is Flux's own worker (``python -m engine_bridge.worker``); every other engine is a process that
answers OpenAI's ``/v1/completions`` on a loopback port: llama.cpp's ``llama-server`` or a configured
``[engines.NAME]`` command template. The command that starts one is built in :mod:`engine_bridge.engines.spec`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

EngineKind = Literal["native", "llama-server", "command"]
NATIVE = "native"
LLAMA_SERVER = "llama-server"


class EngineSpec(BaseModel):
    """One engine a plan can be measured and served on."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(min_length=1)
    kind: EngineKind
    command: tuple[str, ...] = Field((), description="argv template ({port}, {model}, {ctx}); empty for native")
    start_timeout_s: float = Field(120.0, gt=0, description="longest wait for the engine to answer after its start")
    grammar: bool = Field(False, description="takes a GBNF grammar (llama.cpp's `grammar` field): tools and "
                                             "structured output")

    @property
    def native(self) -> bool:
        """True for Flux's own worker."""
        return self.kind == "native"


NATIVE_SPEC = EngineSpec(name=NATIVE, kind="native", grammar=True)
