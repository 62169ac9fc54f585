"""docs/features.md stays honest: what a `yes` row names exists.

Every `flux <command>` named in a yes row is a real subcommand (and `flux bench <suite>` a real suite), every flag a
yes row names in a `flux plan ...` / `flux serve ...` code span (or in the `flux plan` flags group) is one of that
command's flags, every repository path the page names exists, the counts line matches the rows, and README.md
links the page. Cheap: the parser is built once, nothing runs.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from functools import cache
from pathlib import Path

from flows.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "features.md"
STATUSES = ("yes", "partly", "no")
ROW = re.compile(r"^\|(?P<promise>[^|\n]*)\| (?P<status>\S+) \|(?P<shown>.*)\|\s*$")
SPAN = re.compile(r"`([^`\n]+)`")
COMMAND = re.compile(r"(?:^|[\s(])flux ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
PATH = re.compile(r"(?<![\w./-])((?:docs|tests|scripts|artifacts|server|flows|tasks|engine_bridge|patches|third_party)"
                  r"/[\w./-]*\.(?:md|py|sh|txt|pin|patch|ipynb|toml))")
TOP_FILES = ("README.md", "pyproject.toml")
PLAN_FLAGS_GROUP = "## Common `flux plan` flags"


def _rows() -> list[tuple[str, str, str, str]]:
    """(group heading, promise, status, last column) of every data row."""
    group, rows = "", []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            group = line.strip()
        m = ROW.match(line)
        if m and m["status"] not in ("Flux", "---") and not set(m["promise"].strip()) <= {"-"}:
            rows.append((group, m["promise"], m["status"], m["shown"]))
    return rows


@cache
def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _suites() -> set[str]:
    bench = _subparsers()["bench"]
    action = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    return set(action.choices)


def _flags(command: str) -> set[str]:
    """The flags `flux <command> --help` prints."""
    help_text = _subparsers()[command].format_help()
    return set(FLAG.findall(help_text))


def _yes_rows() -> list[tuple[str, str, str, str]]:
    return [r for r in _rows() if r[2] == "yes"]


def test_every_row_has_a_status_and_the_counts_line_matches() -> None:
    rows = _rows()
    assert len(rows) > 80
    bad = [r[1].strip() for r in rows if r[2] not in STATUSES]
    assert not bad, f"rows whose status is not yes/partly/no: {bad}"
    counts = Counter(r[2] for r in rows)
    want = f"Counts: {counts['yes']} yes, {counts['partly']} partly, {counts['no']} no ({len(rows)} rows)."
    assert want in DOC.read_text(encoding="utf-8"), f"docs/features.md's counts line should read: {want}"


def test_every_row_says_what_shows_it_or_what_is_missing() -> None:
    empty = [r[1].strip() for r in _rows() if len(r[3].strip()) < 8]
    assert not empty, f"rows with no command, test or doc (or no line on what is missing): {empty}"


def test_commands_named_in_yes_rows_exist() -> None:
    commands, suites = set(_subparsers()), _suites()
    missing = []
    for _group, promise, _status, shown in _yes_rows():
        for span in SPAN.findall(promise + shown):
            for cmd, sub in COMMAND.findall(span):
                if cmd not in commands:
                    missing.append(f"flux {cmd} ({span})")
                elif cmd == "bench" and sub and sub not in suites:
                    missing.append(f"flux bench {sub} ({span})")
    assert not missing, f"commands named in yes rows that `flux --help` does not list: {missing}"


def test_plan_and_serve_flags_named_in_yes_rows_exist() -> None:
    flags = {cmd: _flags(cmd) for cmd in ("plan", "serve")}
    missing, checked = [], 0
    for group, promise, _status, shown in _yes_rows():
        for span in SPAN.findall(promise + shown):
            m = COMMAND.search(span)  # a span naming another command (`flux synth --draft-of`) is not checked here
            cmd = m.group(1) if m else "plan" if group == PLAN_FLAGS_GROUP else None
            if cmd not in flags:
                continue
            for flag in FLAG.findall(span):
                checked += 1
                if flag not in flags[cmd]:
                    missing.append(f"flux {cmd} {flag} ({span})")
    assert checked > 20
    assert not missing, f"flags named in yes rows that the command's --help does not print: {missing}"


def test_paths_the_page_names_exist() -> None:
    text = DOC.read_text(encoding="utf-8")
    named = set(PATH.findall(text)) | {f for f in TOP_FILES if f in text}
    links = {(DOC.parent / target).resolve() for target in re.findall(r"\]\(([^)#\s]+)", text)
             if "://" not in target}
    missing = sorted(p for p in named if not (ROOT / p).exists()) + sorted(
        str(p) for p in links if not p.exists())
    assert len(named) > 20
    assert not missing, f"paths docs/features.md names that do not exist: {missing}"


def test_readme_links_the_page() -> None:
    assert "docs/features.md" in (ROOT / "README.md").read_text(encoding="utf-8")
