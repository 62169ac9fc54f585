"""docs/notebooks/flux-results.ipynb runs headless top to bottom (nbclient), on an empty data dir and on
one with a tiny plan and one bench run."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_support import bench_settings, make_plan, session_cache

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "docs" / "notebooks" / "flux-results.ipynb"

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")


def execute(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Run every cell in a fresh kernel whose environment selects the test's Flux dirs; the cells' text and Markdown."""
    for key in [k for k in __import__("os").environ if k.startswith(("FLUX_", "XDG_"))]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith(("FLUX_", "XDG_")) or key in ("HOME", "PYTHONPATH"):
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=120,
                                     resources={"metadata": {"path": str(REPO)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    texts = [o.get("text", "") for o in outputs if o.get("output_type") == "stream"]
    texts += [o["data"].get("text/markdown", "") for o in outputs if "data" in o]
    assert any("image/png" in o.get("data", {}) for o in outputs) or "no speed ratios" in "".join(texts)
    return texts


def test_notebook_runs_on_an_empty_store(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _, env = bench_settings(tmp_path, session_cache(tmp_path_factory))
    text = "".join(execute(env, monkeypatch))
    assert "no plans yet" in text and "no benchmark results yet" in text
    assert "qwen3-30b-a3b" in text, "an empty store still shows the GPU record committed with the docs"


def test_notebook_reads_plans_and_bench_results(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                monkeypatch: pytest.MonkeyPatch, tiny_moe: Path) -> None:
    from tasks.bench.context import open_bench
    from tasks.bench.record import save_run
    from tasks.bench.run import RunOptions, bench_run

    st, env = bench_settings(tmp_path, session_cache(tmp_path_factory))
    plan = make_plan(st, tiny_moe)
    save_run(bench_run(open_bench(st, plan.id[:12]), RunOptions(rounds=2, prompts=1, n_gen=4, baselines=("defaults",))))
    text = "".join(execute(env, monkeypatch))
    assert plan.id[:12] in text and "tiny-moe" in text
    assert "defaults" in text and "no benchmark results yet" not in text
