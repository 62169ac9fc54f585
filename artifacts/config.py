"""Flux settings: every default in this one module, loaded once per process.

Order: ``$FLUX_CONFIG``, then ``~/.config/flux/flux.toml`` (``$XDG_CONFIG_HOME/flux/flux.toml``); a missing
file means all defaults. Every field has a default, so a file only lists overrides. An unknown key or a
wrong type is a :class:`ConfigError` naming the file, the key and the expected type.

This is the only module that reads ``os.environ``: entry points call :func:`load_settings` once and pass
the result down.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

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


class RoutingWatch(_Section):
    """``[serve.routing]``: how ``flux serve`` watches a MoE model's routing (docs/serving.md, Routing watch)."""

    count: Literal["off", "split", "moe"] = Field("off", description=(
        "which plans count their picks: off (the default until it is measured on a GPU), split (those with "
        "per-expert GPU copies, whose share is watched) or moe (every MoE plan: a trace for flux plan "
        "--routing-from); the callback costs every step ~0.4 us per graph node"))
    sample_every: int = Field(8, ge=0, description="count the expert picks of one decode step in this many (0: off)")
    window_tokens: int = Field(256, ge=1, description="sampled tokens of the recent share the warning reads")
    warn_points: float = Field(15.0, gt=0, le=100, description=(
        "warn once when the recent share of picks served by the plan's GPU copies is this many points below the plan's"))
    check_s: float = Field(30.0, gt=0, description="seconds between looks at the counts (and saves of the trace)")


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
    kv_host_bytes: int | None = Field(None, ge=0, description=(
        "RAM for KV pages on the host, instead of the RAM available at start minus the weights kept in RAM and the "
        "host reserve (docs/serving.md, KV pages and admission); a small value makes the page limit reachable"))
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
    routing: RoutingWatch = RoutingWatch()


class EngineSettings(_Section):
    """``[engines.NAME]``: any OpenAI-compatible engine; ``{port}``, ``{model}``, ``{ctx}`` are substituted."""

    command: list[str] = Field(min_length=1, description="argv template of a process answering OpenAI's "
                               "/v1/completions on 127.0.0.1:{port}")
    args: list[str] = []
    architectures: list[str] = []
    start_timeout_s: float = Field(120.0, gt=0, description="longest wait for it to answer after its start")
    grammar: bool = Field(False, description="it takes llama.cpp's `grammar` field (tools and structured output)")


class RpcSettings(_Section):
    """``[rpc]``: llama.cpp RPC servers (``flux rpc-server``) that ``flux plan`` may place layers on."""

    servers: list[str] = Field(default_factory=list, description="host:port of each server (flux plan --rpc)")


class FileSettings(_Section):
    """What a flux.toml may contain (all optional)."""

    models_dir: LoosePath | None = None
    cache_dir: LoosePath | None = None
    data_dir: LoosePath | None = None
    host_reserve_percent: float = Field(10.0, ge=0, lt=100)
    plan: PlanSettings = PlanSettings()
    serve: ServeSettings = ServeSettings()
    engines: dict[str, EngineSettings] = {}
    rpc: RpcSettings = RpcSettings()


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
    rpc: RpcSettings = RpcSettings()
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
    return _settings(fs, path if path.exists() else None, env)


def default_settings(env: Mapping[str, str] | None = None) -> Settings:
    """The settings with no flux.toml: every default, the locations from the environment (``XDG_*``, ``HOME``)."""
    return _settings(FileSettings(), None, os.environ if env is None else env)


def _settings(fs: FileSettings, path: Path | None, env: Mapping[str, str]) -> Settings:
    home = Path(env.get("HOME", "~")).expanduser()
    data_home = Path(env.get("XDG_DATA_HOME") or home / ".local" / "share")
    cache_home = Path(env.get("XDG_CACHE_HOME") or home / ".cache")
    data_dir = (fs.data_dir or data_home / "flux").expanduser()
    return Settings(
        config_path=path,
        models_dir=(fs.models_dir or data_dir / "models").expanduser(),
        cache_dir=(fs.cache_dir or cache_home / "flux").expanduser(),
        data_dir=data_dir,
        host_reserve_percent=fs.host_reserve_percent,
        plan=fs.plan,
        serve=fs.serve,
        engines=fs.engines,
        rpc=fs.rpc,
        log_filter=env.get("FLUX_LOG", "info"),
        native_log=env.get("FLUX_NATIVE_LOG", "warn"),
        fault_inject=env.get("FLUX_FAULT_INJECT") or None,
        api_key=SecretStr(env["FLUX_API_KEY"]) if "FLUX_API_KEY" in env else None,
    )


def settings_toml(settings: Settings) -> str:
    """Return ``settings`` as a flux.toml (every field a file may set; paths resolved), for `flux config`.

    Loading the text back gives the same settings; what comes from elsewhere than the file (the file's own path,
    ``FLUX_LOG``) is in comments, the API key never.
    """
    source = f"defaults + {settings.config_path}" if settings.config_path else "defaults (no flux.toml)"
    head = [f"# effective settings: {source}",
            f"# environment: FLUX_LOG={settings.log_filter} FLUX_NATIVE_LOG={settings.native_log}"]
    return "\n".join(head + _toml_table(settings, list(FileSettings.model_fields), ())) + "\n"


def default_toml(env: Mapping[str, str] | None = None) -> str:
    """Return a flux.toml with every field at its default, for `flux config --defaults`.

    The locations (models_dir, cache_dir, data_dir) are the defaults of this environment (``XDG_*``, ``HOME``).
    """
    lines = ["# every default; a flux.toml only needs the lines it changes"]
    lines += _toml_table(default_settings(env), list(FileSettings.model_fields), ())
    lines += ["", "# [engines.NAME]: none by default; keys command, args, architectures (see README.md)"]
    return "\n".join(lines) + "\n"


def _toml_table(model: BaseModel, names: list[str], prefix: tuple[str, ...]) -> list[str]:
    """TOML lines for these fields of ``model``: its values, then its sub-tables (TOML wants them in that order)."""
    lines: list[str] = []
    tables: list[tuple[tuple[str, ...], BaseModel]] = []
    for name in names:
        v = getattr(model, name)
        if isinstance(v, BaseModel):
            tables.append(((*prefix, name), v))
        elif isinstance(v, dict) and _holds_models(type(model), name):  # [engines.NAME]
            tables += [((*prefix, name, k), x) for k, x in v.items()]
        elif v is None:
            lines.append(f"# {_toml_key(name)} = (not set)")
        else:
            lines.append(f"{_toml_key(name)} = {_toml_value(v)}")
    if prefix and lines:
        lines.insert(0, f"[{'.'.join(_toml_key(p) for p in prefix)}]")
    for sub_prefix, sub in tables:
        lines += ["", *_toml_table(sub, list(type(sub).model_fields), sub_prefix)]
    return lines


def _holds_models(cls: type[BaseModel], name: str) -> bool:
    """Whether field ``name`` is a ``dict[str, <model>]`` (a table of tables), not an inline table of values."""
    args = get_args(cls.model_fields[name].annotation)
    return len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], BaseModel)


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key, ensure_ascii=False)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    # TOML basic strings take JSON's escapes, and want DEL escaped too
    return json.dumps(str(v), ensure_ascii=False).replace("\x7f", "\\u007F")
