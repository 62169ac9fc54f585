"""The pinned backend: patch mechanism on a copy of the vendored tree, cache hit, build id."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from engine_bridge.backend import PATCH_DIR, backend_info, read_pin

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flux"
ARCH_FILE = "src/llama-arch.cpp"


@pytest.fixture(scope="module")
def vendored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of part of the pinned sdist's vendored llama.cpp (src/, include/ and the ggml files Flux patches)."""
    pin = read_pin()
    sdist = CACHE / "sdist" / f"llama_cpp_python-{pin['LLAMA_CPP_PYTHON_VERSION']}.tar.gz"
    if not sdist.exists():
        pytest.skip("the pinned sdist is not in the cache: run scripts/build-backend.sh")
    out = tmp_path_factory.mktemp("vendor")
    prefix = f"llama_cpp_python-{pin['LLAMA_CPP_PYTHON_VERSION']}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        keep = tuple(prefix + d for d in ("src/", "include/", "ggml/include/", "ggml/src/ggml-backend.cpp",
                                          "ggml/src/ggml-cpu/", "ggml/src/ggml-rpc/", "ggml/src/ggml-cuda/"))
        members = [m for m in tar.getmembers() if m.name.startswith(keep)]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(out, members=members, filter="data")
    return out / ""


def make_patch(tree: Path, rel: str, old: str, new: str, dest: Path) -> Path:
    """A git-style patch replacing one line of ``rel`` (made with git diff --no-index)."""
    a, b = dest.parent / "a", dest.parent / "b"
    for d in (a, b):
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
    text = (tree / rel).read_text()
    (a / rel).write_text(text)
    (b / rel).write_text(text.replace(old, new, 1))
    diff = subprocess.run(["git", "diff", "--no-index", "--no-prefix", "--", f"a/{rel}", f"b/{rel}"], cwd=dest.parent,
                          capture_output=True, text=True).stdout
    dest.write_text(diff)
    return dest


def apply(tree: Path, *patches: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(REPO / "scripts" / "apply-patches.sh"), str(tree), *map(str, patches)],
                          capture_output=True, text=True)


