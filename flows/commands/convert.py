"""``flux convert``: a Hugging Face checkpoint to GGUF with the pinned llama.cpp's converter, then ``flux inspect``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from artifacts.logs import console


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``flux convert`` to the ``flux`` parser."""
    from engine_bridge.convert import OUTTYPES

    p = sub.add_parser("convert", help="convert a Hugging Face checkpoint to GGUF (the pinned llama.cpp's converter)",
                       description="Run the pinned llama.cpp's own convert_hf_to_gguf.py (from the checked sdist the "
                                   "backend is built from, so it writes what the engine reads) on a checkpoint "
                                   "folder, then `flux inspect` the result. Needs pip install -e '.[convert]'.")
    p.add_argument("checkpoint", type=Path, metavar="CHECKPOINT_DIR", help="config.json, *.safetensors, tokenizer")
    p.add_argument("--outtype", choices=OUTTYPES, default="q8_0", help="weight type (default q8_0)")
    p.add_argument("-o", "--output", type=Path, required=True, help="the .gguf file to write")
    p.set_defaults(handler=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    """Convert, then describe the GGUF as `flux inspect` does (llama.cpp's loader checks it)."""
    from engine_bridge.convert import convert
    from flows.commands.models import cmd_inspect

    settings = args.settings
    log_path = settings.logs_dir / "convert.log"
    err = console(stderr=True)
    err.print(f"converting {args.checkpoint} to {args.outtype} with the pinned llama.cpp's converter "
              f"(its output: {log_path})")
    started = time.perf_counter()
    out = convert(args.checkpoint, args.output, args.outtype, settings.cache_dir, log_path)
    err.print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB) in {time.perf_counter() - started:.1f} s")
    return cmd_inspect(argparse.Namespace(model=out, json=False, no_hash=False, settings=settings))
