"""``flux bench <suite> ...``: a subcommand per declared suite, its flags built from the suite's options model.

The suites live in :mod:`tasks.bench` (each module declares ``SUITE``, :class:`tasks.bench.registry.Suite`);
``show`` and ``matrix`` read stored results (:mod:`flows.bench_report`). Suites that measure a plan save their
results in the store (``bench_<suite>_raw`` + ``bench_summary``), print them, and exit 1 when their verdict is
``fail`` (0 for pass and info), so CI can gate on them. A suite whose subject is a synth preset
(``flux bench synth PRESET``) or the GPU record's pairs (``flux bench record PAIRS``) stores its rows the same way,
with no plan id.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from artifacts.errors import FluxError
from artifacts.logs import console
from tasks.bench.context import BenchSite, open_bench, open_site
from tasks.bench.record import save_run
from tasks.bench.registry import Subject, Suite, csv, suites


def run_plan_suite(args: argparse.Namespace, suite: Suite, opts: BaseModel) -> int:
    """Open the plan, run one suite on it, store and print the results; exit 1 on a fail verdict."""
    ctx = open_bench(args.settings, args.plan)
    console(stderr=True).print(f"bench: plan {ctx.plan.id[:12]} ({ctx.plan.model_name}), backend {ctx.backend_build}",
                               markup=False)
    return _run(suite, ctx, opts, f"`flux bench show {ctx.plan.id[:12]} --suite {suite.name}` plots it")


def run_site_suite(args: argparse.Namespace, suite: Suite, opts: BaseModel) -> int:
    """Run a suite that needs no plan on this machine, store and print the results; exit 1 on a fail verdict."""
    site = open_site(args.settings)
    return _run(suite, site, opts, f"`flux sql \"SELECT * FROM bench_{suite.name}_raw\"` lists its rows")


def _run(suite: Suite, ctx: BenchSite, opts: BaseModel, then: str) -> int:
    from flows.bench_report import print_run

    err = console(stderr=True)
    run = suite.run(ctx, opts, lambda msg: err.print(f"bench: {msg}", markup=False))
    if run is None:  # nothing measured: the suite filed earlier results (flux bench record --import)
        return 0
    paths = save_run(run)
    print_run(run)
    err.print(f"stored run {run.run_id[:12]}: {paths[0]} (+{len(paths) - 1} bench_summary rows); {then}",
              markup=False)
    return 1 if run.verdict in ("fail", "invalid") else 0


def _scalar(annotation: Any) -> Any:
    """The type a flag's text converts to: ``X | None`` -> X; tuples and lists -> their item type."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _scalar(args[0])
    return annotation


def _parser(suite: Suite, name: str, info: FieldInfo) -> Callable[[str], Any] | None:
    """How a flag's text becomes the option's value (None: argparse's own ``type``)."""
    if name in suite.parsers:
        return suite.parsers[name]
    kind = _scalar(info.annotation)
    origin = typing.get_origin(kind)
    if origin in (tuple, list):
        item = typing.get_args(kind)[0]
        return lambda text: tuple(item(x) for x in csv(text))
    return kind if kind in (int, float, str) else None


def _plan_arg(p: argparse.ArgumentParser, suite: Suite) -> None:
    """A plan suite's positional: the plan."""
    p.add_argument("plan", help="a unique prefix of a plan id")


def _preset_arg(p: argparse.ArgumentParser, suite: Suite) -> None:
    """A preset suite's positional: a synth preset."""
    from artifacts.synth import PRESETS

    p.add_argument("preset", choices=sorted(PRESETS), metavar="PRESET", help="a synth preset, as `flux synth --like` takes")


def _pairs_arg(p: argparse.ArgumentParser, suite: Suite) -> None:
    """The GPU record's positional: its pairs, optional (``--import`` and ``--backfill-steps`` race none)."""
    info = suite.options.model_fields["pairs"]
    p.add_argument("pairs", nargs="?", default=None, metavar="PAIRS",
                   help=f"{info.description} (default {info.get_default()})".replace("%", "%%"))  # argparse's %


# each subject's positional argument; its value is the options model's field of the subject's name (not a plan's)
SUBJECT_ARGS: dict[Subject, Callable[[argparse.ArgumentParser, Suite], None]] = {
    "plan": _plan_arg, "preset": _preset_arg, "pairs": _pairs_arg}


def add_flags(p: argparse.ArgumentParser, suite: Suite) -> None:
    """The suite's positional subject (a plan, a synth preset, the record's pairs) and one flag per option it
    offers."""
    SUBJECT_ARGS[suite.subject](p, suite)
    for name in suite.flags:
        info = suite.options.model_fields[name]
        default = info.get_default(call_default_factory=True)
        text = suite.help_text.get(name) or info.description or name.replace("_", " ")
        if info.annotation is bool:
            flag = suite.flag(name) if not default else "--no-" + suite.flag(name).removeprefix("--")
            p.add_argument(flag, dest=name, action="store_false" if default else "store_true", default=None,
                           help=text)
            continue
        kind = _scalar(info.annotation)
        choices = typing.get_args(kind) if typing.get_origin(kind) is Literal else None
        shown = ",".join(map(str, default)) if isinstance(default, tuple | list) else default
        extra: dict[str, Any] = {"type": conv} if (conv := _parser(suite, name, info)) is not None else {}
        p.add_argument(suite.flag(name), dest=name, choices=choices, default=None, **extra,
                       help=text if shown in (None, "", ()) else f"{text} (default {shown})")


def _handler(suite: Suite) -> Callable[[argparse.Namespace], int]:
    def handle(args: argparse.Namespace) -> int:
        given = {name: getattr(args, name) for name in suite.flags if getattr(args, name) is not None}
        if suite.subject != "plan" and getattr(args, suite.subject) is not None:
            given[suite.subject] = getattr(args, suite.subject)
        try:
            opts = suite.options.model_validate(given)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = str(err["loc"][0]) if err["loc"] else ""
            raise FluxError(f"{suite.flag(field) if field in suite.flags else field} {err.get('input')!r}: "
                            f"{err['msg'].lower()}; see `flux bench {suite.name} --help`") from None
        return run_plan_suite(args, suite, opts) if suite.subject == "plan" else run_site_suite(args, suite, opts)

    return handle


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``flux bench``, one subcommand per declared suite and the reports, to the ``flux`` parser."""
    from flows.bench_report import REPORTS

    declared = suites()
    p = sub.add_parser("bench", help="benchmark a plan: " + ", ".join([*declared, *(r.name for r in REPORTS)]),
                       description="Benchmark suites; results are stored (bench_<suite>_raw, bench_summary) and "
                                   "queryable with `flux sql`. `flux bench SUITE --help` for each.")
    bench = p.add_subparsers(dest="suite", metavar="SUITE", required=True, parser_class=type(p))
    for s in declared.values():
        sp = bench.add_parser(s.name, help=s.help, description=s.description)
        add_flags(sp, s)
        sp.set_defaults(handler=_handler(s))
    for r in REPORTS:
        sp = bench.add_parser(r.name, help=r.help, description=r.description)
        r.add_arguments(sp)
        sp.set_defaults(handler=r.handler)