def test_patch_set_applies_in_order(vendored: Path, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    subprocess.run(["cp", "-r", str(vendored), str(tree)], check=True)
    p1 = make_patch(tree, ARCH_FILE, '"llama"', '"llama" /* flux-test-1 */', tmp_path / "0001-one.patch")
    r = apply(tree, p1)
    assert r.returncode == 0, r.stderr
    assert "flux-test-1" in (tree / ARCH_FILE).read_text()
    assert "applied 0001-one.patch" in r.stderr


def test_a_patch_that_does_not_apply_is_named(vendored: Path, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    subprocess.run(["cp", "-r", str(vendored), str(tree)], check=True)
    good = make_patch(tree, ARCH_FILE, '"llama"', '"llama" /* ok */', tmp_path / "0001-good.patch")
    bad = tmp_path / "0002-stale.patch"
    bad.write_text(good.read_text().replace('"llama"', '"no-such-line-in-llama-arch"'))
    r = apply(tree, good, bad)
    assert r.returncode != 0
    assert "0002-stale.patch does not apply" in r.stderr


def test_the_projects_own_patches_apply(vendored: Path, tmp_path: Path) -> None:
    patches = sorted(PATCH_DIR.glob("*.patch"))
    lines = [line for p in patches for line in p.read_text().splitlines()]
    created = {b[len("+++ b/"):] for a, b in zip(lines, lines[1:], strict=False)
               if a == "--- /dev/null" and b.startswith("+++ b/")}
    # files a patch creates come from "--- /dev/null"; a later patch may change them
    touched = [line[len("--- a/"):] for line in lines if line.startswith("--- a/") and line[6:] not in created]
    if any(not (vendored / t).exists() for t in touched):
        pytest.skip("a project patch touches files the fixture does not copy")
    tree = tmp_path / "tree"
    subprocess.run(["cp", "-r", str(vendored), str(tree)], check=True)
    r = apply(tree, *patches)
    assert r.returncode == 0, r.stderr


def test_second_build_is_a_cache_hit() -> None:
    if not (CACHE / "backend" / "current" / "build.json").exists():
        pytest.skip("backend not built in this cache")
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(REPO / "scripts" / "build-backend.sh")], capture_output=True, text=True,
                       timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert "cache hit" in r.stderr
    assert took < 30, f"cache hit took {took:.1f} s"


def test_build_id_is_stable_and_names_the_libraries(tmp_path: Path) -> None:
    a = backend_info(tmp_path)
    b = backend_info(tmp_path)
    assert a.build_id == b.build_id and len(a.build_id) == 16
    assert "libllama.so" in a.libraries
    assert a.pin["LLAMA_CPP_PYTHON_SHA256"] == "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"


def test_a_packed_build_unpacks_whole_in_small_pieces(tmp_path: Path) -> None:
    # The real build in the cache, packed (tar | xz | split) and unpacked into another cache: every file
    # comes back byte for byte, no piece is over the size asked for, and pieces of two builds are refused.
    current = (CACHE / "backend" / "current").resolve()
    if not (current / "build.json").exists():
        pytest.skip("no built backend: run scripts/build-backend.sh")
    env = {**os.environ, "PIECE_MB": "4"}
    pieces = tmp_path / "pieces"
    subprocess.run([str(REPO / "scripts" / "backend-pack.sh"), "pack", str(pieces)], env=env, check=True,
                   capture_output=True, text=True)
    parts = sorted(pieces.iterdir())
    assert parts and all(p.name.startswith(f"backend-{current.name}.tar.xz.") for p in parts)
    assert all(p.stat().st_size <= 4 * 2**20 for p in parts)
    other = tmp_path / "other"
    out = subprocess.run([str(REPO / "scripts" / "backend-pack.sh"), "unpack", str(pieces)],
                         env={**env, "XDG_CACHE_HOME": str(other)}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    got = other / "flux" / "backend" / current.name
    want = {p.relative_to(current): p for p in current.rglob("*") if p.is_file() and "src" not in p.relative_to(current).parts}
    assert {p.relative_to(got) for p in got.rglob("*") if p.is_file()} == set(want)
    assert all((got / rel).read_bytes() == p.read_bytes() for rel, p in want.items())
    (pieces / "backend-0123456789abcdef.tar.xz.00").write_bytes(b"x")
    mixed = subprocess.run([str(REPO / "scripts" / "backend-pack.sh"), "unpack", str(pieces)],
                           env={**env, "XDG_CACHE_HOME": str(other)}, capture_output=True, text=True)
    assert mixed.returncode == 2 and "several builds" in mixed.stderr


def test_the_stock_llama_bench_packs_and_unpacks_beside_the_patched_build(tmp_path: Path) -> None:
    # scripts/patch_ab.sh's stock build (FLUX_STOCK=1, backend/stock) travels the same way, in pieces of its own
    # kind, so that a lent machine's patch A/B need not build it again; the same folder may hold both kinds.
    stock = (CACHE / "backend" / "stock").resolve()
    if not (stock / "bin" / "llama-bench").exists():
        pytest.skip("no stock llama-bench: FLUX_STOCK=1 scripts/build-backend.sh")
    pieces = tmp_path / "pieces"
    subprocess.run([str(REPO / "scripts" / "backend-pack.sh"), "pack-stock", str(pieces)], check=True,
                   capture_output=True, text=True)
    assert {p.name.rsplit(".", 3)[0] for p in pieces.iterdir()} == {f"stock-{stock.name}"}
    other = tmp_path / "other"
    out = subprocess.run([str(REPO / "scripts" / "backend-pack.sh"), "unpack", str(pieces)],
                         env={**os.environ, "XDG_CACHE_HOME": str(other)}, capture_output=True, text=True)
    assert out.returncode == 0 and f"stock {stock.name} unpacked" in out.stderr, out.stderr
    got = other / "flux" / "backend" / stock.name / "bin" / "llama-bench"
    assert got.read_bytes() == (stock / "bin" / "llama-bench").read_bytes()
    empty = subprocess.run([str(REPO / "scripts" / "backend-pack.sh"), "unpack", str(tmp_path / "none")],
                           capture_output=True, text=True)
    assert empty.returncode == 2 and "no backend-" in empty.stderr


def test_patch_ab_refuses_a_model_that_is_not_a_file(tmp_path: Path) -> None:
    out = subprocess.run([str(REPO / "scripts" / "patch_ab.sh"), str(tmp_path / "ab"), str(tmp_path / "none.gguf")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "is not a file: give a .gguf" in out.stderr, out.stderr


def test_patch_over_stock_refuses_without_a_kept_stock_tree(tmp_path: Path) -> None:
    out = subprocess.run([str(REPO / "scripts" / "patch-over-stock.sh")], env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)},
                         capture_output=True, text=True)
    assert out.returncode == 2 and "FLUX_STOCK_KEEP=1" in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_the_patched_llama_bench_built_over_the_stock_tree_races_it(tmp_path: Path, tiny_moe: Path) -> None:
    # scripts/patch-over-stock.sh: the patches applied to the kept stock tree, only what they change compiled again
    # (ggml.h keeps its time stamp: it gains tensor flags alone), and patch_ab.sh races that llama-bench
    # (FLUX_PATCHED_BENCH) against the stock one, the executables named in patch_ab.json.
    stock = (CACHE / "backend" / "stock").resolve()
    if not (stock / "stock-build").is_dir():
        pytest.skip("no kept stock tree: FLUX_STOCK=1 FLUX_STOCK_KEEP=1 scripts/build-backend.sh (~10 minutes)")
    built = subprocess.run([str(REPO / "scripts" / "patch-over-stock.sh")], capture_output=True, text=True, timeout=3600)
    assert built.returncode == 0, built.stderr
    patched = Path(built.stdout.strip())
    assert patched == stock / "over-stock" / "bin" / "llama-bench" and patched.is_file()
    # the patches are in the patched build (their switches' names) and not in the stock one, library or executable
    def carries_patches(bin_dir: Path) -> bool:
        files = [f for f in bin_dir.parent.glob("lib/libllama.so*") if not f.is_symlink()] or [bin_dir / "llama-bench"]
        return any(b"FLUX_MOE_SPLIT" in f.read_bytes() for f in files)
    assert carries_patches(patched.parent) and not carries_patches(stock / "bin")
    # only the patched files were compiled again: of ggml, the four the patches touch (and CUDA's two), not the
    # rest that includes ggml.h (kept time stamp)
    compiled = re.findall(r"Building (?:C|CXX|CUDA) object (\S+)", (stock / "over-stock.log").read_text())
    ggml = {Path(o).name for o in compiled if o.startswith("ggml/")}
    assert {"ggml-backend.cpp.o", "ggml-cpu.c.o"} <= ggml <= {"ggml-backend.cpp.o", "ggml-cpu.c.o", "repack.cpp.o",
                                                           "ggml-rpc.cpp.o", "ggml-cuda.cu.o", "mmvq.cu.o"}, ggml
    out = subprocess.run([str(REPO / "scripts" / "patch_ab.sh"), str(tmp_path / "ab"), str(tiny_moe),
                          "-p", "16", "-n", "4", "-t", "2"], env={**os.environ, "REPS": "1", "FLUX_PATCHED_BENCH": str(patched)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads((tmp_path / "ab" / "patch_ab.json").read_text())
    assert got["executables"] == {"patched": str(patched), "stock": str(CACHE / "backend" / "stock" / "bin" / "llama-bench")}
    assert {r["test"] for r in got["runs"]["patched"]} == {"prefill", "decode"}


def test_patch_ab_races_the_builds_and_reads_the_host_before_each_pair(tmp_path: Path, tiny_moe: Path) -> None:
    # A check of the script (this machine's timings are noise): one repetition of each build on tiny-moe, the
    # host read before it, all of it in patch_ab.json.
    patched, stock = CACHE / "backend" / "current" / "bin", CACHE / "backend" / "stock" / "bin"
    if not (patched / "llama-bench").exists() or not (stock / "llama-bench").exists():
        pytest.skip("no stock llama-bench beside the patched one: FLUX_STOCK=1 scripts/build-backend.sh")
    if any(patched.glob("libllama*.so*")) != any(stock.glob("libllama*.so*")):
        pytest.skip("the cached stock llama-bench is linked unlike the patched one (a build of ~10 minutes)")
    out = subprocess.run([str(REPO / "scripts" / "patch_ab.sh"), str(tmp_path / "ab"), str(tiny_moe),
                          "-p", "16", "-n", "4", "-t", "2"], env={**os.environ, "REPS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "patch_ab: prefill patched" in out.stdout and "patch_ab: host RAM read" in out.stdout, out.stdout
    got = json.loads((tmp_path / "ab" / "patch_ab.json").read_text())
    assert got["reps"] == got["reps_planned"] == 1 and got["linkage"] in ("static", "shared")
    for build in ("patched", "stock"):
        assert {r["test"] for r in got["runs"][build]} == {"prefill", "decode"}
    assert got["host"][0]["rep"] == 1 and got["host"][0]["ram_read_gbs"] > 0
    assert set(got["paired"]) == {"prefill", "decode"}
