"""The patched backend's switches: the declaration (artifacts/native_switches.py), the patches that read them,
their headers, the README's table and the code that sets them say the same thing."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from artifacts import native_switches as sw
from artifacts.engine_params import EngineParams, ExpertSplit
from engine_bridge.backend import PATCH_DIR

REPO = Path(__file__).resolve().parents[2]
README = PATCH_DIR / "README.md"
READ = re.compile(r'"(FLUX_[A-Z0-9_]+)"')  # a switch a patch reads: a string literal of its name (getenv's argument)
NAMED = re.compile(r"\bFLUX_(?:MOE|CUDA)_[A-Z0-9_]*[A-Z0-9]|\bFLUX_BUILD_ID\b")  # the patches' families of names
FIELDS = ("What:", "Why:", "Tested:", "Depends:", "Switches:")


def patches() -> list[Path]:
    found = sorted(PATCH_DIR.glob("*.patch"))
    assert found, f"no patches under {PATCH_DIR}"
    return found


def split(p: Path) -> tuple[str, str]:
    """A patch's header and its body (from its first ``diff --git`` line)."""
    text = p.read_text()
    at = 0 if text.startswith("diff --git ") else text.find("\ndiff --git ") + 1
    return text[:at], text[at:]


def reads() -> dict[str, str]:
    """Each FLUX_ variable the patches read and the first patch that adds a read of it (its added lines)."""
    first: dict[str, str] = {}
    for p in patches():
        added = "\n".join(line for line in split(p)[1].splitlines() if line.startswith("+") and not line.startswith("+++"))
        for name in READ.findall(added):
            first.setdefault(name, p.name[:4])
    return first


def test_the_readme_table_is_the_declaration() -> None:
    text = README.read_text()
    assert sw.render_into(text) == text, (
        "patches/llama.cpp/README.md's switch table differs from artifacts/native_switches.py: regenerate it "
        "with the command under \"Switches\" in that README")


def test_every_switch_a_patch_reads_is_declared_with_its_patch_and_every_declared_one_is_read() -> None:
    declared = {s.name: s.patch for s in sw.SWITCHES}
    read = reads()
    assert set(read) - set(declared) == set(), "read by a patch, missing from artifacts/native_switches.py"
    assert set(declared) - set(read) == set(), "declared in artifacts/native_switches.py, read by no patch"
    assert declared == read, "a switch declared with another patch than the one that first reads it"


@pytest.mark.parametrize("patch", patches(), ids=lambda p: p.name[:4])
def test_every_patch_has_a_header_naming_the_switches_it_adds(patch: Path) -> None:
    header, body = split(patch)
    assert body.startswith("diff --git "), f"{patch.name}: no diff"
    lines = header.strip().splitlines()
    assert 5 <= len(lines) <= 30, f"{patch.name}: a header of 5-30 lines (what, why, tested, depends, switches)"
    missing = [f for f in FIELDS if not any(line.startswith(f) for line in lines)]
    assert not missing, f"{patch.name}: the header lacks {missing}"
    # nothing in a header may look like the start of a diff to git apply
    assert not any(line.startswith(("--- ", "+++ ", "@@ ", "Index: ")) for line in lines), patch.name
    switches_text = header[header.index("\nSwitches:"):]
    named = set(re.findall(r"FLUX_[A-Z0-9_]*[A-Z0-9]", switches_text))
    assert named == {s.name for s in sw.SWITCHES if s.patch == patch.name[:4]}, patch.name


def test_project_code_names_only_declared_switches() -> None:
    files = subprocess.run(["git", "ls-files", "*.py", "*.sh"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    unknown = {f"{f}: {name}" for f in files if (REPO / f).is_file()
               for name in NAMED.findall((REPO / f).read_text(errors="replace")) if name not in sw.BY_NAME}
    assert not unknown, "names of no patch's switch (a typo, or a switch missing from the declaration)"


def test_environment_sets_only_declared_switches_in_their_kinds() -> None:
    p = EngineParams(expert_split=ExpertSplit.on("CUDA0", {0: [1, 2]}),
                     expert_host_sync=True, expert_mapped=True, expert_mapped_tokens=7, expert_cache="adaptive",
                     offload_min_batch=16, flash_attn=True, kv_vram_cells=65536)
    env = p.environment()
    assert env == {"GGML_OP_OFFLOAD_MIN_BATCH": "16", "FLUX_MOE_SPLIT": "CUDA0|0:1,2", "FLUX_MOE_HOST_SYNC": "1",
                   "FLUX_MOE_MAPPED": "1", "FLUX_MOE_MAPPED_MAX_TOKENS": "7", "FLUX_MOE_CACHE": "adaptive",
                   "FLUX_KV_VRAM_CELLS": "65536"}
    flux_set = {s.name for s in sw.SWITCHES if s.set_by == "engine-params"}
    assert set(env) - {"GGML_OP_OFFLOAD_MIN_BATCH"} == flux_set
    assert all(s.field in EngineParams.model_fields for s in sw.SWITCHES if s.field)


def test_an_unknown_name_and_a_value_of_the_wrong_kind_are_refused() -> None:
    with pytest.raises(sw.UnknownSwitch, match="native_switches.py"):
        sw.switch("FLUX_MOE_" + "MAPED")
    assert sw.switch("FLUX_MOE_MAPPED") is sw.MOE_MAPPED
    for s, bad in ((sw.MOE_CACHE, "lru"), (sw.MOE_MAPPED, 1), (sw.MOE_MAPPED_MAX_TOKENS, 0),
                   (sw.MOE_MAPPED_MAX_TOKENS, True), (sw.MOE_SPLIT, ""), (sw.CUDA_OP_PROFILE, "3")):
        with pytest.raises(ValueError, match=s.name):
            s.format(bad)
    assert sw.MOE_SKIP_IDLE.env(False) == {"FLUX_MOE_SKIP_IDLE": "0"}
    assert sw.CUDA_OP_PROFILE.format("2") == "2" and sw.MOE_CACHE_SWAPS.format(3) == "3"
