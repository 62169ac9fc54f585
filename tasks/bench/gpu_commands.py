"""How ``flux bench record`` drives the product: each step is a ``flux`` command in its own process, exactly as a
user runs it, its output kept in the run's folder; nothing here plans, times or races on its own.

:class:`FluxCommands` runs one command (``python -m flows ...`` from the checkout, ``OUT/<name>.log`` holding its
command line, output and errors); the twins a pair needs are written once by ``flux synth`` (:func:`twin`,
:func:`draft_twin`, :func:`heads_twin`), a pair is planned by ``flux plan`` (:func:`plan_pair`, once more at the
budget a refusal names), and what ``flux bench run`` stored is read back from the store (:func:`summary_rows`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from artifacts.store import Store
from tasks.bench.context import Progress
from tasks.bench.errors import BenchError
from tasks.bench.gpu_pairs import Pair, refused_budget

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class FluxCommands:
    """Runs ``flux`` commands for one record run: the run's folder and where each command is announced."""

    out: Path
    say: Progress

    def __call__(self, *args: str, name: str, timeout_s: float = 3600) -> subprocess.CompletedProcess[str]:
        """Run one ``flux`` command as a user would; its output is kept in ``out/name.log``."""
        self.say("$ flux " + " ".join(args))
        # the user's environment, unbuffered: a command cut by its timeout still leaves what it wrote
        proc = subprocess.run([sys.executable, "-m", "flows", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=timeout_s, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        (self.out / f"{name}.log").write_text(f"$ flux {' '.join(args)}\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
        return proc

    def must(self, *args: str, name: str) -> None:
        """Run a command that the record cannot go on without; BenchError with its last errors when it fails."""
        proc = self(*args, name=name)
        if proc.returncode != 0:
            raise BenchError(f"flux {' '.join(args[:2])} failed: {proc.stderr[-500:]} (the whole log: "
                             f"{self.out / (name + '.log')})")


def twin_path(model_dir: Path, preset: str, routing: str) -> Path:
    """Where the twin of ``preset`` with ``routing`` lives (scripts/gpu-e2e.sh writes the same names)."""
    return model_dir / (f"{preset}-Q4_0.gguf" if routing == "uniform" else f"{preset}-{routing}-Q4_0.gguf")


def twin(flux: FluxCommands, model_dir: Path, preset: str, routing: str, extra: list[str]) -> Path:
    """The twin file, written once by ``flux synth``."""
    path = twin_path(model_dir, preset, routing)
    if not path.exists():
        flux.must("synth", "--like", preset, "--quant", "Q4_0", "--routing", routing, "-o", str(path), *extra,
                  name=f"synth-{preset}-{routing}")
    return path


def draft_twin(flux: FluxCommands, model: Path, layers: int) -> Path:
    """A draft of ``model`` made of its first ``layers`` layers, written once by ``flux synth --draft-of`` (which
    also measures and logs how often the draft's greedy token is the model's)."""
    path = model.with_name(f"{model.name.removesuffix('-Q4_0.gguf')}-draft{layers}-Q4_0.gguf")
    if not path.exists():
        flux.must("synth", "--draft-of", str(model), "--layers", str(layers), "-o", str(path), name=f"synth-{path.stem}")
    return path


def heads_twin(flux: FluxCommands, model: Path, preset: str, routing: str, extra: list[str]) -> Path:
    """The twin's next-token block alone (``flux synth --heads-of``), written once: from the same twin synthesized
    with its block (``--set n_mtp=1``, the trunk's bytes unchanged), which is deleted after (it is the size of the
    model, in /dev/shm)."""
    stem = model.name.removesuffix("-Q4_0.gguf")
    path = model.with_name(f"{stem}-heads-Q4_0.gguf")
    if path.exists():
        return path
    whole = model.with_name(f"{stem}-mtp-Q4_0.gguf")
    try:
        flux.must("synth", "--like", preset, "--quant", "Q4_0", "--routing", routing, "--set", "n_mtp=1", "-o",
                  str(whole), *extra, name=f"synth-{stem}-mtp")
        flux.must("synth", "--heads-of", str(whole), "-o", str(path), name=f"synth-{stem}-heads")
    finally:
        whole.unlink(missing_ok=True)
    return path


@dataclass(frozen=True)
class Planned:
    """A pair's ``flux plan``: its last run, that run's wall seconds and, after a refusal for its budget,
    ``plan_refused_s`` (the refused run's seconds) and ``plan_budget_s_used``."""

    proc: subprocess.CompletedProcess[str]
    plan_s: float
    refused: dict[str, Any]

    @property
    def plan_id(self) -> str | None:
        """The plan ``flux plan`` printed last, or None where it failed."""
        return self.proc.stdout.strip().splitlines()[-1] if self.proc.returncode == 0 else None


def plan_pair(flux: FluxCommands, pair: Pair, model: Path, draft: Path | None, heads: Path | None,
              budget_s: float | None, retry: bool) -> Planned:
    """``flux plan`` for the pair; refused for its budget ("use --budget-s N or more") and with ``retry``, once
    more at N, the stages before measuring reused from the refusal."""
    t0 = time.monotonic()
    proc = flux(*pair.plan_args(model, draft, budget_s, heads), name=f"plan-{pair.tag}")
    plan_s = time.monotonic() - t0
    need = refused_budget(proc.stderr) if proc.returncode == 2 and retry else None
    if need is None:
        return Planned(proc, plan_s, {})
    flux.say(f"{pair.tag}: refused at its budget after {plan_s:.0f} s; planning again at --budget-s {need}")
    (flux.out / f"plan-{pair.tag}.log").rename(flux.out / f"plan-{pair.tag}-refused.log")
    t1 = time.monotonic()
    proc = flux(*pair.model_copy(update={"plan_budget_s": need}).plan_args(model, draft, None, heads),
                name=f"plan-{pair.tag}")
    return Planned(proc, time.monotonic() - t1, {"plan_refused_s": plan_s, "plan_budget_s_used": need})


def summary_rows(store: Store, plan_id: str, run_after: float) -> list[dict[str, Any]]:
    """The ``bench_summary`` rows of the last ``flux bench run`` of this plan since ``run_after`` (epoch seconds)."""
    if "bench_summary" not in store.views():
        return []
    rows = store.query("SELECT * FROM bench_summary").to_pylist()
    mine = [r for r in rows if r["plan_id"] == plan_id and r["suite"] == "run"
            and r["created_at"].timestamp() >= run_after - 1]
    last = max((r["run_id"] for r in mine), key=lambda rid: max(r["created_at"] for r in mine if r["run_id"] == rid),
               default=None)
    return [r for r in mine if r["run_id"] == last]
