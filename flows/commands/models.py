"""``flux synth`` and ``flux inspect``: model files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import psutil
from rich.table import Table

from artifacts.errors import FluxError, UnsupportedArchitecture
from artifacts.filehash import model_hash
from artifacts.logs import console
from artifacts.model_info import ModelInfo, model_info
from artifacts.synth import PRESETS, QUANTS, synthesize


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the model commands to the ``flux`` parser."""
    p = sub.add_parser("synth", help="write a shape-faithful random-weight twin of a real model",
                       description="Write a GGUF with a real model's tensor shapes and random weights "
                                   "(realistic MoE routing), for what-if planning, tests and benchmarks.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--like", choices=sorted(PRESETS), help="the model shape to copy")
    what.add_argument("--draft-of", type=Path, metavar="TARGET.gguf",
                      help="write a draft model of TARGET (its first --layers layers, head and tokenizer) and "
                           "measure how often its greedy token is the target's")
    what.add_argument("--heads-of", type=Path, metavar="MODEL.gguf",
                      help="write MODEL's next-token (MTP) block alone, a sidecar that `flux plan --heads` grafts "
                           "onto the model converted without it (llama-server -md FILE --spec-type draft-mtp)")
    p.add_argument("--layers", type=int, default=1, help="with --draft-of: the draft's layer count (default 1)")
    p.add_argument("--last", type=int, default=0, help=(
        "with --draft-of: how many of those layers are the model's last ones (the rest its first; default 0)"))
    p.add_argument("--quant", default="Q4_0", choices=QUANTS, help="weight type (default Q4_0)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a shape field, e.g. --set n_layer=4 (repeatable)")
    p.add_argument("--routing", choices=("uniform", "skewed", "local", "domains"), default="uniform",
                   help="expert popularity: uniform (a random router), skewed (per layer, 90%% of picks in the "
                        "busiest half of the experts, as published for Qwen3-30B-A3B), local (skewed, and about "
                        "45%% of a token's picks repeat on the next token) or domains (each corpus domain, code, "
                        "prose, log, chat, has its own skewed expert subset; qwen3moe twins; see docs/routing.md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", type=Path, required=True, help="the .gguf file to write")
    p.set_defaults(handler=cmd_synth)

    p = sub.add_parser("inspect", help="describe a GGUF model without loading its weights",
                       description="Architecture and llama.cpp support, parameters, bytes by role and "
                                   "layer, quant types, experts, trained context, KV bytes per token, hash.")
    p.add_argument("model", type=Path, help="a .gguf file (any shard of a split model)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-hash", action="store_true", help="skip the content hash (first hash reads the file)")
    p.set_defaults(handler=cmd_inspect)


