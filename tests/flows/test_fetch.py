"""`flux fetch` against a local server that answers huggingface_hub as the hub does (tests/hub_server.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from artifacts.hub import HubFile, gguf_models
from tests.conftest import FluxRunner
from tests.hub_server import COMMIT, Repo, serve_hub

TWIN = "flux-test/tiny-moe-GGUF"
CHUNK = 10 * 2**20  # huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE


def _env(url: str, models: Path) -> dict[str, str]:
    return {"HF_ENDPOINT": url, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HOME": str(models.parent / "hf-home"), "FLUX_CONFIG": str(models.parent / "flux.toml")}


def _config(tmp_path: Path) -> Path:
    models = tmp_path / "models"
    (tmp_path / "flux.toml").write_text(f'models_dir = "{models}"\n')
    return models


def _ggufs(models: Path) -> list[Path]:
    return sorted(p for p in models.rglob("*") if p.is_file() and p.name.endswith((".gguf", ".incomplete")))


def _one_error_line(stderr: str) -> str:
    """The error: one line, the last (before it the progress log and huggingface_hub's retry notes), no traceback."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert [ln for ln in lines if ln.startswith("error")] == lines[-1:], stderr
    assert lines[-1].startswith("error: flux fetch") and "Traceback" not in stderr, stderr
    return lines[-1]


def test_a_cut_download_resumes_and_the_twin_is_checked_and_loads(flux: FluxRunner, slow_model: Path,
                                                                   tmp_path: Path) -> None:
    # huggingface_hub writes what it received in 10 MiB chunks and resumes from the last whole one: the twin is
    # 70 MB and the cut falls past its third chunk
    data = slow_model.read_bytes()
    cut = 35_000_000
    models = _config(tmp_path)
    with serve_hub({TWIN: Repo(files={"tiny-moe-Q4_0.gguf": data, "README.md": b"# twin\n"},
                               cut_after={"tiny-moe-Q4_0.gguf": cut})}) as hub:
        out = flux("fetch", TWIN, env=_env(hub.url, models))
        assert out.returncode == 0, out.stderr
        path = Path(out.stdout.strip())
        assert path == models / TWIN / "tiny-moe-Q4_0.gguf"
        assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(data).digest()
        gets = [(p, r) for m, p, r in hub.requests if m == "GET" and p.endswith(".gguf")]
        url = f"/{TWIN}/resolve/{COMMIT}/tiny-moe-Q4_0.gguf"
        assert gets == [(url, ""), (url, f"bytes={3 * CHUNK}-")]  # resumed from the last whole chunk before the cut
        assert "sha256 checked now" in out.stderr and f"flux plan {path}" in out.stderr
        # the path is a model llama.cpp's loader takes
        shown = flux("inspect", str(path), "--no-hash", env=_env(hub.url, models))
        assert shown.returncode == 0, shown.stderr
        assert "llama" in shown.stdout
        # a second fetch downloads nothing and hashes nothing
        n = len(hub.requests)
        again = flux("fetch", f"{TWIN}:tiny-moe-Q4_0.gguf", "--revision", COMMIT, env=_env(hub.url, models))
        assert again.returncode == 0, again.stderr
        assert Path(again.stdout.strip()) == path and "checked before" in again.stderr
        assert not [m for m, p, _ in hub.requests[n:] if m == "GET" and p.endswith(".gguf")]


def test_several_quants_are_listed_and_the_named_one_is_fetched(flux: FluxRunner, tmp_path: Path) -> None:
    files = {"m-Q4_0.gguf": b"GGUF q4" * 100, "m-Q8_0.gguf": b"GGUF q8" * 200, "mmproj-m-F16.gguf": b"GGUF p" * 10}
    models = _config(tmp_path)
    with serve_hub({"o/m-GGUF": Repo(files=files)}) as hub:
        out = flux("fetch", "o/m-GGUF", env=_env(hub.url, models))
        assert out.returncode == 2
        err = out.stderr.strip().splitlines()
        assert err[-1].startswith("error: flux fetch o/m-GGUF: 2 GGUF models here; name one as "
                                  "`flux fetch o/m-GGUF:FILE`: m-Q4_0.gguf, m-Q8_0.gguf")
        assert any("m-Q8_0.gguf" in ln and "0.000" in ln for ln in err[:-1])  # the table: name, files, GB
        assert _ggufs(models) == []
        got = flux("fetch", "o/m-GGUF:m-Q8_0.gguf", env=_env(hub.url, models))
        assert got.returncode == 0, got.stderr
        assert _ggufs(models) == [models / "o/m-GGUF/m-Q8_0.gguf"]
        assert Path(got.stdout.strip()).read_bytes() == files["m-Q8_0.gguf"]


def test_a_split_model_is_fetched_whole(flux: FluxRunner, tmp_path: Path) -> None:
    shards = {f"big/big-Q4_0-{i:05d}-of-00003.gguf": bytes([i]) * (1000 + i) for i in (1, 2, 3)}
    models = _config(tmp_path)
    with serve_hub({"o/big": Repo(files=shards)}) as hub:
        out = flux("fetch", "o/big", env=_env(hub.url, models))
        assert out.returncode == 0, out.stderr
        assert Path(out.stdout.strip()) == models / "o/big/big/big-Q4_0-00001-of-00003.gguf"
        assert _ggufs(models) == [models / "o/big" / name for name in sorted(shards)]
        assert "3 file(s)" in out.stderr


def test_a_wrong_checksum_is_refused_and_nothing_is_left(flux: FluxRunner, tmp_path: Path) -> None:
    models = _config(tmp_path)
    repo = Repo(files={"m.gguf": b"GGUF" + bytes(4000)}, listed_sha256={"m.gguf": "ab" * 32})
    with serve_hub({"o/m": repo}) as hub:
        out = flux("fetch", "o/m", env=_env(hub.url, models))
    assert out.returncode == 2
    line = _one_error_line(out.stderr)
    assert "m.gguf has sha256" in line and "the hub lists abababababababab" in line and "removed" in line
    assert _ggufs(models) == []


def test_a_download_that_fails_leaves_no_file(flux: FluxRunner, tmp_path: Path) -> None:
    models = _config(tmp_path)
    repo = Repo(files={"m.gguf": b"GGUF" + bytes(100_000)}, cut_after={"m.gguf": 5000}, fail_after_cut=True)
    with serve_hub({"o/m": repo}) as hub:
        out = flux("fetch", "o/m", env=_env(hub.url, models))
    assert out.returncode == 2
    assert "the hub answered 503" in _one_error_line(out.stderr)
    assert _ggufs(models) == []


@pytest.mark.parametrize(("spec", "extra", "says"), [
    ("o/none", [], "no such repository on http://127.0.0.1"),
    ("o/m:m-Q2_K.gguf", [], "no file m-Q2_K.gguf at this revision; its GGUF models: m.gguf"),
    ("o/m", ["--revision", "v9"], "revision 'v9' does not resolve"),
    ("o/readme-only", [], "no .gguf file at this revision"),
    ("just-a-name", [], "expected OWNER/NAME or OWNER/NAME:FILE.gguf"),
])
def test_bad_input_is_one_line_and_exit_2(flux: FluxRunner, tmp_path: Path, spec: str, extra: list[str],
                                          says: str) -> None:
    models = _config(tmp_path)
    repos = {"o/m": Repo(files={"m.gguf": b"GGUF"}), "o/readme-only": Repo(files={"README.md": b"hi"})}
    with serve_hub(repos) as hub:
        out = flux("fetch", spec, *extra, env=_env(hub.url, models))
    assert out.returncode == 2
    assert says in _one_error_line(out.stderr)
    assert _ggufs(models) == []


def test_split_shards_group_into_models_only_when_complete() -> None:
    files = [HubFile(name=n) for n in ("a-00001-of-00002.gguf", "a-00002-of-00002.gguf", "b-00001-of-00002.gguf",
                                       "c.gguf", "c.safetensors")]
    got = gguf_models(files)
    assert [(m.name, [f.name for f in m.files]) for m in got] == [
        ("a-00001-of-00002.gguf", ["a-00001-of-00002.gguf", "a-00002-of-00002.gguf"]), ("c.gguf", ["c.gguf"])]
