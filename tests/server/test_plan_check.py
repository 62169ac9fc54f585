"""Startup refuses a plan that was edited or does not match this machine: exit 2 and one line."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from support import REPO, ServeEnv

import server.__main__ as entry
from artifacts.records.plan import Plan
from artifacts.store import Store

MakePlan = Callable[..., Plan]


def _serve_in_process(senv: ServeEnv, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                      prefix: str) -> tuple[int, list[str]]:
    for k, v in senv.env.items():
        monkeypatch.setenv(k, v)
    code = entry.main([prefix, "--port", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def test_hand_edited_plan_is_refused(senv: ServeEnv, plan_maker: MakePlan, tiny_moe: Path) -> None:
    plan = plan_maker(senv.settings, tiny_moe, n_ctx=768)
    path = Store(senv.settings.data_dir).data_dir / "objects" / "plan" / f"{plan.id}.json"
    raw = json.loads(path.read_text())
    raw["candidate"]["params"]["n_ctx"] = 4096  # a "small fix" by hand
    path.write_text(json.dumps(raw))
    out = subprocess.run([sys.executable, "-m", "server", plan.id[:10], "--port", "0"], env=senv.env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "edited by hand" in lines[0] and f"flux plan {tiny_moe} --replan" in lines[0]


@pytest.mark.parametrize(("field", "value"), [("backend_build", "0123456789abcdef"), ("driver", "580.1"),
                                              ("hardware_fingerprint", "f" * 64), ("model_hash", "e" * 64)])
def test_mismatched_key_field_is_named(senv: ServeEnv, plan_maker: MakePlan, tiny_moe: Path, field: str, value: str,
                                       monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_maker(senv.settings, tiny_moe, **{field: value})
    code, err = _serve_in_process(senv, monkeypatch, capsys, plan.id[:12])
    assert code == 2 and len(err) == 1, err
    line = err[0]
    assert f"{field} differs" in line and "--replan" in line
    assert value[:16] in line, "expected value shown"


def test_missing_model_file_is_a_model_hash_mismatch(senv: ServeEnv, plan_maker: MakePlan, tiny_moe: Path,
                                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    moved = tmp_path / "moved.gguf"
    moved.write_bytes(tiny_moe.read_bytes())
    plan = plan_maker(senv.settings, moved)
    moved.unlink()
    code, err = _serve_in_process(senv, monkeypatch, capsys, plan.id[:12])
    assert code == 2 and len(err) == 1 and "model_hash differs" in err[0] and "this machine: none" in err[0]


def test_unknown_plan_prefix_is_one_line(senv: ServeEnv, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _serve_in_process(senv, monkeypatch, capsys, "zzzz")
    assert code == 2 and len(err) == 1 and "zzzz" in err[0]


def test_flux_serve_registers_the_same_flags() -> None:
    from flows.commands import serve as cmd_serve

    parser = argparse.ArgumentParser()
    cmd_serve.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "3f2a", "--port", "9000", "--api-key", "k"])
    assert (args.plan, args.port, args.api_key, args.host) == ("3f2a", 9000, "k", None)
    assert args.handler is cmd_serve.cmd_serve
