"""The layering the architecture promises, checked on the source (imports parsed, nothing run).

- flows/ composes; no module of tasks/, artifacts/, engine_bridge/ or server/ imports flows;
- flows/ decides nothing about planning: from tasks/ it imports only the stage declarations (``tasks.stage``,
  ``tasks.pipeline``, the role packages ``tasks.probing``, ``tasks.search``, ``tasks.measurement``,
  ``tasks.validation``, ``tasks.recording``), the clock, the typed errors and the bench suites' registry;
- every planning stage is declared once (one ``Stage(...)`` per module, in a role package, names unique), listed
  in ``tasks.pipeline.STAGES``, and run by the flow (flows/plan_model.py) once each, in that order;
- the server reads plans, it never plans: server/ imports nothing from tasks/ (the records both share are
  artifacts.records'); artifacts/ and engine_bridge/, which both import, import neither tasks/ nor server/;
- artifacts/ (the records included) is data, below the bridge: it imports nothing from engine_bridge/ (the engine's
  parameters, switches, drafting and spec that records hold are declared in artifacts/, the bridge imports them);
- the benchmarks sit beside the planner, never in it: only flows/ (``flux bench``, its reports) and the suites
  themselves import ``tasks.bench``, so no planning stage's code (and key) holds a bench suite;
- only the worker-side package engine_bridge.worker imports llama_cpp (the worker process links llama.cpp),
  only artifacts imports duckdb;
- the worker-side package ``engine_bridge.worker`` is spawned, never imported, by any other package;
- no import cycles between modules, counting imports inside functions too (a deferred import that closes a
  loop is still a loop in the design); only those under ``TYPE_CHECKING`` are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("flows", "tasks", "artifacts", "engine_bridge", "server")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def _resolve(mod: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports(mod: str, path: Path, top_level_only: bool) -> set[str]:
    """Modules ``mod`` imports (at module level only, when asked)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, node, path.name == "__init__.py")
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)
            elif not top_level_only:
                visit(list(ast.iter_child_nodes(node)))  # type: ignore[arg-type]
            elif isinstance(node, ast.If | ast.Try | ast.With):
                visit(node.body)  # conditional module-level imports still run at import time

    if top_level_only:
        visit(tree.body)
    else:
        for node in ast.walk(tree):
            visit([node]) if isinstance(node, ast.Import | ast.ImportFrom) else None
    return out


MODS = modules()


@pytest.mark.parametrize("mod", sorted(m for m in MODS if not m.startswith("flows")))
def test_only_flows_composes(mod: str) -> None:
    bad = sorted(i for i in imports(mod, MODS[mod], False) if i == "flows" or i.startswith("flows."))
    assert not bad, f"{mod} imports {bad}: flows composes the packages, never the other way"


@pytest.mark.parametrize(("pkg", "banned"), [("server", ("tasks",)), ("artifacts", ("tasks", "server")),
                                             ("engine_bridge", ("tasks", "server"))])
def test_the_server_and_the_shared_packages_import_no_planning_stage(pkg: str, banned: tuple[str, ...]) -> None:
    bad = {m: sorted(i for i in imports(m, MODS[m], False) if i.split(".")[0] in banned)
           for m in MODS if m.split(".")[0] == pkg}
    bad = {m: found for m, found in bad.items() if found}
    assert not bad, f"{pkg} imports {banned}: {bad}; what they share belongs in artifacts.records"


def bridge_imports(mods: dict[str, Path]) -> dict[str, list[str]]:
    """Module of artifacts/ -> the engine_bridge modules (or names in them) it imports, for each that imports any."""
    bad = {m: sorted(i for i in imports(m, p, False) if i.split(".")[0] == "engine_bridge")
           for m, p in mods.items() if m.split(".")[0] == "artifacts"}
    return {m: found for m, found in bad.items() if found}


def test_artifacts_import_nothing_from_the_bridge() -> None:
    bad = bridge_imports(MODS)
    assert not bad, (f"artifacts/ imports engine_bridge/: {bad}; a record holds data declared in artifacts/ "
                     "(artifacts.engine_params, artifacts.engine_spec, ...), the bridge imports it, not the other way")


