"""The planner's code identity: one hash over the sources that decide what a plan is.

The backend build id covers llama.cpp (pin, patches, built libraries); this covers Flux's own planner and
worker: the planning stages and the cost model (``tasks/`` minus the bench suites), the worker and its
protocol (``engine_bridge/``), the flow's composition (``flows/`` planning modules), the
model reader (``artifacts/`` GGUF and model-info modules) and the records the stages pass on and their keys
(``artifacts/records/``). Every stage key and every plan key include it, so an upgraded Flux whose enumerate,
cost model or worker changed computes new stage results and new plans instead of reusing stale ones,
``--replan`` or not. Files that only show or serve plans (the CLI's
printing, the server, the bench suites) are not part of it: changing them keeps every plan valid.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (directory, glob) pairs relative to the source root; ``EXCLUDE`` names directories left out.
PLANNER_SOURCES: tuple[tuple[str, str], ...] = (
    ("tasks", "**/*.py"),
    ("engine_bridge", "**/*.py"),
    ("flows", "plan_model.py"), ("flows", "stages.py"), ("flows", "plan_context.py"), ("flows", "request.py"),
    ("artifacts", "gguf_header.py"), ("artifacts", "model_info.py"), ("artifacts", "ids.py"),
    ("artifacts", "code_id.py"), ("artifacts", "records/**/*.py"), ("artifacts", "corpus.py"),
)
EXCLUDE = ("tasks/bench/",)


def planner_files(root: Path = ROOT) -> list[Path]:
    """The planner's source files under ``root``, in a stable order."""
    out: set[Path] = set()
    for folder, pattern in PLANNER_SOURCES:
        for p in (root / folder).glob(pattern):
            rel = p.relative_to(root).as_posix()
            if p.is_file() and not rel.startswith(EXCLUDE) and "__pycache__" not in rel:
                out.add(p)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def planner_code_id(root: Path = ROOT) -> str:
    """Hex blake2b-128 over every planner source's relative path and bytes (see the module docstring)."""
    h = hashlib.blake2b(digest_size=16)
    for p in planner_files(root):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.blake2b(p.read_bytes(), digest_size=16).digest())
    return h.hexdigest()


@cache
def code_id() -> str:
    """This installation's planner code id (computed once per process)."""
    return planner_code_id(ROOT)
