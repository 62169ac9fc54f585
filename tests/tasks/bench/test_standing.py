"""The GPU record's standing table (tasks/bench/standing.py, scripts/standing.py): the doc's block is what the
committed record gives, the README quotes its rows, and a row can be marked superseded without a number moving."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pyarrow.parquet as pq
import pytest

from tasks.bench.standing import (
    BEGIN,
    CO_RESIDENT,
    END,
    block_of,
    card,
    date,
    gpu_card,
    race,
    race_of_metrics,
    rewrite,
    standing,
    supersede,
    table,
    table_line,
)

REPO = Path(__file__).resolve().parents[3]
DOC = REPO / "docs" / "benchmarks" / "gpu-record.md"
RECORD = REPO / "docs" / "benchmarks" / "h200" / "record.parquet"
QUOTE_BEGIN, QUOTE_END = "<!-- standing:quote:begin -->", "<!-- standing:quote:end -->"


def _row(run: str, **kw: Any) -> dict[str, Any]:
    base = {"run": run, "model": "m", "routing": "skewed", "budget_gib": 12.0, "ctx": 32768, "workload": "chat",
            "plan_id": f"p-{run}", "plan_family": "experts-mapped@32768", "fit_valid": True, "tg_vs_fit": 2.0,
            "pp_vs_fit": 1.5, "agent_vs_fit": 1.2}
    return {**base, **kw}


def test_the_docs_standing_table_is_the_committed_records() -> None:
    block = block_of(DOC.read_text())
    assert block is not None, f"{DOC} has lost its {BEGIN} / {END} lines"
    assert block == table(pq.read_table(RECORD).to_pylist()), (
        "the standing table is not what the record gives: run python3 scripts/standing.py")


def test_the_readme_quotes_rows_of_the_standing_table() -> None:
    readme = (REPO / "README.md").read_text()
    start, end = readme.find(QUOTE_BEGIN), readme.find(QUOTE_END)
    assert 0 <= start < end, f"README.md has lost its {QUOTE_BEGIN} / {QUOTE_END} lines"
    quoted = [line for line in readme[start:end].splitlines() if line.startswith("| ")]
    block = set((block_of(DOC.read_text()) or "").splitlines())
    assert len(quoted) > 1
    stale = [line for line in quoted if line not in block]
    assert not stale, f"README.md quotes standing rows the table no longer has (copy them from {DOC.name}): {stale}"


def test_the_latest_valid_row_of_each_pair_stands() -> None:
    rows = [_row("h200-2026-12-03a", tg_vs_fit=1.1), _row("h200-2026-12-04a", tg_vs_fit=1.9),
            _row("h200-2026-12-05a", fit_valid=False, tg_vs_fit=None, tg_unreported=2.5),
            _row("h200-2026-12-05b", error="refused", plan_id=None),
            _row("h200-2026-12-04b", budget_gib=8.0), _row("h200-2026-12-02a", workload=None, tg_vs_fit=0.6)]
    got = standing(rows)
    assert [(r["run"], r["tg_vs_fit"]) for r in got] == [
        ("h200-2026-12-02a", 0.6), ("h200-2026-12-04b", 2.0), ("h200-2026-12-04a", 1.9)], (
        "agent (a row from before --workload) before chat, then by budget; a flagged --fit or a refused plan "
        "does not displace the latest valid row")
    assert standing([rows[1], rows[0]])[0]["run"] == "h200-2026-12-04a", "the later date, whatever the order"
    marked, n = supersede(rows, "h200-2026-12-04a", by="h100-2026-12-09a")
    assert n == 1 and [r["run"] for r in standing(marked)][-1] == "h200-2026-12-03a"
    assert [{k: v for k, v in r.items() if k != "superseded_by"} for r in marked] == rows, "no number moves"


def test_a_row_of_the_co_resident_race_is_marked_and_a_re_raced_one_is_not() -> None:
    old, new = _row("h200-2026-12-03a"), _row("h100-2026-12-09a", race="alone", card="NVIDIA H100 80GB HBM3",
                                                date="2026-12-09")
    assert race(old) == CO_RESIDENT and "co-resident ¹" in table_line(old)
    line = table_line(new)
    assert "¹" not in line and line.endswith("| alone |") and "| H100 80GB HBM3 | 2026-12-09 |" in line
    text = table([old, new])
    assert "¹" not in text, "the re-raced row stands for its pair, and no footnote without a marked row"
    assert "¹ 1 of 1 rows" in table([old])
    assert "host slow ²" in table_line(_row("r", host_flag="slow")) and "experts-mapped |" in line
    solo = _row("r", race="solo visits: one contender resident at a time, 3 timed turns of each kind a visit")
    assert table_line(solo).endswith("| solo visits |"), "the race's name, not all it says of itself"


@pytest.mark.parametrize(("run", "want_card", "want_date"), [
    ("h200-2026-12-03e", "NVIDIA H200", "2026-12-03"), ("h100-2026-12-07", "NVIDIA H100", "2026-12-07"),
    ("run-20261209-1430", "", "2026-12-09"), ("mine", "", "")])
def test_old_rows_take_card_and_date_from_their_runs_name(run: str, want_card: str, want_date: str) -> None:
    assert (card({"run": run}), date({"run": run})) == (want_card, want_date)
    assert card({"run": run, "card": "NVIDIA L40S"}) == "NVIDIA L40S"


def test_a_new_rows_card_and_race() -> None:
    assert gpu_card(["NVIDIA H200"]) == "NVIDIA H200" and gpu_card([]) is None
    assert gpu_card(["NVIDIA H100 80GB HBM3"] * 2) == "2x NVIDIA H100 80GB HBM3"
    assert race_of_metrics([{"baseline_valid": True}, {}]) == CO_RESIDENT, "the old race unless it says otherwise"
    assert race_of_metrics([{"race": "solo visits: one at a time"}, {"race": "solo visits: one at a time"}]) == (
        "solo visits: one at a time"), "kept whole in the record"


def test_the_block_is_rewritten_between_its_markers_only() -> None:
    doc = f"# t\n\nabove\n{BEGIN}\nold\n{END}\nbelow\n"
    new = rewrite(doc, "fresh\ntable")
    assert new == f"# t\n\nabove\n{BEGIN}\nfresh\ntable\n{END}\nbelow\n"
    assert block_of(new or "") == "fresh\ntable" and rewrite(new or "", "fresh\ntable") == new
    assert rewrite("no markers", "x") is None and block_of(f"{END}\n{BEGIN}") is None


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("standing_script", REPO / "scripts" / "standing.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["standing_script"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_script_marks_a_run_superseded_and_rewrites_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    record, doc = tmp_path / "record.parquet", tmp_path / "doc.md"
    shutil.copy(RECORD, record)
    doc.write_text(f"# x\n{BEGIN}\n{END}\n")
    script = _script()
    args = ["standing.py", "--doc", str(doc), "--record", str(record)]
    monkeypatch.setattr(sys, "argv", [*args, "--check"])
    assert script.main() == 1, "a stale block fails the check"
    monkeypatch.setattr(sys, "argv", [*args, "--supersede", "h200-2026-12-05c", "--by", "h100-2026-12-09a"])
    assert script.main() == 0
    before, after = pq.read_table(RECORD), pq.read_table(record)
    assert after.select(before.schema.names).equals(before.set_column(
        before.schema.names.index("superseded_by"), "superseded_by", after.column("superseded_by"))), (
        "only superseded_by changes")
    assert [r["run"] for r in after.to_pylist() if r["superseded_by"]] == ["h200-2026-12-05c"]
    block = block_of(doc.read_text()) or ""
    assert "1 superseded by a later race" in block and "`h200-2026-12-05c`" not in block
    assert "| qwen3-30b-a3b skewed, 12 GiB, 32,768 tokens, agent +spec | `h200-2026-12-05a` |" in block, (
        "the pair's earlier valid row stands until the re-race's row is in the record")
    monkeypatch.setattr(sys, "argv", [*args, "--check"])
    assert script.main() == 0
