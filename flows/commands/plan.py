"""``flux plan``, ``flux plans``, ``flux show``, ``flux deploy``: making and reading plans."""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from artifacts.config import Settings
from artifacts.errors import FluxError
from artifacts.logs import console
from artifacts.model_info import ModelInfo
from artifacts.records.kinds import PLAN
from artifacts.records.plan import Plan, PlanRequest
from artifacts.records.store import Records
from flows.request import check_for_model, flow_params, gpu_budget_unused
from flows.request_flags import add_plan_flags, request_from_args

if TYPE_CHECKING:
    from tasks.stage import PlanContext

DEFAULT_MODEL = "tiny-moe"
# a model this small hashes in well under a second: its saved plan is looked up before anything starts, even at a
# path not seen before; a larger one seen for the first time is hashed beside Prefect's server's start
HASH_FIRST_BYTES = 1 << 30


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the planning commands to the ``flux`` parser."""
    p = sub.add_parser("plan", help="measure this machine and save the fastest plan for a model",
                       description="Runs the Prefect flow plan-model in-process: probe, enumerate, prune, "
                                   "measure, validate, persist. Prints the plan id. With no model, plans a "
                                   "synthesized tiny MoE model.")
    add_plan_flags(p)
    p.set_defaults(handler=cmd_plan)

    p = sub.add_parser("plans", help="list saved plans")
    p.set_defaults(handler=cmd_plans)

    p = sub.add_parser("show", help="print a saved plan", description="Placement, measured speeds with spread, "
                       "predicted vs measured, % of roofline, memory budget per device, and the plan's key.")
    p.add_argument("plan", help="a unique prefix of a plan id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_show)

    p = sub.add_parser("deploy", help="serve the plan-model/default Prefect deployment (needs a Prefect server)",
                       description="Long-running: with `prefect server start` running and PREFECT_API_URL set, "
                                   "`prefect deployment run 'plan-model/default' --param model=/path/m.gguf --watch`.")
    p.add_argument("--name", default="default")
    p.set_defaults(handler=cmd_deploy)


def default_model(settings: Settings) -> Path:
    """The embedded default: a tiny MoE twin synthesized once into ``models_dir``, where a person looks for models."""
    from artifacts.synth import synthesize

    path = settings.models_dir / f"{DEFAULT_MODEL}-Q4_0.gguf"
    if not path.exists():  # the same bytes every time (seed 0), so plans of an earlier copy still match
        synthesize(DEFAULT_MODEL, path, quant="Q4_0")
    return path


def cmd_plan(args: argparse.Namespace) -> int:
    """Plan a model (reusing a matching saved plan unless --replan) and print the plan id.

    What needs no process runs first: the flags, the model's header (a bad file is one line, exit 2) and, when the
    model's hash is remembered (or it is small), the look-up of a saved plan, which imports no Prefect and starts
    nothing. Only a plan to make starts llama.cpp's check of the model's tensors, then Prefect's server, beside
    the hashing of a large model seen for the first time.
    """
    from flows.plan_context import check_loader, hashes_remembered, plan_context, read_model
    from tasks.clock import mark_command_start

    mark_command_start()
    settings: Settings = args.settings
    model = Path(args.model) if args.model else default_model(settings)
    con = console(stderr=True)
    req = request_from_args(settings, args, model)
    if req.gpu_mem_budget_gib:  # said at once, not only in the plan's notes after the whole run
        from engine_bridge.machine_facts import machine_facts

        unused = gpu_budget_unused(req, len(machine_facts().gpus))
        if unused:
            con.print(f"note: {unused}", markup=False)
    t0 = time.monotonic()
    info = read_model(req, settings)
    check_for_model(req, info.n_ctx_train)
    if req.routing_from is not None:  # a served trace: stored, its id keys the plan
        from flows.routing_from import resolve_routing_from

        req = resolve_routing_from(req, settings, info)
    look_up = not req.replan and not req.reprobe
    if look_up and (info.file_bytes <= HASH_FIRST_BYTES or hashes_remembered(info, settings.cache_dir)):
        if _reused(plan_context(req, settings, info), con):
            return 0
        look_up = False  # no saved plan for these bytes, this machine and these flags
    check_loader(info, settings)
    server_ready = _start_prefect_server_early()
    try:
        return _plan(req, settings, info, con, t0, look_up, server_ready)
    finally:
        # never leave the early start mid-way: an error (a refused engine, a bad model) returned while the thread
        # was still spawning the server, and the interpreter's shutdown under it aborted the process (SIGABRT
        # instead of exit 2 in a CI run).
        server_ready()


def _reused(pctx: PlanContext, con: Console) -> bool:
    """Print the saved plan matching ``pctx``'s key, if there is one."""
    from tasks import pipeline

    found = pipeline.existing_plan(pctx)
    if not found:
        return False
    pipeline.remember_model_path(pctx)
    con.print(f"reusing saved plan {found[:12]} (same model bytes, machine, backend and flags; --replan to "
              "measure again)")
    console().print(found)
    return True


