"""``flux version``, ``flux config``, ``flux devices``, ``flux generate``: the backend and settings."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from artifacts.config import Settings, default_toml, settings_toml
from artifacts.engine_params import EngineParams
from artifacts.gguf_header import read_header
from artifacts.logs import console
from artifacts.model_info import model_info
from engine_bridge import ops
from engine_bridge.backend import backend_info
from engine_bridge.bos import with_bos
from engine_bridge.client import WorkerClient


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the backend commands to the ``flux`` parser."""
    p = sub.add_parser("version", help="print Flux's version and the backend build id",
                       description="The backend build id is a hash of backend.pin, the patches and the built "
                                   "libraries; every plan records it.")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_version)

    p = sub.add_parser("config", help="print the effective settings as TOML",
                       description="Settings come from $FLUX_CONFIG, else ~/.config/flux/flux.toml, over the "
                                   "defaults. Both forms print a flux.toml with every field, models_dir and "
                                   "cache_dir included.")
    p.add_argument("--defaults", action="store_true",
                   help="print every default instead (locations from this environment), whatever flux.toml says")
    p.set_defaults(handler=cmd_config)

    p = sub.add_parser("devices", help="list the ggml devices the backend sees")
    p.set_defaults(handler=cmd_devices)

    p = sub.add_parser("generate", help="generate text with a model through the engine worker",
                       description="Loads the model in a worker process and prints a greedy completion "
                                   "(a chat reply with --chat).")
    p.add_argument("model", type=Path)
    p.add_argument("--prompt", default="The quick brown fox")
    p.add_argument("-n", "--max-tokens", type=int, default=16)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.set_defaults(handler=cmd_generate)


def cmd_version(args: argparse.Namespace) -> int:
    """Print the Flux version and the backend build id."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        flux_version = version("flux")
    except PackageNotFoundError:
        flux_version = "dev"
    info = backend_info(args.settings.cache_dir)
    if args.json:
        console().print_json(json.dumps({"flux": flux_version, **info.model_dump()}))
        return 0
    pin = info.pin
    console().print(
        f"flux {flux_version}\nbackend build {info.build_id} (llama-cpp-python "
        f"{pin.get('LLAMA_CPP_PYTHON_VERSION')}, llama.cpp {pin.get('LLAMA_CPP_COMMIT')}, "
        f"{len(info.patches)} patch(es))\nllama-server {info.llama_server or 'not built'}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """Print the effective settings, or every default, as a flux.toml."""
    settings: Settings = args.settings
    console().out(default_toml() if args.defaults else settings_toml(settings), end="", highlight=False)
    return 0


def _worker(settings: Settings) -> WorkerClient:
    return WorkerClient(log_path=settings.logs_dir / "worker.log",
                        hello_timeout_s=settings.serve.worker_timeouts.hello_s)


def cmd_devices(args: argparse.Namespace) -> int:
    """List ggml devices (through a worker: only it links llama.cpp)."""
    with _worker(args.settings) as w:
        devices = w.request(ops.DEVICES).devices
    con = console()
    for d in devices:
        con.print(f"{d.name:<8} {d.kind:<5} {d.description}  "
                  f"{d.memory_free / 2**30:.1f}/{d.memory_total / 2**30:.1f} GiB free")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Load a model in a worker and print a greedy completion."""
    info = model_info(args.model)  # a bad file fails here with a one-line error, before any load
    settings: Settings = args.settings
    params = EngineParams(n_ctx=min(args.ctx, info.n_ctx_train or args.ctx), n_batch=256, n_ubatch=256,
                          n_threads=args.threads, n_threads_batch=args.threads)
    con = console()
    with _worker(settings) as w:
        load = w.request(ops.LOAD, ops.LoadArgs(model=str(args.model), params=params),
                         timeout=settings.serve.worker_timeouts.load_s)
        if args.chat:
            reply = w.request(ops.CHAT, ops.ChatArgs(messages=[{"role": "user", "content": args.prompt}],
                                                     max_tokens=args.max_tokens))
            con.print(reply.choices[0]["message"]["content"], markup=False)
            usage = reply.model_dump().get("usage") or {}
            con.print(f"[dim]{usage.get('prompt_tokens')} prompt + {usage.get('completion_tokens')} "
                      f"completion tokens; load {load.load_ms:.0f} ms[/]")
            return 0
        # as the server tokenizes a text prompt: BOS first where the model wants it (the measuring load's
        # tokenize adds none)
        prompt = with_bos(read_header(args.model).metadata, w.tokenize(args.prompt))
        out = w.request(ops.GREEDY, ops.GreedyArgs(prompt=prompt, n_gen=args.max_tokens, stop_eog=False))
        timing = w.request(ops.TIMED_RUN, ops.TimedRunArgs(prompt=prompt, n_gen=args.max_tokens))
    con.print(args.prompt + out.text, markup=False)
    ids = ", ".join(map(str, prompt[:8])) + (", ..." if len(prompt) > 8 else "")
    con.print(f"[dim]{len(out.tokens)} tokens; prompt {len(prompt)} tokens ({ids}); prefill {timing.prompt_tokens} tok in "
              f"{timing.prompt_ms:.1f} ms, decode {timing.gen_tokens} tok in {timing.gen_ms:.1f} ms; "
              f"load {load.load_ms:.0f} ms[/]")
    return 0