def _overrides(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise FluxError(f"--set {item!r}: expected KEY=VALUE, e.g. --set n_layer=4")
        out[key.strip()] = value.strip()
    return out


def cmd_synth(args: argparse.Namespace) -> int:
    """Write a synthetic twin and report its size and speed (or a draft of a model and its acceptance)."""
    if args.draft_of is not None:
        return _draft(args)
    if args.heads_of is not None:
        return _heads(args)
    try:
        overrides = _overrides(args.overrides)
        if args.routing != "uniform":
            overrides.setdefault("routing", args.routing)
        res = synthesize(args.like, args.output, quant=args.quant, overrides=overrides or None, seed=args.seed)
    except ValueError as exc:
        raise FluxError(f"flux synth: {exc}") from exc
    mb_s = res.file_bytes / 1e6 / max(res.seconds, 1e-9)
    console().print(f"wrote {res.path}: {args.like} {args.quant}, {res.n_tensors} tensors, "
                    f"{res.file_bytes / 1e9:.3f} GB in {res.seconds:.1f} s ({mb_s:,.0f} MB/s)")
    return 0


def _heads(args: argparse.Namespace) -> int:
    from artifacts.synth.heads import heads_of

    if not args.heads_of.is_file():
        raise FluxError(f"flux synth --heads-of: {args.heads_of} is not a file; give a model's .gguf that has its "
                        "next-token block")
    try:
        res = heads_of(args.heads_of, args.output)
    except ValueError as exc:
        raise FluxError(f"flux synth --heads-of: {exc}") from exc
    console().print(f"wrote {res.path}: the next-token block of {args.heads_of.name} ({res.n_nextn_layers} "
                    f"layer(s)), {res.n_tensors} tensors, {res.file_bytes / 1e6:.1f} MB in {res.seconds:.1f} s")
    return 0


def _draft(args: argparse.Namespace) -> int:
    from artifacts.synth.draft import draft_twin
    from tasks.measurement.draft import agreement

    if not args.draft_of.is_file():
        raise FluxError(f"flux synth --draft-of: {args.draft_of} is not a file; give the target model's .gguf")
    try:
        res = draft_twin(args.draft_of, args.output, args.layers, args.last)
    except ValueError as exc:
        raise FluxError(f"flux synth --draft-of: {exc}") from exc
    con = console()
    which = (f"the first {res.n_layer - args.last} and the last {args.last}" if args.last else f"the first {res.n_layer}")
    con.print(f"wrote {res.path}: {which} of {res.target_layers} layers of {args.draft_of.name}, "
              f"{res.n_tensors} tensors, {res.file_bytes / 1e6:.1f} MB in {res.seconds:.1f} s")
    settings = args.settings
    # every physical core (2 where psutil has no count): the target's greedy continuations, on the CPU, are most
    # of the time for a large target
    got = agreement(args.draft_of, res.path, threads=psutil.cpu_count(logical=False) or 2,
                    log_path=settings.logs_dir / "draft.log")
    con.print(f"acceptance: the draft's greedy token is the target's at {got.acceptance:.0%} of {got.positions} "
              f"positions ({got.prompts} validation prompts); {got.mean_run:.1f} tokens accepted in a row on average")
    return 0


def inspect_model(path: Path, cache_dir: Path, with_hash: bool = True, logs_dir: Path | None = None) -> ModelInfo:
    """Read a model's header and, when asked, its content hash (remembered by path, size, mtime); with
    ``logs_dir``, also check that llama.cpp's loader accepts its tensors and hyperparameters (a worker there
    logs it)."""
    info = model_info(path)
    if not info.supported:
        raise UnsupportedArchitecture(path, info.architecture)
    if logs_dir is not None:
        from engine_bridge.structure import check_structure  # its worker protocol: only when asked

        check_structure(Path(info.shards[0]), logs_dir / "inspect-worker.log")
    if not with_hash:
        return info
    return info.model_copy(update={"content_hash": model_hash([Path(s) for s in info.shards], cache_dir)})


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print what a model is, for people or as JSON."""
    info = inspect_model(args.model, args.settings.cache_dir, with_hash=not args.no_hash,
                         logs_dir=args.settings.logs_dir)
    if args.json:
        console().print_json(json.dumps(_json_view(info)))
        return 0
    _print_human(info)
    return 0


def _json_view(info: ModelInfo) -> dict[str, object]:
    data = info.model_dump(mode="json")
    data["weight_bytes"] = info.weight_bytes
    data["experts"] = {"total": info.n_expert, "used": info.n_expert_used}
    data["layers"] = [{"index": layer.index, **layer.bytes_by_role} for layer in info.layers]
    return data


def _gb(n: int) -> str:
    return f"{n / 1e9:,.3f} GB" if n >= 1e8 else f"{n / 1e6:,.2f} MB"


def _print_human(info: ModelInfo) -> None:
    con = console()
    support = "[green]supported[/]" if info.supported else "[red]NOT supported by the pinned llama.cpp[/]"
    con.print(f"[bold]{info.name}[/]  {info.path}")
    con.print(f"architecture {info.architecture} ({support}); {len(info.shards)} file(s), {_gb(info.file_bytes)}")
    con.print(f"parameters {info.n_params / 1e9:.3f} B; layers {info.n_layer}; embedding {info.n_embd}; "
              f"heads {info.n_head}/{info.n_head_kv} kv; vocab {info.n_vocab}; trained context {info.n_ctx_train}")
    if info.is_moe:
        con.print(f"experts {info.n_expert} total, {info.n_expert_used} used per token")
    con.print("quant types: " + ", ".join(f"{k} {_gb(v)}" for k, v in sorted(info.quant_types.items())))
    roles = Table(title="bytes by role", show_edge=False)
    roles.add_column("role")
    roles.add_column("bytes", justify="right")
    for role, n in info.bytes_by_role.items():
        if n:
            roles.add_row(role, _gb(n))
    con.print(roles)
    layer0 = info.layers[0] if info.layers else None
    if layer0:
        con.print("per layer (layer 0): " + ", ".join(f"{k} {_gb(v)}" for k, v in layer0.bytes_by_role.items()))
    kv = info.kv_bytes_per_token
    con.print("KV bytes per token: " + ", ".join(f"{t} {kv[t]:,}" for t in ("f16", "q8_0", "q4_0", "f32")))
    if info.n_kv_layers is not None and info.n_kv_layers < info.n_layer:
        con.print(f"KV cache on {info.n_kv_layers} of {info.n_layer} layers (full attention); the other "
                  f"{info.n_layer - info.n_kv_layers} are recurrent: {_gb(info.recurrent_state_bytes)} of state per "
                  "sequence, whatever the context")
    if info.content_hash:
        con.print(f"content hash {info.content_hash}")
