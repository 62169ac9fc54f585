"""scripts/package.sh (issue 54 item 3): the tarball it makes, unpacked into a clean directory and installed into a
fresh virtual environment under a fresh home, gives a working `flux version`, `flux plan` and `flux serve` with no
compile. It packs the backend build already in the cache (build-backend.sh's), so nothing native is built here;
pip takes Flux's pure-Python dependencies from the package index (its own cache kept, as CI keeps it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
BACKEND = CACHE / "flux" / "backend" / "current"
BUDGET = 25

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (BACKEND / "build.json").is_file(),
                                 reason="no backend build in the cache: run scripts/build-backend.sh")]


def _home_env(home: Path) -> dict[str, str]:
    """A machine that has never seen Flux: its own HOME and XDG folders, no checkout on the path."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLUX_", "XDG_", "VIRTUAL_ENV", "PYTHONPATH", "PREFECT_"))}
    env.update({"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "XDG_DATA_HOME": str(home / "data"),
                "XDG_CONFIG_HOME": str(home / "config"), "DO_NOT_TRACK": "1",
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PIP_CACHE_DIR": os.environ.get("PIP_CACHE_DIR", str(CACHE / "pip"))})
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("package")
    made = subprocess.run(["bash", str(REPO / "scripts" / "package.sh"), str(root / "dist")], cwd=REPO,
                          capture_output=True, text=True, timeout=1200)
    assert made.returncode == 0, made.stderr[-4000:]
    tarball = Path(made.stdout.strip().splitlines()[-1])
    unpacked, home = root / "unpacked", root / "home"
    unpacked.mkdir()
    home.mkdir()
    with tarfile.open(tarball) as t:
        t.extractall(unpacked, filter="tar")
    (top,) = unpacked.iterdir()
    env = _home_env(home)
    venv = root / "venv"
    inst = subprocess.run(["bash", str(top / "install.sh"), str(venv)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=1800)
    assert inst.returncode == 0, inst.stderr[-4000:]
    return {"tarball": tarball, "top": top, "env": env, "venv": venv, "root": root, "home": home,
            "install_log": inst.stderr}


def _flux(inst: dict[str, object], *args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    venv = Path(str(inst["venv"]))
    return subprocess.run([str(venv / "bin" / "flux"), *args], cwd=str(inst["root"]), env=inst["env"],  # type: ignore[arg-type]
                          capture_output=True, text=True, timeout=timeout)


def test_the_tarball_holds_both_wheels_the_binaries_a_starter_config_and_an_install_script(
        installed: dict[str, object]) -> None:
    tarball, top = Path(str(installed["tarball"])), Path(str(installed["top"]))
    key = BACKEND.resolve().name
    assert re.fullmatch(rf"flux-[0-9][^-]*-{key}\.tar\.gz", tarball.name), tarball.name
    assert len(list((top / "wheels").glob("flux-*-py3-none-any.whl"))) == 1
    assert len(list((top / "backend" / key / "wheel").glob("llama_cpp_python-*.whl"))) == 1
    for exe in ("llama-server", "llama-bench", "rpc-server"):
        assert os.access(top / "backend" / key / "bin" / exe, os.X_OK), exe
    assert not (top / "backend" / key / "src").exists()
    manifest = json.loads((top / "MANIFEST.json").read_text())
    assert manifest["backend_key"] == key and manifest["build"]["key"] == key
    starter = (top / "flux.toml").read_text()
    assert "[plan]" in starter
    # the build machine's locations are comments: the installing machine's defaults apply
    assert all(str(Path.home()) not in line for line in starter.splitlines() if not line.startswith("#"))
    assert not re.search(r"^(models_dir|cache_dir|data_dir) =", starter, re.M), starter[:400]


def test_flux_version_from_the_fresh_venv_names_the_same_backend_build_as_this_checkout(
        installed: dict[str, object]) -> None:
    got = _flux(installed, "version", "--json")
    assert got.returncode == 0, got.stderr
    info = json.loads(got.stdout)
    here = subprocess.run([os.environ.get("PYTHON", "python3"), "-m", "flows", "version", "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert here.returncode == 0, here.stderr
    mine = json.loads(here.stdout)
    # the same pin, patches and libraries: a plan made from the tarball is valid where the backend was built
    assert info["build_id"] == mine["build_id"], (info, mine)
    server = Path(info["llama_server"])
    assert server.is_relative_to(Path(str(installed["home"]))), server  # the fresh home's cache, not the build's
    # nothing of the checkout is imported: Flux runs from the venv's site-packages
    where = subprocess.run([str(Path(str(installed["venv"])) / "bin" / "python"), "-c",
                            "import flows, engine_bridge.backend as b; print(flows.__file__); print(b.PIN_FILE)"],
                           env=installed["env"], cwd=str(installed["root"]), capture_output=True, text=True,  # type: ignore[arg-type]
                           timeout=120)
    assert where.returncode == 0, where.stderr
    assert all("site-packages" in line for line in where.stdout.splitlines()), where.stdout


def test_a_tiny_plan_and_its_serve_run_from_the_installed_package(installed: dict[str, object]) -> None:
    model = Path(str(installed["root"])) / "tiny.gguf"
    synth = _flux(installed, "synth", "--like", "tiny-moe", "--quant", "Q4_0", "-o", str(model))
    assert synth.returncode == 0, synth.stderr[-3000:]
    plan = _flux(installed, "plan", str(model), "--budget-s", str(BUDGET), "--ctx", "512", timeout=BUDGET + 600)
    assert plan.returncode == 0, plan.stderr[-4000:]
    pid = plan.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"[0-9a-f]{64}", pid), plan.stdout
    shown = _flux(installed, "show", pid[:12])
    assert shown.returncode == 0 and pid[:12] in shown.stdout, shown.stderr

    port = _free_port()
    venv = Path(str(installed["venv"]))
    log = (Path(str(installed["root"])) / "serve.log").open("w")
    proc = subprocess.Popen([str(venv / "bin" / "flux"), "serve", pid[:12], "--port", str(port)],
                            env=installed["env"], stdout=log, stderr=subprocess.STDOUT, text=True)  # type: ignore[arg-type]
    try:
        body = _first_completion(proc, f"http://127.0.0.1:{port}")
        assert body["usage"]["completion_tokens"] > 0, body
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        log.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _first_completion(proc: subprocess.Popen[str], base: str) -> dict[str, object]:
    """Wait for the server to come up (while it lives), then ask it for a completion."""
    while proc.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=10).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    assert proc.poll() is None, "flux serve exited"
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 8}, timeout=300)
    assert r.status_code == 200, r.text
    out: dict[str, object] = r.json()
    return out


def test_backend_pack_unpack_takes_the_tarball_in_pieces_into_the_cache(installed: dict[str, object],
                                                                         tmp_path: Path) -> None:
    """The GPU path (docs/gpu.md): the tarball, cut for a transfer limit, in .carry/backend/ where gpu-e2e.sh's
    `backend-pack.sh unpack` looks; its backend lands in the cache as build-backend.sh's cache hit wants it."""
    tarball, key = Path(str(installed["tarball"])), BACKEND.resolve().name
    carry = tmp_path / "carry"
    carry.mkdir()
    data = tarball.read_bytes()
    piece = 15 << 20
    for i in range(0, len(data), piece):
        (carry / f"{tarball.name}.{i // piece:02d}").write_bytes(data[i:i + piece])
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    got = subprocess.run(["bash", str(REPO / "scripts" / "backend-pack.sh"), "unpack", str(carry)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr
    cached = tmp_path / "cache" / "flux" / "backend"
    assert (cached / "current").resolve() == (cached / key).resolve()
    for rel in ("build.json", "bin/llama-server", "bin/llama-bench", "bin/rpc-server"):
        assert (cached / key / rel).read_bytes() == (BACKEND / rel).read_bytes(), rel
    assert list((cached / key / "wheel").glob("llama_cpp_python-*.whl"))
