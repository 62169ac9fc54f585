"""`flux COMMAND` builds the parsers of COMMAND's module only; `flux --help` builds them all."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

from flows import cli

REPO = Path(__file__).resolve().parents[2]


def _registered(module: str) -> set[str]:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    importlib.import_module(module).register(sub)
    return set(sub.choices)


def test_the_command_index_names_what_each_module_registers() -> None:
    found = {command: module for module in cli.COMMAND_MODULES for command in _registered(module)}
    assert found == cli.COMMANDS


def test_a_command_line_builds_its_module_only_and_help_builds_every_one() -> None:
    code = ("import sys\nfrom flows import cli\ncli.build_parser(sys.argv[1:])\n"
            "print(sorted(m for m in cli.COMMAND_MODULES if m in sys.modules))\n")

    def loaded(*argv: str) -> str:
        out = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert loaded("plan", "m.gguf") == "['flows.commands.plan']"
    assert loaded("serve", "abc") == "['flows.commands.serve']"
    assert loaded("--help") == loaded("no-such-command") == str(sorted(cli.COMMAND_MODULES))
