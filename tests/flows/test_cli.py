"""The real `flux` CLI in a subprocess: help, synth → inspect, and one-line errors for bad input."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

COMMANDS = ["synth", "inspect", "version", "config", "devices", "generate"]


def one_line_error(proc: object, *needles: str) -> None:
    rc, err = proc.returncode, proc.stderr  # type: ignore[attr-defined]
    assert rc == 2, (rc, err)
    assert "Traceback" not in err
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_help_lists_every_command(flux) -> None:
    out = flux("--help")
    assert out.returncode == 0
    for c in COMMANDS:
        assert c in out.stdout
        sub = flux(c, "--help")
        assert sub.returncode == 0 and "usage: flux " + c in sub.stdout


def test_synth_then_inspect_json(flux, tmp_path: Path) -> None:
    model = tmp_path / "t.gguf"
    made = flux("synth", "--like", "tiny-moe", "-o", str(model))
    assert made.returncode == 0, made.stderr
    assert model.stat().st_size < 10_000_000
    out = flux("inspect", str(model), "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["architecture"] == "qwen3moe" and info["supported"] is True
    assert info["experts"]["total"] == info["n_expert"] > 0
    assert len(info["layers"]) == info["n_layer"]
    assert info["file_bytes"] == model.stat().st_size
    assert len(info["content_hash"]) == 64
    assert set(info["kv_bytes_per_token"]) >= {"f16", "q8_0", "q4_0"}
    human = flux("inspect", str(model))
    assert human.returncode == 0 and "qwen3moe" in human.stdout and "experts_gate" in human.stdout


def test_synth_overrides(flux, tmp_path: Path) -> None:
    model = tmp_path / "o.gguf"
    assert flux("synth", "--like", "tiny-dense", "--set", "n_layer=3", "-o", str(model)).returncode == 0
    info = json.loads(flux("inspect", str(model), "--json", "--no-hash").stdout)
    assert info["n_layer"] == 3
    bad = flux("synth", "--like", "tiny-dense", "--set", "n_layr=3", "-o", str(model))
    one_line_error(bad, "n_layr")


def test_not_gguf(flux, tmp_path: Path) -> None:
    p = tmp_path / "notes.gguf"
    p.write_text("hello, I am text\n" * 10)
    one_line_error(flux("inspect", str(p)), str(p), "not a GGUF")


def test_truncated(flux, tiny_moe: Path, tmp_path: Path) -> None:
    p = tmp_path / "cut.gguf"
    p.write_bytes(tiny_moe.read_bytes()[:200_000])
    one_line_error(flux("inspect", str(p)), str(p), "truncated")


def test_unknown_version(flux, tiny_moe: Path, tmp_path: Path) -> None:
    raw = bytearray(tiny_moe.read_bytes())
    raw[4:8] = struct.pack("<I", 9)
    p = tmp_path / "v9.gguf"
    p.write_bytes(bytes(raw))
    one_line_error(flux("inspect", str(p)), str(p), "version 9")


def test_unsupported_architecture(flux, tiny_dense: Path, tmp_path: Path) -> None:
    raw = tiny_dense.read_bytes()
    key = b"general.architecture"
    at = raw.index(key) + len(key) + 4 + 8
    assert raw[at : at + 5] == b"llama"
    p = tmp_path / "odd.gguf"
    p.write_bytes(raw[:at] + b"zzzzz" + raw[at + 5 :])
    one_line_error(flux("inspect", str(p)), str(p), "zzzzz", "not implemented")


def test_missing_shard(flux, tmp_path: Path) -> None:
    p = tmp_path / "m-00001-of-00002.gguf"
    p.write_bytes(b"GGUF")
    one_line_error(flux("inspect", str(p)), "m-00002-of-00002.gguf", "missing shard")


@pytest.mark.parametrize("kind", ["absent", "dir", "noperm"])
def test_unreadable(flux, tmp_path: Path, kind: str) -> None:
    p = tmp_path / "x.gguf"
    if kind == "dir":
        p.mkdir()
    elif kind == "noperm":
        p.write_bytes(b"GGUF")
        p.chmod(0)
        import os

        if os.geteuid() == 0:
            pytest.skip("root reads any file")
    one_line_error(flux("inspect", str(p)), str(p))


def test_broken_config(flux, tmp_path: Path, tiny_moe: Path) -> None:
    cfg = tmp_path / "flux.toml"
    cfg.write_text("[serve]\nport = 'x'\n")
    one_line_error(flux("inspect", str(tiny_moe), env={"FLUX_CONFIG": str(cfg)}), str(cfg), "serve.port")
    cfg.write_text("[plan]\nbudget = 3\n")
    one_line_error(flux("config", env={"FLUX_CONFIG": str(cfg)}), "plan.budget", "unknown key")


def test_generate_through_the_worker(flux, tiny_moe: Path) -> None:
    out = flux("generate", str(tiny_moe), "--prompt", "Hello", "-n", "8")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Hello") and "8 tokens" in out.stdout
    chat = flux("generate", str(tiny_moe), "--chat", "--prompt", "Hi", "-n", "4")
    assert chat.returncode == 0, chat.stderr
    assert "completion tokens" in chat.stdout


def test_a_model_path_relative_to_where_the_user_stands(flux_env: dict[str, str], tiny_moe: Path,
                                                         tmp_path: Path) -> None:
    """The workers run in another directory: a relative path reaches them made absolute."""
    shutil.copy(tiny_moe, tmp_path / "m.gguf")
    out = subprocess.run([sys.executable, "-m", "flows", "generate", "m.gguf", "--prompt", "Hello", "-n", "4"],
                         env=flux_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "4 tokens" in out.stdout, out.stderr


def test_version_prints_build_id(flux) -> None:
    out = flux("version", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert len(info["build_id"]) == 16 and info["pin"]["LLAMA_CPP_PYTHON_VERSION"] == "0.3.36"
    assert any(name.startswith("libllama") for name in info["libraries"])


@pytest.mark.parametrize(("flags", "needle"), [
    (["--kv", "q9_9"], "--kv"), (["--budget-s", "-3"], "--budget-s"), (["--concurrency", "0"], "--concurrency"),
    (["--ctx", "5"], "--ctx"), (["--workload", "batch"], "--workload"), (["--gpu-mem-budget", "x"], "--gpu-mem-budget"),
    (["--no-such-flag"], "unrecognized"),
])
def test_bad_plan_flags_are_one_line(flux, tiny_moe: Path, flags: list[str], needle: str) -> None:
    one_line_error(flux("plan", str(tiny_moe), *flags), needle)


def test_synth_a_draft_and_its_acceptance(flux, flux_env: dict[str, str], tiny_moe: Path, tmp_path: Path) -> None:
    # paths relative to where the user stands (the workers that measure the acceptance run elsewhere)
    shutil.copy(tiny_moe, tmp_path / "t.gguf")
    r = subprocess.run([sys.executable, "-m", "flows", "synth", "--draft-of", "t.gguf", "--layers", "1", "-o", "d.gguf"],
                       env=flux_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "the first 1 of 4 layers" in r.stdout and "acceptance: the draft's greedy token is the target's at" in r.stdout
    missing = flux("synth", "--draft-of", str(tmp_path / "nope.gguf"), "-o", str(tmp_path / "d2.gguf"))
    assert missing.returncode == 2 and "is not a file" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1
    deep = flux("synth", "--draft-of", str(tiny_moe), "--layers", "4", "-o", str(tmp_path / "d3.gguf"))
    assert deep.returncode == 2 and "takes 1 to 3 of its 4 layers" in deep.stderr
    both = flux("synth", "--draft-of", str(tiny_moe), "--like", "tiny-moe", "-o", str(tmp_path / "d4.gguf"))
    assert both.returncode == 2
