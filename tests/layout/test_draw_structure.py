"""scripts/draw_structure.py draws the package graph docs/architecture.md shows, from the imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "draw_structure.py"


def test_the_drawing_has_the_layering_the_tests_enforce() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True).stdout
    arrows = {(line.split("[")[1].split("]")[0], line.rsplit("[", 1)[1].rstrip("]"))
              for line in out.splitlines()[1:]}
    assert out.startswith("graph LR") and arrows
    assert ("flows", "artifacts") in arrows
    assert not {a for a in arrows if a[0].startswith("server") and a[1].startswith("tasks")}, "server imports tasks"
    assert not {a for a in arrows if a[1] == "flows" and not a[0].startswith("flows")}, "only flows composes"


def test_a_folder_that_is_not_a_checkout_is_one_line_and_exit_2(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--repo", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "is not a Flux checkout" in r.stderr and len(r.stderr.splitlines()) == 1