def test_the_bridge_rule_refuses_a_record_importing_the_bridge(tmp_path: Path) -> None:
    record, bridge = tmp_path / "record.py", tmp_path / "bridge.py"
    record.write_text("def f():\n    from engine_bridge.params import EngineParams\n")
    bridge.write_text("from artifacts.records.plan import Plan\n")
    got = bridge_imports({"artifacts.records.plan": record, "engine_bridge.client": bridge})
    assert got == {"artifacts.records.plan": ["engine_bridge.params", "engine_bridge.params.EngineParams"]}


# Who may import the bench suites (tasks/bench/): the CLI and its reports, and the suites themselves.
BENCH_IMPORTERS = ("flows", "tasks.bench")


def bench_imports_outside(mods: dict[str, Path]) -> dict[str, list[str]]:
    """Module -> the bench modules it imports, for each module that is not one of :data:`BENCH_IMPORTERS`."""
    bad = {m: sorted(i for i in imports(m, p, False) if i == "tasks.bench" or i.startswith("tasks.bench."))
           for m, p in mods.items() if not any(m == a or m.startswith(f"{a}.") for a in BENCH_IMPORTERS)}
    return {m: found for m, found in bad.items() if found}


def test_only_the_cli_imports_the_bench_suites() -> None:
    bad = bench_imports_outside(MODS)
    assert not bad, (f"the bench suites are imported outside flows/ and tasks/bench/: {bad}; a planning stage "
                     "measures through tasks/measurement/, the benchmarks only read what it planned")


def test_the_bench_rule_refuses_a_stage_importing_a_suite(tmp_path: Path) -> None:
    stage, cli = tmp_path / "stage.py", tmp_path / "cli.py"
    stage.write_text("def run():\n    from tasks.bench.gpu_rows import record_row\n")
    cli.write_text("from tasks.bench.registry import suites\n")
    got = bench_imports_outside({"tasks.search.stage": stage, "flows.commands.x": cli, "tasks.bench.x": cli})
    assert got == {"tasks.search.stage": ["tasks.bench.gpu_rows", "tasks.bench.gpu_rows.record_row"]}


@pytest.mark.parametrize(("lib", "owner"), [("llama_cpp", "engine_bridge.worker"), ("duckdb", "artifacts")])
def test_native_and_database_libraries_have_one_owner(lib: str, owner: str) -> None:
    users = sorted(m for m, p in MODS.items() if any(i == lib or i.startswith(lib + ".")
                                                   for i in imports(m, p, False)))
    assert all(m == owner or m.startswith(owner + ".") for m in users), f"{lib} imported outside {owner}: {users}"


def test_the_worker_package_is_spawned_not_imported() -> None:
    users = sorted(m for m, p in MODS.items() if not m.startswith("engine_bridge.worker")
                   and any(i == "engine_bridge.worker" or i.startswith("engine_bridge.worker.")
                           for i in imports(m, p, False)))
    assert not users, f"client-side modules import the worker side: {users}"


