"""``flux bench <suite> ...``: the benchmark suites, each a :class:`BenchSuite` in a registry.

A suite module exposes ``bench_suites() -> list[BenchSuite]`` and is listed in :data:`SUITE_MODULES`;
``flux bench`` adds one subcommand per suite (soak and arrivals plug in the same way). Suites that
measure a plan save their results in the store (``bench_<suite>_raw`` + ``bench_summary``), print them,
and exit 1 when their verdict is ``fail`` (0 for pass and info), so CI can gate on them.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from artifacts.logs import console
from tasks.bench_common import BenchContext, BenchRun, Progress, open_bench, save_run

ArgAdder = Callable[[argparse.ArgumentParser], None]
Handler = Callable[[argparse.Namespace], int]
SUITE_MODULES: tuple[str, ...] = ("flows.cmd_bench", "flows.bench_report", "tasks.bench_soak", "tasks.bench_arrivals")


@dataclass(frozen=True)
class BenchSuite:
    """One ``flux bench`` subcommand."""

    name: str
    help: str
    description: str
    add_arguments: ArgAdder
    handler: Handler


def _csv(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def run_plan_suite(args: argparse.Namespace, suite: Callable[[BenchContext, Any, Progress], BenchRun],
                   opts: Any) -> int:
    """Open the plan, run one suite on it, store and print the results; exit 1 on a fail verdict."""
    from flows.bench_report import print_run

    ctx = open_bench(args.settings, args.plan)
    err = console(stderr=True)
    err.print(f"bench: plan {ctx.plan.id[:12]} ({ctx.plan.model_name}), backend {ctx.backend_build}")
    run = suite(ctx, opts, lambda msg: err.print(f"bench: {msg}", markup=False))
    paths = save_run(run)
    print_run(run)
    err.print(f"stored run {run.run_id[:12]}: {paths[0]} (+{len(paths) - 1} bench_summary rows); "
              f"`flux bench show {ctx.plan.id[:12]} --suite {run.suite}` plots it", markup=False)
    return 1 if run.verdict == "fail" else 0


# -- run ----------------------------------------------------------------------------------------------
def _run_args(p: argparse.ArgumentParser) -> None:
    from tasks.bench_run import BASELINES, SERVED_BASELINES, RunOptions

    d = RunOptions()
    p.add_argument("plan", help="a unique prefix of a plan id")
    p.add_argument("--rounds", type=int, default=d.rounds, help=f"paired rounds (default {d.rounds})")
    p.add_argument("--prompts", type=int, default=d.prompts,
                   help=f"corpus prompts per round: 64, 256, 1024, ... tokens (default {d.prompts})")
    p.add_argument("--n-gen", type=int, default=d.n_gen, help=f"tokens decoded per prompt (default {d.n_gen})")
    p.add_argument("--baselines", type=_csv, default=None,
                   help=f"comma-separated, from {', '.join(BASELINES)} (default: all); with --via serve from "
                        f"{', '.join(SERVED_BASELINES)} (default: all)")
    p.add_argument("--via", choices=("worker", "serve"), default=d.via,
                   help="worker: the plan in an engine worker (default); serve: the plan served by flux serve, "
                        "raced over HTTP against llama-server at the plan's GPU budget and context")
    p.add_argument("--turns", type=_turns, default=(),
                   help="with --via serve: PROMPT:GEN tokens per turn, e.g. 512:128,2048:32 (the default)")
    p.add_argument("--gpu-mem-budget", type=_gib, default=None,
                   help="with --via serve: GiB per GPU for the baselines (default: the plan's budget)")
    p.add_argument("--seed", type=int, default=d.seed)


def _turns(text: str) -> tuple[tuple[int, int], ...]:
    try:
        pairs = [tuple(int(x) for x in part.split(":")) for part in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--turns {text!r}: expected PROMPT:GEN pairs, e.g. 512:128,2048:32") from None
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"--turns {text!r}: expected PROMPT:GEN pairs of positive integers")
    return tuple((a, b) for a, b in pairs)


def _gib(text: str) -> list[float]:
    try:
        return [float(x) for x in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpu-mem-budget {text!r}: expected GiB per GPU, e.g. 12 or 12,24") from None


def _run(args: argparse.Namespace) -> int:
    from tasks.bench_run import SERVED_BASELINES, RunOptions, bench_run

    default = SERVED_BASELINES if args.via == "serve" else RunOptions().baselines
    opts = RunOptions(rounds=args.rounds, prompts=args.prompts, n_gen=args.n_gen, baselines=args.baselines or default,
                      seed=args.seed, via=args.via, turns=args.turns, gpu_mem_budget_gib=args.gpu_mem_budget)
    return run_plan_suite(args, bench_run, opts)


# -- quality ------------------------------------------------------------------------------------------
def _quality_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="a unique prefix of a plan id")
    p.add_argument("--tokens", type=int, help="greedy tokens compared per prompt (default [plan] validate_tokens)")
    p.add_argument("--conversations", type=int, default=8, help="agent conversations compared (default 8)")
    p.add_argument("--ppl-windows", type=int, default=4, help="held-out text windows for perplexity (default 4)")
    p.add_argument("--seed", type=int, default=0)


def _quality(args: argparse.Namespace) -> int:
    from tasks.bench_quality import QualityOptions, bench_quality

    opts = QualityOptions(n_tokens=args.tokens, conversations=args.conversations, ppl_windows=args.ppl_windows,
                          seed=args.seed)
    return run_plan_suite(args, bench_quality, opts)


# -- conformance --------------------------------------------------------------------------------------
def _conformance_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="a unique prefix of a plan id")
    p.add_argument("--n-gen", type=int, default=24, help="greedy tokens compared per prompt (default 24)")
    p.add_argument("--conversations", type=int, default=8, help="agent conversations rendered (default 8)")
    p.add_argument("--seed", type=int, default=0)


def _conformance(args: argparse.Namespace) -> int:
    from tasks.bench_conformance import ConformanceOptions, bench_conformance

    opts = ConformanceOptions(n_gen=args.n_gen, conversations=args.conversations, seed=args.seed)
    return run_plan_suite(args, bench_conformance, opts)


# -- ablate -------------------------------------------------------------------------------------------
def _ablate_args(p: argparse.ArgumentParser) -> None:
    from tasks.bench_ablate import AblateOptions

    d = AblateOptions()
    p.add_argument("plan", help="a unique prefix of a plan id")
    p.add_argument("--rounds", type=int, default=d.rounds, help=f"paired rounds (default {d.rounds})")
    p.add_argument("--prompts", type=int, default=d.prompts, help=f"corpus prompts per round (default {d.prompts})")
    p.add_argument("--n-gen", type=int, default=d.n_gen, help=f"tokens decoded per prompt (default {d.n_gen})")
    p.add_argument("--seed", type=int, default=d.seed)


def _ablate(args: argparse.Namespace) -> int:
    from tasks.bench_ablate import AblateOptions, bench_ablate

    opts = AblateOptions(rounds=args.rounds, prompts=args.prompts, n_gen=args.n_gen, seed=args.seed)
    return run_plan_suite(args, bench_ablate, opts)


def bench_suites() -> list[BenchSuite]:
    """The suites that measure one plan."""
    return [
        BenchSuite("run", "race the plan against llama-server auto-fit and llama-cpp-python defaults",
                   "Paired, randomized rounds on the same corpus prompts, each engine started fresh per round; "
                   "prints prefill and decode ratios plan/baseline with 95% bootstrap intervals and a verdict "
                   "(faster, same within noise, slower; fail if slower). Exit 1 on fail.", _run_args, _run),
        BenchSuite("quality", "compare the plan with the reference placement: KL, top-1, perplexity",
                   "Greedy continuations of held-out prompts and agent conversations scored by both "
                   "configurations (mean/max KL, top-1 agreement) and teacher-forced perplexity of held-out "
                   "text. Pass within [plan] max_kl and min_top1; info for a non-reference quality profile. "
                   "Exit 1 on fail.", _quality_args, _quality),
        BenchSuite("conformance", "check that the native engine and llama-server agree",
                   "Chat template rendering, special tokens, tokenization (corpus + unicode/edge strings), "
                   "greedy outputs, stop sequences and usage counts; lists every disagreement. Pass when none "
                   "is left unexplained. Exit 1 on fail.", _conformance_args, _conformance),
        BenchSuite("ablate", "compare the full plan with variants that each undo one of its choices",
                   "Threads, n_ubatch, flash attention, load mode, KV offload, offload threshold, expert "
                   "placement: each choice the plan made differently from the default is undone in one variant, "
                   "raced in paired rounds; prints what each choice is worth.", _ablate_args, _ablate),
    ]


def suites() -> dict[str, BenchSuite]:
    """Every registered suite, by name, from the modules in :data:`SUITE_MODULES`."""
    out: dict[str, BenchSuite] = {}
    for name in SUITE_MODULES:
        for s in importlib.import_module(name).bench_suites():
            out[s.name] = s
    return out


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``flux bench`` and its suites to the ``flux`` parser."""
    registered = suites()
    p = sub.add_parser("bench", help="benchmark a plan: " + ", ".join(registered),
                       description="Benchmark suites; results are stored (bench_<suite>_raw, bench_summary) and "
                                   "queryable with DuckDB. `flux bench SUITE --help` for each.")
    bench = p.add_subparsers(dest="suite", metavar="SUITE", required=True)
    for s in registered.values():
        sp = bench.add_parser(s.name, help=s.help, description=s.description)
        s.add_arguments(sp)
        sp.set_defaults(handler=s.handler)
