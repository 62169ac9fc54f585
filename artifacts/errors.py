"""Typed errors of the artifacts package. Each message says what to do."""

from __future__ import annotations

from pathlib import Path


class FluxError(Exception):
    """Base of every Flux error that is reported to a person as one line (exit code 2)."""


class ModelFileError(FluxError):
    """A model file that cannot be used: missing, unreadable, not a GGUF, truncated, unsupported."""

    def __init__(self, path: Path | str, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class UnsupportedArchitecture(ModelFileError):
    """The GGUF's general.architecture is not implemented by the pinned llama.cpp."""

    def __init__(self, path: Path | str, architecture: str) -> None:
        self.architecture = architecture
        super().__init__(
            path,
            f"architecture '{architecture}' is not implemented by the pinned llama.cpp "
            "(see third_party/architectures.txt; a newer backend.pin may add it)",
        )


class ConfigError(FluxError):
    """A flux.toml that cannot be used."""

    def __init__(self, path: Path | str, key: str, problem: str) -> None:
        self.path = str(path)
        self.key = key
        self.problem = problem
        where = f"{self.path}: {key}: " if key else f"{self.path}: "
        super().__init__(where + problem)


class StoreError(FluxError):
    """The store cannot read or write an object."""


class NotFound(FluxError):
    """No stored object matches a key or an id prefix."""
