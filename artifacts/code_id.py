"""The code a stored result depends on: each planning stage's sources, exactly.

The backend build id covers llama.cpp (pin, patches, built libraries); this covers Flux's own code. A stage's
result depends on the module that declares it and everything that module imports, transitively, inside Flux's
packages (lazy imports in functions included), plus the worker modules whose ops it runs in a worker process
(which it does not import: it names them, :attr:`tasks.stage.Stage.sources`). :func:`sources_id` hashes those
files (and the data files a module reads, :data:`DATA`); every stage key carries its stage's hash, and the plan key
carries the hash of all of them (:func:`tasks.pipeline.pipeline_code`). So an edit of enumerate's or the cost
model's code makes new search spaces, finalists and plans but keeps the stored probe, and an edit of what only
serves or shows plans (the server, the serving engine's grammar, the async client) keeps every stored result.

The worker's op table (``engine_bridge/worker/handlers.py``) imports each op's module inside the op's function:
only its top-level imports are followed (:data:`DISPATCH`), so a stage depends on the ops it names, not on all.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "tasks", "engine_bridge", "artifacts", "server")
# Modules that import their dependants' modules lazily to dispatch to them: only their top-level imports count.
DISPATCH = frozenset({"engine_bridge/worker/handlers.py"})
# Data files a module reads (relative folder, glob): part of the module's sources.
DATA: dict[str, tuple[str, str]] = {"artifacts/corpus.py": ("artifacts/corpus_data", "*.jsonl")}
_FROM = re.compile(r"^(?P<indent>[ \t]*)from[ \t]+(?P<mod>[\w.]+)[ \t]+import[ \t]+(?P<names>\([^)]*\)|[^\n]*)", re.M)
_IMPORT = re.compile(r"^(?P<indent>[ \t]*)import[ \t]+(?P<mods>[^\n]+)", re.M)


def module_file(name: str, root: Path = ROOT) -> Path | None:
    """The file of module ``name`` under ``root`` (a package's ``__init__.py``), None outside Flux's packages."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = root.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def imported_modules(path: Path, root: Path = ROOT) -> frozenset[str]:
    """The Flux modules ``path`` imports (``from pkg import mod`` names ``pkg.mod`` when that is a module)."""
    st = path.stat()
    return _imports(path, root, st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=2048)
def _imports(path: Path, root: Path, _mtime_ns: int, _size: int) -> frozenset[str]:
    """:func:`imported_modules` of one version of ``path`` (its mtime and size key the cache)."""
    text = path.read_text(errors="replace")
    top_only = path.relative_to(root).as_posix() in DISPATCH
    out: set[str] = set()
    for m in _FROM.finditer(text):
        if top_only and m.group("indent"):
            continue
        mod = m.group("mod")
        if mod.split(".")[0] not in PACKAGES:
            continue
        out.add(mod)
        for raw in m.group("names").strip("()").replace("\n", " ").split(","):
            name = raw.split("#")[0].strip().split(" as ")[0].strip()
            if name and module_file(f"{mod}.{name}", root) is not None:
                out.add(f"{mod}.{name}")
    for m in _IMPORT.finditer(text):
        if top_only and m.group("indent"):
            continue
        for raw in m.group("mods").split("#")[0].split(","):
            mod = raw.strip().split(" as ")[0].strip()
            if mod.split(".")[0] in PACKAGES:
                out.add(mod)
    # a module's packages run their __init__ first
    return frozenset(out | {".".join(m.split(".")[:i]) for m in out for i in range(1, m.count(".") + 1)})


def source_files(modules: Iterable[str], root: Path = ROOT) -> list[Path]:
    """Every file the ``modules`` depend on inside Flux's packages, their data files included, in a stable order."""
    seen: set[Path] = set()
    todo = list(modules)
    while todo:
        path = module_file(todo.pop(), root)
        if path is None or path in seen:
            continue
        seen.add(path)
        todo.extend(imported_modules(path, root))
    data: set[Path] = set()
    for p in seen:
        if (spec := DATA.get(p.relative_to(root).as_posix())) is not None:
            data.update(f for f in (root / spec[0]).glob(spec[1]) if f.is_file())
    return sorted(seen | data, key=lambda p: p.relative_to(root).as_posix())


def sources_id(modules: tuple[str, ...], root: Path = ROOT) -> str:
    """Hex blake2b-128 over each source file's relative path and bytes (:func:`source_files`); each file is read
    and hashed once per process while its mtime and size stay."""
    h = hashlib.blake2b(digest_size=16)
    for p in source_files(modules, root):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        st = p.stat()
        h.update(_file_hash(p, st.st_mtime_ns, st.st_size))
    return h.hexdigest()


@lru_cache(maxsize=2048)
def _file_hash(path: Path, _mtime_ns: int, _size: int) -> bytes:
    return hashlib.blake2b(path.read_bytes(), digest_size=16).digest()
