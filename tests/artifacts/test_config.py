"""flux.toml loading: defaults, overrides, and one-line errors naming file, key and type."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from artifacts.config import FileSettings, default_toml, load_settings
from artifacts.errors import ConfigError


def env_for(tmp_path: Path, text: str | None) -> dict[str, str]:
    env = {"HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / "d"), "XDG_CACHE_HOME": str(tmp_path / "c")}
    if text is not None:
        cfg = tmp_path / "flux.toml"
        cfg.write_text(text)
        env["FLUX_CONFIG"] = str(cfg)
    return env


def test_defaults_without_a_file(tmp_path: Path) -> None:
    s = load_settings(env_for(tmp_path, None))
    assert s.config_path is None
    assert s.serve.port == 8090 and s.serve.min_reply == 4096 and s.plan.tuning_budget_s == 600
    assert s.serve.worker_timeouts.load_s == 1800 and s.host_reserve_percent == 10
    assert s.data_dir == tmp_path / "d" / "flux" and s.cache_dir == tmp_path / "c" / "flux"
    assert s.models_dir == s.data_dir / "models"


def test_seed_example_is_accepted(tmp_path: Path) -> None:
    text = """
models_dir = "/data/models"
cache_dir = "/data/flux-cache"
host_reserve_percent = 10
[plan]
tuning_budget_s = 600
[serve]
port = 8091
prefill_timeout_s = 300
decode_timeout_s = 120
client_write_timeout_s = 30
replan_timeout_s = 3600
journal_max_bytes = 268435456
min_reply = 4096
[serve.worker_timeouts]
hello_s = 30
load_s = 1800
rpc_s = 120
write_s = 30
[engines.my-engine]
command = ["my-engine", "serve"]
args = ["--port", "{port}", "--model", "{model}", "--ctx-size", "{ctx}"]
architectures = ["qwen3moe"]
"""
    s = load_settings(env_for(tmp_path, text))
    assert s.serve.port == 8091
    assert s.cache_dir == Path("/data/flux-cache")
    assert s.engines["my-engine"].architectures == ["qwen3moe"]


def test_unknown_key_names_file_and_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(env_for(tmp_path, "[serve]\nprot = 1\n"))
    assert "flux.toml" in str(exc.value) and "serve.prot" in str(exc.value) and "unknown key" in str(exc.value)


def test_wrong_type_names_expected_type(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(env_for(tmp_path, '[serve]\nport = "eighty"\n'))
    msg = str(exc.value)
    assert "serve.port" in msg and "expected int" in msg and "eighty" in msg


def test_not_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(env_for(tmp_path, "[serve\nport=1"))


def test_flux_config_pointing_nowhere(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings({"HOME": str(tmp_path), "FLUX_CONFIG": str(tmp_path / "nope.toml")})


def test_default_toml_round_trips(tmp_path: Path) -> None:
    s = load_settings(env_for(tmp_path, default_toml()))
    assert s.plan == FileSettings().plan and s.serve == FileSettings().serve


def test_flux_log_is_read(tmp_path: Path) -> None:
    env = env_for(tmp_path, None) | {"FLUX_LOG": "debug"}
    assert load_settings(env).log_filter == "debug"


@settings(max_examples=60, deadline=None)
@given(port=st.integers(0, 65535), budget=st.floats(1, 1e5), reserve=st.floats(0, 99.9),
       min_reply=st.integers(1, 1 << 20))
def test_valid_values_load(tmp_path_factory: pytest.TempPathFactory, port: int, budget: float, reserve: float,
                           min_reply: int) -> None:
    tmp = tmp_path_factory.mktemp("cfg")
    text = f"host_reserve_percent = {reserve!r}\n[plan]\ntuning_budget_s = {budget!r}\n[serve]\nport = {port}\nmin_reply = {min_reply}\n"
    s = load_settings(env_for(tmp, text))
    assert (s.serve.port, s.serve.min_reply) == (port, min_reply)
    assert s.plan.tuning_budget_s == pytest.approx(budget) and s.host_reserve_percent == pytest.approx(reserve)


@settings(max_examples=60, deadline=None)
@given(key=st.from_regex(r"[a-z][a-z_]{0,12}", fullmatch=True))
def test_unknown_top_level_keys_fail(tmp_path_factory: pytest.TempPathFactory, key: str) -> None:
    if key in FileSettings.model_fields:
        return
    tmp = tmp_path_factory.mktemp("cfg")
    with pytest.raises(ConfigError) as exc:
        load_settings(env_for(tmp, f"{key} = 1\n"))
    assert key in str(exc.value)


@settings(max_examples=40, deadline=None)
@given(bad=st.sampled_from(['"x"', "true", "[1, 2]", "-5", "1e9"]))
def test_bad_port_values_fail(tmp_path_factory: pytest.TempPathFactory, bad: str) -> None:
    tmp = tmp_path_factory.mktemp("cfg")
    with pytest.raises(ConfigError, match="serve.port"):
        load_settings(env_for(tmp, f"[serve]\nport = {bad}\n"))
