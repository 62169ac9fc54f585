"""`flux plans` and `flux show` in an 80-column terminal: the real CLI on a pseudo-terminal with COLUMNS=80 (a pipe
is 200 wide), on stored plans (no planner run)."""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from artifacts.config import load_settings
from artifacts.engine_params import EngineParams
from artifacts.records.evidence import MeasureSummary
from artifacts.records.kinds import PLAN
from artifacts.records.plan import Plan, seal
from artifacts.records.search import Prediction
from artifacts.records.store import Records
from flows.show import FINALISTS_LAYOUTS, PLANS_LAYOUTS, print_plan, print_plans
from tasks.testing import stored_plan

REPO = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
LONG_NAME = "Qwen3-30B-A3B-Instruct-2507-Q4_K_M"


def in_terminal(env: dict[str, str], *args: str, columns: int = 80, timeout: float = 120) -> tuple[int, list[str]]:
    """Run `flux ARGS` with its stdout on a pseudo-terminal ``columns`` wide (as a person's shell runs it): exit
    status and the lines it printed, styles stripped."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "flows", *args], env={**env, "COLUMNS": str(columns),
                            "TERM": "xterm"}, cwd=REPO, stdout=slave, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the terminal's other side closed (EIO): the command is done
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    rc = proc.wait(timeout=timeout)
    text = ANSI.sub("", b"".join(chunks).decode("utf-8", "replace")).replace("\r", "")
    return rc, text.splitlines()


def _plans(flux_env: dict[str, str], tiny_moe: Path) -> list[Plan]:
    """Two plans alike but for their ids, a long model name, and finalists of every kind: measured over rounds,
    measured once (an error), not measured at all (an error, no figures)."""
    settings = load_settings(flux_env)
    preds = [Prediction(candidate_id=c, prefill_tps=12345.6, decode_tps=45.6, score_s=1.0)
             for c in ("c000", "c001", "c002")]
    finalists = [
        MeasureSummary(candidate_id="c000", prefill_tps=15000.2, decode_tps=50.1, workload_s=1.25, workload_iqr=0.05,
                       n_trials=4, n_rounds=2).model_dump(),
        MeasureSummary(candidate_id="c001", prefill_tps=14000.2, decode_tps=40.1, workload_s=1.5, n_trials=2,
                       n_rounds=1, error="measured once: the budget left no second round (no spread)").model_dump(),
        MeasureSummary(candidate_id="c002", prefill_tps=None, decode_tps=None, workload_s=None, n_trials=0,
                       error="not measured: the budget left did not fit it").model_dump()]
    out = []
    for n in (256, 512):
        made = stored_plan(settings, tiny_moe, EngineParams(n_ctx=n, n_batch=64, n_ubatch=64), model_name=LONG_NAME,
                           predictions=[p.model_dump() for p in preds])
        plan = seal({**made.model_dump(mode="json", exclude={"id"}), "finalists": finalists})
        Records.at(settings.data_dir).put(PLAN, plan, key=plan.id)
        out.append(plan)
    return out


def test_flux_plans_at_80_columns_keeps_ids_dates_and_names_whole(flux_env: dict[str, str], tiny_moe: Path) -> None:
    plans = _plans(flux_env, tiny_moe)
    rc, lines = in_terminal(flux_env, "plans")
    assert rc == 0, lines
    assert lines and all(len(x) <= 80 for x in lines), lines
    for plan in plans:
        row = next(x for x in lines if x.startswith(plan.id[:12]))  # the id `flux show` takes, whole
        assert LONG_NAME in row, row  # not "Qwen3-30B-A…" twice
        assert re.search(r"\b\d\d-\d\d \d\d:\d\d\b", row) and "…" not in row, row  # a date and time, not "2026-…"
        assert "500.0" in row and "50.0" in row, row
    assert any("tok/s" in x for x in lines), "the speeds' unit is said once"


def test_flux_show_at_80_columns_fits_its_finalists_and_dashes_the_unmeasured(flux_env: dict[str, str],
                                                                              tiny_moe: Path) -> None:
    plan = _plans(flux_env, tiny_moe)[0]
    rc, lines = in_terminal(flux_env, "show", plan.id[:12])
    assert rc == 0, lines
    assert all(len(x) <= 80 for x in lines), [x for x in lines if len(x) > 80]
    rows = {x.split()[0].rstrip("*"): x.split() for x in lines if re.match(r"c00\d\*?\s", x)}
    assert set(rows) == {"c000", "c001", "c002"}, lines
    assert rows["c000"][1:5] == ["1.25", "0.05", "12345.6", "15000.2"], rows["c000"]  # numbers whole
    assert rows["c002"][1] == "-" and rows["c002"].count("-") == 3, rows["c002"]  # not 0.00 / 0.0
    # each error on a line of its own, whole, not one word per line in a squeezed column
    assert "  c001: measured once: the budget left no second round (no spread)" in lines
    assert "  c002: not measured: the budget left did not fit it" in lines


def test_every_layout_is_offered_richest_first_and_a_pipe_keeps_the_full_tables(flux: Any, flux_env: dict[str, str],
                                                                               tiny_moe: Path) -> None:
    """200 columns (a pipe) keep every column, the error beside its row; each narrower layout is narrower."""
    plan = _plans(flux_env, tiny_moe)[0]
    got = flux("show", plan.id[:12])
    assert got.returncode == 0, got.stderr
    row = next(x for x in got.stdout.splitlines() if x.lstrip().startswith("c002"))
    assert "not measured: the budget left did not fit it" in row and "pred GPU GiB" in got.stdout
    from flows.fit import natural_width
    from flows.show import finalists_table, plans_table

    con = Console(file=io.StringIO(), width=400)
    widths = [natural_width(con, finalists_table(plan, lay)) for lay in FINALISTS_LAYOUTS]
    assert widths == sorted(widths, reverse=True) and widths[-1] < 80, widths
    widths = [natural_width(con, plans_table([plan], lay)) for lay in PLANS_LAYOUTS]
    assert widths == sorted(widths, reverse=True), widths


def test_narrow_layouts_print_what_they_leave_out_below_the_table(flux_env: dict[str, str], tiny_moe: Path) -> None:
    """At 60 columns the GPU memory, spread and rounds leave the table for lines under it; nothing is lost."""
    plan = _plans(flux_env, tiny_moe)[0]
    gpu = [s.model_copy(update={"gpu_bytes": int(7.85 * 2**30), "predicted_gpu_bytes": int(7.5 * 2**30)})
           if s.candidate_id == "c000" else s for s in plan.finalists]
    out = io.StringIO()
    print_plan(plan.model_copy(update={"finalists": gpu}), Console(file=out, width=60))
    text = " ".join(out.getvalue().split())  # the lines wrap at 60 columns, at spaces
    assert "GPU GiB predicted / measured: c000 7.50 / 7.85, c001 - / -, c002 - / -" in text, text
    assert "spread s / rounds: c000 0.05 / 2, c001 - / 1, c002 - / 0" in text, text
    out = io.StringIO()
    print_plans([plan], Console(file=out, width=60))
    lines = out.getvalue().splitlines()
    start, end = lines[0].index("model"), lines[0].index("prefill")
    assert lines[2].startswith(plan.id[:12])
    # a name wider than its column wraps, whole: its pieces, read down the column, give it back
    assert "".join(x[start:end].strip() for x in lines[2:-1]) == LONG_NAME, lines
