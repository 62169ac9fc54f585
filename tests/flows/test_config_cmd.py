"""`flux config` and `flux config --defaults`: both TOML, both with models_dir and cache_dir, both loadable."""

from __future__ import annotations

import tomllib
from pathlib import Path

from artifacts.config import FileSettings, load_settings


def test_config_prints_the_effective_settings_as_toml(flux, flux_env: dict[str, str], tmp_path: Path) -> None:
    cfg = tmp_path / "flux.toml"
    cfg.write_text('models_dir = "/data/models"\n[serve]\nport = 8091\ndevice_free_bytes = {CUDA0 = 1024}\n'
                   '[engines.my-engine]\ncommand = ["my-engine", "serve"]\narchitectures = ["qwen3moe"]\n')
    got = flux("config", env={"FLUX_CONFIG": str(cfg), "FLUX_API_KEY": "sekrit"})
    assert got.returncode == 0, got.stderr
    doc = tomllib.loads(got.stdout)
    assert doc["models_dir"] == "/data/models"
    assert doc["cache_dir"] == str(Path(flux_env["XDG_CACHE_HOME"]) / "flux")
    assert doc["serve"]["port"] == 8091 and doc["serve"]["device_free_bytes"] == {"CUDA0": 1024}
    assert doc["engines"]["my-engine"]["command"] == ["my-engine", "serve"]
    assert str(cfg) in got.stdout and "sekrit" not in got.stdout
    # the printed text is a flux.toml that gives the same settings back
    again = tmp_path / "again.toml"
    again.write_text(got.stdout)
    env = {**flux_env, "FLUX_CONFIG": str(again)}
    first = load_settings({**flux_env, "FLUX_CONFIG": str(cfg)})
    assert load_settings(env).model_dump(exclude={"config_path"}) == first.model_dump(exclude={"config_path"})


def test_defaults_are_toml_with_the_locations(flux, flux_env: dict[str, str], tmp_path: Path) -> None:
    cfg = tmp_path / "flux.toml"
    cfg.write_text('models_dir = "/data/models"\n[serve]\nport = 8091\n')
    got = flux("config", "--defaults", env={"FLUX_CONFIG": str(cfg)})
    assert got.returncode == 0, got.stderr
    doc = tomllib.loads(got.stdout)
    data = Path(flux_env["XDG_DATA_HOME"]) / "flux"
    assert doc["models_dir"] == str(data / "models")  # the default, not the file's override
    assert doc["cache_dir"] == str(Path(flux_env["XDG_CACHE_HOME"]) / "flux")
    assert doc["serve"]["port"] == 8090
    assert FileSettings.model_validate(doc).plan == FileSettings().plan


def test_without_a_file_both_forms_agree(flux) -> None:
    effective, defaults = flux("config"), flux("config", "--defaults")
    assert effective.returncode == defaults.returncode == 0
    assert tomllib.loads(effective.stdout) == tomllib.loads(defaults.stdout)
