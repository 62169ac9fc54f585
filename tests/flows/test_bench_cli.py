"""`flux bench ...` end to end: the real CLI in a subprocess against an isolated data dir with a tiny plan."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from bench_support import bench_settings, make_plan, session_cache

from artifacts.config import Settings
from artifacts.records.plan import Plan
from artifacts.store import Store

REPO = Path(__file__).resolve().parents[2]
# Runs `flux` with flows.commands.bench registered even before flows/cli.py lists it.
SHIM = ("import sys\nfrom flows import cli\nif 'flows.commands.bench' not in cli.COMMAND_MODULES:\n"
        "    cli.COMMAND_MODULES = (*cli.COMMAND_MODULES, 'flows.commands.bench')\nsys.exit(cli.main(sys.argv[1:]))\n")
SUITES = ("run", "quality", "conformance", "ablate", "show", "matrix")


def flux(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The flux CLI in a subprocess."""
    return subprocess.run([sys.executable, "-c", SHIM, *args], env={**env, "PYTHONPATH": str(REPO)}, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> tuple[Settings, dict[str, str], Plan]:
    st, env = bench_settings(tmp_path_factory.mktemp("bench-cli"), session_cache(tmp_path_factory))
    return st, env, make_plan(st, tiny_moe)


def test_help_lists_every_suite_and_each_has_help(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from flows import cli

    assert "flows.commands.bench" in cli.COMMAND_MODULES
    parser = cli.build_parser()
    for argv in (["bench", "--help"], *(["bench", s, "--help"] for s in SUITES)):
        with pytest.raises(SystemExit) as done:
            parser.parse_args(argv)
        assert done.value.code == 0
    out = capsys.readouterr().out
    for suite in SUITES:
        assert f"flux bench {suite}" in out
    assert "--baselines" in out and "--rounds" in out and "--suite" in out


def test_unknown_plan_prefix_is_one_line_and_exit_2(world: tuple[Settings, dict[str, str], Plan]) -> None:
    _, env, _ = world
    got = flux(env, "bench", "quality", "zz99")
    assert got.returncode == 2
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and "zz99" in lines[0] and "Traceback" not in got.stderr


def test_a_plan_whose_model_is_gone_is_a_clear_error(world: tuple[Settings, dict[str, str], Plan],
                                                     tmp_path: Path, tiny_moe: Path) -> None:
    st, env, _ = world
    model = tmp_path / "gone.gguf"
    model.write_bytes(tiny_moe.read_bytes())
    plan = make_plan(st, model)
    model.unlink()
    got = flux(env, "bench", "run", plan.id[:12], "--rounds", "1")
    assert got.returncode == 2 and "Traceback" not in got.stderr
    assert str(model) in got.stderr and "gone" in got.stderr


def test_run_then_show_then_matrix(world: tuple[Settings, dict[str, str], Plan]) -> None:
    st, env, plan = world
    got = flux(env, "bench", "run", plan.id[:10], "--rounds", "2", "--prompts", "1", "--n-gen", "4",
               "--baselines", "defaults")
    assert got.returncode in (0, 1), got.stderr
    assert "flux bench run" in got.stdout and "defaults" in got.stdout and "per engine" in got.stdout
    rows = Store(st.data_dir).query("SELECT * FROM bench_summary").to_pylist()
    assert [(r["suite"], r["baseline"], r["plan_id"]) for r in rows] == [("run", "defaults", plan.id)]
    assert got.returncode == (1 if rows[0]["verdict"] == "fail" else 0)

    shown = flux(env, "bench", "show", plan.id[:10], "--suite", "run")
    assert shown.returncode == 0, shown.stderr
    pngs = sorted((st.data_dir / "bench" / plan.id[:12]).glob("run-*.png"))
    assert [p.name for p in pngs] == ["run-finalists.png", "run-tps-cdf.png"]
    assert all(p.stat().st_size > 10_000 and p.read_bytes()[:4] == b"\x89PNG" for p in pngs)
    assert str(pngs[0]) in shown.stdout

    matrix = flux(env, "bench", "matrix")
    assert matrix.returncode == 0
    line = next(x for x in matrix.stdout.splitlines() if plan.id[:12] in x)
    assert rows[0]["verdict"] in line and "—" in line
    for suite in ("run", "quality", "conformance", "soak", "arrivals", "ablate"):
        assert suite in matrix.stdout

    nothing = flux(env, "bench", "show", plan.id[:10], "--suite", "quality")
    assert nothing.returncode == 2 and "flux bench quality" in nothing.stderr


def test_a_stored_runs_own_facts_are_one_readable_line() -> None:
    from flows.bench_report import run_facts

    assert run_facts({"seconds": 10.46, "load_avg_start": [0.5, 0.4, 0.3], "load_avg_end": [1.25, 0.6, 0.4]}) == \
        "run: took 10.5 s; load average 0.50 before, 1.25 after (1 min)"
    assert run_facts({"seconds": 3}) == "run: took 3.0 s" and run_facts({}) == ""
