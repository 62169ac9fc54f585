"""A patch's header is not part of what is built: the build key and the build id read each patch from its first
``diff --git`` line, so a header edit keeps the installed backend and every plan made on it; a diff edit does not."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from engine_bridge.backend import PATCH_DIR, patch_body, patch_hashes

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A copy of what build-backend.sh's key reads: the script, the pin and the patches."""
    out = tmp_path / "root"
    (out / "scripts").mkdir(parents=True)
    (out / "third_party").mkdir()
    shutil.copy(REPO / "scripts" / "build-backend.sh", out / "scripts")
    shutil.copy(REPO / "third_party" / "backend.pin", out / "third_party")
    shutil.copytree(PATCH_DIR, out / "patches" / "llama.cpp")
    return out


def build_key(root: Path, tmp_path: Path) -> str:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    r = subprocess.run(["bash", str(root / "scripts" / "build-backend.sh"), "--key"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def first_patch(root: Path) -> Path:
    return sorted((root / "patches" / "llama.cpp").glob("*.patch"))[0]


def test_a_header_edit_keeps_the_build_key_and_the_build_id(root: Path, tmp_path: Path) -> None:
    before, hashes = build_key(root, tmp_path), patch_hashes(root / "patches" / "llama.cpp")
    p = first_patch(root)
    head, body = p.read_text().split("diff --git ", 1)
    p.write_text(head + "An edited header line.\n\n" + "diff --git " + body)
    assert build_key(root, tmp_path) == before
    assert patch_hashes(root / "patches" / "llama.cpp") == hashes


def test_a_diff_edit_changes_the_build_key_and_the_build_id(root: Path, tmp_path: Path) -> None:
    before, hashes = build_key(root, tmp_path), patch_hashes(root / "patches" / "llama.cpp")
    p = first_patch(root)
    p.write_text(p.read_text() + " \n")  # one more context line: what git apply reads has changed
    assert build_key(root, tmp_path) != before
    changed = patch_hashes(root / "patches" / "llama.cpp")
    assert changed[p.name] != hashes[p.name] and len(changed) == len(hashes)


def test_a_patch_body_starts_at_its_first_diff_line(tmp_path: Path) -> None:
    p = tmp_path / "0001-x.patch"
    p.write_text("What: x.\nWhy: y (a line 'diff --git' inside the text is not a start).\n\ndiff --git a/f b/f\n+x\n")
    assert patch_body(p) == b"diff --git a/f b/f\n+x\n"
    p.write_text("diff --git a/f b/f\n+x\n")
    assert patch_body(p) == p.read_bytes()
    p.write_text("only a header\n")
    assert patch_body(p) == b""
