"""`flux plan` with no model synthesizes its tiny default twin under models_dir (not the cache)."""

from __future__ import annotations

from pathlib import Path


def test_default_twin_lands_in_models_dir(flux, flux_env: dict[str, str], tmp_path: Path) -> None:
    # a bad flag stops `flux plan` right after the model is chosen: no backend or measurement needed
    got = flux("plan", "--concurrency", "0")
    assert got.returncode == 2, got.stderr
    models = Path(flux_env["XDG_DATA_HOME"]) / "flux" / "models"
    assert [p.name for p in models.glob("*.gguf")] == ["tiny-moe-Q4_0.gguf"]
    assert not (Path(flux_env["XDG_CACHE_HOME"]) / "flux" / "models").exists()  # where it used to go


def test_models_dir_from_flux_toml_is_used(flux, flux_env: dict[str, str], tmp_path: Path) -> None:
    cfg = tmp_path / "flux.toml"
    cfg.write_text(f'models_dir = "{tmp_path / "my models"}"\n')
    got = flux("plan", "--concurrency", "0", env={"FLUX_CONFIG": str(cfg)})
    assert got.returncode == 2, got.stderr
    twin = tmp_path / "my models" / "tiny-moe-Q4_0.gguf"
    assert twin.is_file() and twin.stat().st_size > 0
    mtime = twin.stat().st_mtime_ns
    flux("plan", "--concurrency", "0", env={"FLUX_CONFIG": str(cfg)})
    assert twin.stat().st_mtime_ns == mtime, "synthesized once, then reused"
