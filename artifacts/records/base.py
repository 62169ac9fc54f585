"""The base of every record model: frozen, no unknown fields (a stored record is read back as written)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Record(BaseModel):
    """A frozen pydantic model that refuses fields it does not declare."""

    model_config = ConfigDict(frozen=True, extra="forbid")
