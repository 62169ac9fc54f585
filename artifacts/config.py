"""Flux settings: every default in this one module, loaded once per process.

Order: ``$FLUX_CONFIG``, then ``~/.config/flux/flux.toml`` (``$XDG_CONFIG_HOME/flux/flux.toml``); a missing
file means all defaults. Every field has a default, so a file only lists overrides. An unknown key or a
wrong type is a :class:`ConfigError` naming the file, the key and the expected type.

This is the only module that reads ``os.environ``: entry points call :func:`load_settings` once and pass
the result down.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from artifacts.errors import ConfigError


class _Section(BaseModel):
    # strict: TOML has real types, so `port = true` or `port = "80"` is a mistake, not something to coerce.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


LoosePath = Annotated[Path, Field(strict=False)]


class PlanSettings(_Section):
    """``[plan]``: how ``flux plan`` searches and measures."""

    tuning_budget_s: float = Field(600.0, gt=0, description="wall-clock budget of the measure stage")
    finalists: int = Field(6, ge=1, le=64, description="candidates the cost model keeps for measurement")
    repeats: int = Field(3, ge=1, le=20, description="timed repetitions per finalist and prompt")
    validate_tokens: int = Field(32, ge=4, le=512, description="tokens compared against the reference")
    max_kl: float = Field(0.01, ge=0, description="largest mean KL divergence a plan may show vs reference")
    # 0.90: random-weight twins have many near-tied top logits, which any change of summation order flips;
    # KL against the noise floor of correct kernels (tasks/quality_gate.py) is what catches real errors.
    min_top1: float = Field(0.90, ge=0, le=1, description="smallest top-1 agreement vs reference")
    floor_factor: float = Field(4.0, ge=1, description=(
        "a plan may differ from the reference this many times the noise floor's mean KL (correct kernels)"))
    min_kl: float = Field(1e-4, ge=0, description="the KL limit is never tighter than this, however low the floor")
    measure_timeout_s: float = Field(300.0, gt=0, description="kill a finalist's worker after this long")


class WorkerTimeouts(_Section):
    """``[serve.worker_timeouts]``: seconds the server waits on its worker."""

    hello_s: float = Field(30.0, gt=0)
    load_s: float = Field(1800.0, gt=0)
    rpc_s: float = Field(120.0, gt=0)
    write_s: float = Field(30.0, gt=0)


class ServeSettings(_Section):
    """``[serve]``: the OpenAI-compatible server."""

    host: str = "127.0.0.1"
    port: int = Field(8090, ge=0, le=65535)
    prefill_timeout_s: float = Field(300.0, gt=0)
    decode_timeout_s: float = Field(120.0, gt=0)
    client_write_timeout_s: float = Field(30.0, gt=0)
    replan_timeout_s: float = Field(3600.0, gt=0)
    journal_max_bytes: int = Field(268_435_456, ge=0)
    journal_ttl_s: float = Field(600.0, ge=0)
    min_reply: int = Field(4096, ge=1)
    queue_max: int = Field(64, ge=0, description="requests waiting for a sequence before 429")
    queue_wait_s: float = Field(30.0, gt=0, description="longest wait for a sequence before 503")
    header_timeout_s: float = Field(10.0, gt=0, description="a request line and headers must arrive within this")
    body_timeout_s: float = Field(60.0, gt=0, description="a request body must arrive within this after its headers")
    keep_alive_s: float = Field(5.0, gt=0, description="an idle keep-alive connection is closed after this")
    max_connections: int = Field(512, ge=1, description="open connections beyond this are refused (503)")
    max_body_bytes: int = Field(0, ge=0, description="largest request body; 0: 32 bytes per context token, "
                                                     "at least 1 MiB")
    access_log: bool = Field(True, description="one log line per request (logger flux.access)")
    device_free_bytes: dict[str, int] = Field(default_factory=dict, description=(
        "what-if for the serve-time shortfall check: treat these devices ('CUDA0', 'CPU') as having this many "
        "bytes free instead of what they report"))
    worker_timeouts: WorkerTimeouts = WorkerTimeouts()


class EngineSettings(_Section):
    """``[engines.NAME]``: any OpenAI-compatible engine; ``{port}``, ``{model}``, ``{ctx}`` are substituted."""

    command: list[str]
    args: list[str] = []
    architectures: list[str] = []


class FileSettings(_Section):
    """What a flux.toml may contain (all optional)."""

    models_dir: LoosePath | None = None
    cache_dir: LoosePath | None = None
    data_dir: LoosePath | None = None
    host_reserve_percent: float = Field(10.0, ge=0, lt=100)
    plan: PlanSettings = PlanSettings()
    serve: ServeSettings = ServeSettings()
    engines: dict[str, EngineSettings] = {}


class Settings(_Section):
    """The one settings object of a process: the file's values plus the environment's locations."""

    config_path: LoosePath | None
    models_dir: LoosePath
    cache_dir: LoosePath
    data_dir: LoosePath
    host_reserve_percent: float
    plan: PlanSettings
    serve: ServeSettings
    engines: dict[str, EngineSettings]
    log_filter: str = "info"
    native_log: str = "warn"
    fault_inject: str | None = Field(None, description="FLUX_FAULT_INJECT, e.g. fail-once:validate:/tmp/marker")
    api_key: SecretStr | None = Field(None, description="FLUX_API_KEY: the key `flux serve` wants (never printed)")

    @property
    def logs_dir(self) -> Path:
        """Where log files go (``<data_dir>/logs``)."""
        return self.data_dir / "logs"


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _expected(loc: tuple[int | str, ...]) -> str:
    """Name the type the model expects at ``loc``, for error messages."""
    model: Any = FileSettings
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if fields is None or not isinstance(part, str) or part not in fields:
            return ""
        model = fields[part].annotation
    return _type_name(model)


def _config_error(path: Path, err: ValidationError) -> ConfigError:
    first = err.errors()[0]
    loc = tuple(first["loc"])
    key = ".".join(str(p) for p in loc)
    if first["type"] == "extra_forbidden":
        return ConfigError(path, key, "unknown key (remove it or check its spelling; see `flux config`)")
    expected = _expected(loc)
    got = first.get("input")
    detail = first["msg"]
    if expected:
        detail = f"expected {expected}, got {got!r} ({detail})"
    return ConfigError(path, key, detail)


def config_file(env: Mapping[str, str]) -> Path:
    """Return the flux.toml this environment selects (it may not exist)."""
    if env.get("FLUX_CONFIG"):
        return Path(env["FLUX_CONFIG"]).expanduser()
    base = Path(env.get("XDG_CONFIG_HOME") or Path(env.get("HOME", "~")) / ".config").expanduser()
    return base / "flux" / "flux.toml"


def read_file_settings(path: Path, *, required: bool) -> FileSettings:
    """Parse and validate one flux.toml; a missing optional file gives all defaults."""
    if not path.exists():
        if required:
            raise ConfigError(path, "", "FLUX_CONFIG names a file that does not exist")
        return FileSettings()
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, "", f"not valid TOML: {exc}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(path, "", f"cannot read: {exc}") from exc
    try:
        return FileSettings.model_validate(raw)
    except ValidationError as exc:
        raise _config_error(path, exc) from exc


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Load the process's settings from flux.toml and the environment.

    Args:
        env: the environment to read (``os.environ`` when None); tests pass their own.

    Raises:
        ConfigError: the file is not TOML, has an unknown key or a value of the wrong type.
    """
    env = os.environ if env is None else env
    path = config_file(env)
    fs = read_file_settings(path, required=bool(env.get("FLUX_CONFIG")))
    home = Path(env.get("HOME", "~")).expanduser()
    data_home = Path(env.get("XDG_DATA_HOME") or home / ".local" / "share")
    cache_home = Path(env.get("XDG_CACHE_HOME") or home / ".cache")
    data_dir = (fs.data_dir or data_home / "flux").expanduser()
    return Settings(
        config_path=path if path.exists() else None,
        models_dir=(fs.models_dir or data_dir / "models").expanduser(),
        cache_dir=(fs.cache_dir or cache_home / "flux").expanduser(),
        data_dir=data_dir,
        host_reserve_percent=fs.host_reserve_percent,
        plan=fs.plan,
        serve=fs.serve,
        engines=fs.engines,
        log_filter=env.get("FLUX_LOG", "info"),
        native_log=env.get("FLUX_NATIVE_LOG", "warn"),
        fault_inject=env.get("FLUX_FAULT_INJECT") or None,
        api_key=SecretStr(env["FLUX_API_KEY"]) if "FLUX_API_KEY" in env else None,
    )


def default_toml() -> str:
    """Return a flux.toml with every field at its default, for `flux config --defaults`."""
    fs = FileSettings()
    lines = [f"host_reserve_percent = {fs.host_reserve_percent}", "", "[plan]"]
    lines += [f"{k} = {v!r}" for k, v in fs.plan.model_dump().items()]
    lines += ["", "[serve]"]
    serve = fs.serve.model_dump(exclude={"worker_timeouts"})
    lines += [f"{k} = {_toml_value(v)}" if v is not None else f"# {k} = (not set)" for k, v in serve.items()]
    lines += ["", "[serve.worker_timeouts]"]
    lines += [f"{k} = {v!r}" for k, v in fs.serve.worker_timeouts.model_dump().items()]
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return f'"{v}"' if isinstance(v, str) else repr(v)