def test_no_import_cycles() -> None:
    graph = {m: {i for i in imports(m, p, False) if i in MODS and i != m} for m, p in MODS.items()}
    seen: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> list[str] | None:
        seen[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if seen.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in seen and (cycle := dfs(n)):
                return cycle
        seen[m] = 2
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in seen and (cycle := dfs(m)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


ROLES = ("probing", "search", "measurement", "validation", "recording")
# What flows/ may import from tasks/: declarations, the clock, typed errors, the bench suites (their own registry).
FLOWS_MAY_IMPORT = ("tasks", "tasks.stage", "tasks.pipeline", "tasks.clock", "tasks.errors")
# the stage declarations (each role's modules holding a STAGE) and the drafting choices the CLI names; not the
# stages' work beside them in the same folders (tasks/<role>/machine.py, space.py, rounds.py, ...)
DECLARATIONS = ("tasks.probing.probe", "tasks.probing.route", "tasks.search.enumerate", "tasks.search.prune",
                "tasks.measurement.measure", "tasks.measurement.speculation", "tasks.measurement.draft",
                "tasks.validation.reference", "tasks.validation.validate", "tasks.recording.persist")
FLOWS_MAY_IMPORT_UNDER = ("tasks.bench", *DECLARATIONS)
# Re-exports kept for importers outside the planner; each goes when its importer moves (none left).
SHIMS: dict[str, set[str]] = {}


def flows_may_import(name: str) -> bool:
    """Whether a flows module may import ``name`` (a module of tasks/ or a name in one)."""
    return name in FLOWS_MAY_IMPORT or any(name.startswith(f"{a}.") for a in FLOWS_MAY_IMPORT if a != "tasks") or any(
        name == u or name.startswith(f"{u}.") for u in FLOWS_MAY_IMPORT_UNDER)


def test_the_flows_rule_refuses_the_work_of_a_stage() -> None:
    assert flows_may_import("tasks.pipeline.PROBE") and flows_may_import("tasks.probing.route.traces_routing")
    assert not flows_may_import("tasks.workload") and not flows_may_import("tasks.costmodel.roofline_decode")
    assert not flows_may_import("tasks.search.space") and not flows_may_import("tasks.measurement.rounds.measure")


def test_each_stage_is_one_folder() -> None:
    """A stage's declaration and its work live in its role's folder: no module beside the roles is named after a
    stage (the declaration in tasks/<role>/<stage>.py, its work in another module of the same folder)."""
    from tasks.pipeline import STAGES

    names = {s.name for s in STAGES}
    stray = sorted(m for m in MODS if m.count(".") == 1 and m.startswith("tasks.") and m.split(".")[1] in names)
    assert not stray, f"a stage's work outside its folder: {stray}"
    for s in STAGES:
        role = s.run.__module__.split(".")[1]
        assert role in ROLES and s.run.__module__ == f"tasks.{role}.{s.name}", s.run.__module__


@pytest.mark.parametrize("mod", sorted(m for m in MODS if m.startswith("flows")))
def test_flows_imports_only_stage_declarations_from_tasks(mod: str) -> None:
    found = {i for i in imports(mod, MODS[mod], False) if i.split(".")[0] == "tasks"}
    bad = sorted(i for i in found - SHIMS.get(mod, set()) if not flows_may_import(i))
    assert not bad, (f"{mod} imports {bad}: planning decisions live in a stage (tasks/<role>/<stage>.py); "
                     "flows/ only composes the declarations")


def _declarations() -> dict[str, list[str]]:
    """Module -> the ``name=`` of each ``Stage(...)`` it calls."""
    out: dict[str, list[str]] = {}
    for m, path in MODS.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Stage":
                name = next((k.value for k in node.keywords if k.arg == "name"), None)
                out.setdefault(m, []).append(ast.literal_eval(name) if name is not None else "?")
    return out


def test_every_stage_is_declared_once_in_its_role_package() -> None:
    from tasks.pipeline import STAGES

    decl = _declarations()
    assert all(len(v) == 1 for v in decl.values()), f"one stage per module: {decl}"
    assert all(m.split(".")[:2] in (["tasks", r] for r in ROLES) for m in decl), f"outside a role package: {decl}"
    names = [v[0] for v in decl.values()]
    assert len(names) == len(set(names)), f"a stage name declared twice: {sorted(names)}"
    listed = [s.name for s in STAGES]
    assert len(listed) == len(set(listed)) and set(listed) == set(names), (listed, names)


def test_the_flow_runs_every_declared_stage_once_in_order() -> None:
    from tasks import pipeline

    tree = ast.parse(MODS["flows.plan_model"].read_text())
    ran = [getattr(pipeline, c.args[0].attr) for c in ast.walk(tree) if isinstance(c, ast.Call)
           and isinstance(c.func, ast.Attribute) and c.func.attr in ("run", "start") and isinstance(c.func.value, ast.Name)
           and c.func.value.id == "stages" and c.args and isinstance(c.args[0], ast.Attribute)]
    assert ran == list(pipeline.STAGES), [s.name for s in ran]


def test_the_architecture_page_shows_every_stage() -> None:
    from tasks.pipeline import STAGES

    page = (REPO / "docs" / "architecture.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in page.splitlines() if line.startswith("| ")}
    for s in STAGES:
        row = rows.get(s.name, "")
        assert f"| {s.version} |" in row and f"| {s.result.__name__} |" in row, (
            f"docs/architecture.md's stage table has no row for {s.name} v{s.version} -> {s.result.__name__}")
        assert all(t in row for t in s.tables), f"{s.name}'s row misses its tables {s.tables}"


def test_the_flow_module_defines_only_the_flow() -> None:
    tree = ast.parse(MODS["flows.plan_model"].read_text())
    defs = [n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
    assert defs == ["plan_model"], f"flows/plan_model.py composes the stages and defines nothing else: {defs}"
