#!/usr/bin/env python3
"""Draw Flux's structure from its imports: one node per package (and per sub-package of tasks/), one arrow per
pair of them that import each other, labelled with the number of module imports behind it (imports inside
functions count; those under TYPE_CHECKING do not). Prints a Mermaid graph for docs/architecture.md.

    python3 scripts/draw_structure.py [--repo DIR] [--depth 2]

``--repo`` draws another checkout (e.g. an older commit exported with ``git archive``), so a structure before
and after a change can be drawn by the same rule. Nothing of the project is imported or run: the source is parsed.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

PACKAGES = ("flows", "tasks", "artifacts", "engine_bridge", "server")


def modules(repo: Path) -> dict[str, Path]:
    """Module name -> file, for every module of the five packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((repo / pkg).rglob("*.py")):
            rel = path.relative_to(repo).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def imported(mod: str, path: Path) -> set[str]:
    """Modules ``mod`` imports anywhere in its file, TYPE_CHECKING blocks left out."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                out.add(".".join([*base, *([node.module] if node.module else [])]))
            else:
                out.add(node.module or "")
    return out


def group(mod: str, depth: int, packages: set[str]) -> str:
    """The node a module belongs to: its package, or its sub-package up to ``depth`` parts where one exists."""
    parts = mod.split(".")
    for n in range(min(depth, len(parts)), 0, -1):
        name = ".".join(parts[:n])
        if name in packages:
            return name
    return parts[0]


def edges(repo: Path, depth: int) -> Counter[tuple[str, str]]:
    """(from node, to node) -> module imports between them."""
    mods = modules(repo)
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}
    out: Counter[tuple[str, str]] = Counter()
    for mod, path in mods.items():
        src = group(mod, depth, packages)
        for target in imported(mod, path):
            known = next((m for m in (target, target.rsplit(".", 1)[0]) if m in mods), None)
            if known is None:
                continue
            dst = group(known, depth, packages)
            if dst != src:
                out[(src, dst)] += 1
    return out


def mermaid(counts: Counter[tuple[str, str]]) -> str:
    """The graph as Mermaid text, nodes in a stable order."""
    lines = ["graph LR"]
    for (a, b), n in sorted(counts.items()):
        lines.append(f"  {a.replace('.', '_')}[{a}] -->|{n}| {b.replace('.', '_')}[{b}]")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--depth", type=int, default=2, help="how deep sub-packages get their own node (default 2)")
    args = ap.parse_args(argv)
    if not all((args.repo / p).is_dir() for p in PACKAGES):
        sys.stderr.write(f"draw_structure: {args.repo} is not a Flux checkout (it lacks one of {', '.join(PACKAGES)})\n")
        return 2
    sys.stdout.write(mermaid(edges(args.repo, args.depth)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
