"""How a reply's tokens are drawn: one declaration, from the request to the worker's sampler and the engines.

A sampling knob is two edits: a field of :class:`SamplingParams` here (its default, its range, what it does)
and its stage in the worker's sampler chain (:func:`engine_bridge.worker.sampling.build_chain`). Everything else
follows the fields: the OpenAI request schemas inherit them (:class:`server.schemas.Sampling`, the same names,
ranges and defaults), the ``generate`` op carries one :class:`SamplingParams` (``GenerateArgs.sampling``), and
an engine other than the worker gets each field as its request's field of the same name
(:func:`engine_bridge.engines.host.sampling_fields`). ``tests/engine_bridge/test_sampling_params.py`` holds every
field to each of these, by introspection.

The defaults are llama-server's (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, no penalties, a random
seed): what a llama.cpp user expects of an OpenAI-compatible server over llama.cpp, and what llama-server, the
engine Flux races and can serve on, does with a request that leaves them out.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

SEED_RANGE = (-(2**63), 2**64 - 1)  # what OpenAI's clients send (int64, or uint64 from llama.cpp's own clients)
MIN_TOP_P = 1e-6  # OpenAI's top_p 0 (the top token alone) as the smallest mass other engines take (they want > 0)


class SamplingParams(BaseModel):
    """One request's sampling, every knob decided. Order of application (llama.cpp's): penalties, top-k, top-p,
    min-p, temperature, then the seeded draw (the most likely token at temperature 0)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    # Knobs that never change which token is the most likely one: a request that leaves every other knob at its
    # default and has temperature 0 is greedy (a draft can be verified against it).
    KEEP_TOP_TOKEN: ClassVar[frozenset[str]] = frozenset({"temperature", "seed", "top_k", "top_p", "min_p"})

    temperature: float = Field(0.8, ge=0.0, le=2.0, description="0: greedy (the most likely token each step)")
    top_k: int = Field(40, ge=0, le=2**31 - 1, description="keep the k most likely tokens (0: off)")
    top_p: float = Field(0.95, ge=0.0, le=1.0, description=(
        "keep the most likely tokens up to this probability mass (1: off; 0: the most likely token)"))
    min_p: float = Field(0.05, ge=0.0, le=1.0, description=(
        "drop tokens less likely than this fraction of the most likely one (0: off)"))
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description=(
        "subtracted from the logit of every token the reply already holds (0: off)"))
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description=(
        "subtracted from a token's logit once per time the reply holds it (0: off)"))
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1], description=(
        "the draw's seed, kept to its low 32 bits as llama.cpp takes it (None: a random one)"))

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        """OpenAI's 0 as the smallest mass engines take: the same single token."""
        return max(v, MIN_TOP_P)

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        """The low 32 bits (a negative seed wraps, as llama.cpp's uint32 does)."""
        return None if v is None else v % 2**32

    def greedy(self) -> bool:
        """True when every token is the model's most likely one: temperature 0, and each knob that moves logits
        (all but :attr:`KEEP_TOP_TOKEN`) at its default."""
        return self.temperature == 0.0 and all(
            getattr(self, name) == f.default for name, f in SamplingParams.model_fields.items()
            if name not in self.KEEP_TOP_TOKEN)


GREEDY = SamplingParams(temperature=0.0)