def _plan(req: PlanRequest, settings: Settings, info: ModelInfo, con: Console, t0: float, look_up: bool,
          server_ready: Callable[[], None]) -> int:
    from flows.plan_context import plan_context, preflight_engines

    pctx = plan_context(req, settings, info)  # hashes a model seen for the first time, beside the server's start
    if look_up and _reused(pctx, con):
        return 0
    preflight_engines(pctx.engines, pctx.model, info.n_ctx_train, settings)
    from flows.plan_model import plan_model

    _quiet_flux_errors()
    server_ready()
    plan_id = plan_model(**flow_params(req))
    con.print(f"planned in {time.monotonic() - t0:.0f} s; `flux show {plan_id[:12]}` prints it, "
              f"`flux serve {plan_id[:12]}` serves it")
    console().print(plan_id)
    return 0


def _start_prefect_server_early() -> Callable[[], None]:
    """Start Prefect's temporary server (when no PREFECT_API_URL names one) in a thread while the model is hashed
    and the saved plans are searched, and return what waits for it: on the H200 its start took 10 s and the
    hash of a 17 GB model 6.6 s, one after the other. The flow then finds it running; a start that failed
    here is retried by the flow's own, which reports it."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return lambda: None
    # its "Starting/Stopping temporary server" lines are said by the thread, at any moment: a refusal printed
    # meanwhile must stay the one line on stderr (CI saw three), and Flux prints its own progress
    logging.getLogger("prefect").addFilter(_NoTemporaryServerLines())

    def start() -> None:
        from prefect.server.api.server import SubprocessASGIServer

        try:
            SubprocessASGIServer().start()
        except Exception as e:  # noqa: BLE001 - the flow's own start retries and reports it
            logging.getLogger(__name__).debug("Prefect's temporary server did not start early: %s", e)

    thread = threading.Thread(target=start, name="flux-prefect-server", daemon=True)
    thread.start()
    return thread.join


class _NoTemporaryServerLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "temporary server on" not in record.getMessage()


class _NoTracebackForFluxErrors(logging.Filter):
    """Prefect logs a failed task's traceback; a FluxError is a message for a person, not a bug."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], FluxError):
            record.exc_info = None
            record.exc_text = None
        return True


def _quiet_flux_errors() -> None:
    for name in ("prefect", "prefect.task_runs", "prefect.flow_runs"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(_NoTracebackForFluxErrors())


def load_plan(settings: Settings, prefix: str) -> Plan:
    """The saved plan with this unique id prefix."""
    return Records.at(settings.data_dir).find_by_prefix(PLAN, prefix)


def cmd_plans(args: argparse.Namespace) -> int:
    """List saved plans, newest last, in the richest layout that fits the terminal."""
    from flows.show import print_plans

    plans, unreadable = Records.at(args.settings.data_dir).readable(PLAN)
    print_plans(plans, console())
    for pid, why in unreadable:  # one stale record must not hide the others
        console(stderr=True).print(f"note: plan {pid[:12]} is not listed: {why}", markup=False, soft_wrap=True)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """Print one plan."""
    from flows.routing_from import refits_of
    from flows.show import plan_trials, print_plan

    plan = load_plan(args.settings, args.plan)
    if args.json:
        console().print_json(plan.model_dump_json())
    else:
        print_plan(plan, reserve_percent=args.settings.host_reserve_percent,
                   trials=plan_trials(args.settings.data_dir, plan), data_dir=args.settings.data_dir,
                   kv_host_bytes=args.settings.serve.kv_host_bytes)
        for refit, tokens in refits_of(args.settings, plan):
            console().print(f"re-fitted as {refit.id[:12]} from the routing `flux serve` of this plan counted "
                            f"({tokens} sampled tokens): `flux show {refit.id[:12]}`", markup=False)
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    """Serve the plan-model deployment until interrupted."""
    from flows.plan_model import plan_model

    plan_model.serve(name=args.name)
    return 0
