"""``flux fetch``: a GGUF model from a Hugging Face hub into ``models_dir``."""

from __future__ import annotations

import argparse

from rich.table import Table

from artifacts.logs import console


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``flux fetch`` to the ``flux`` parser."""
    p = sub.add_parser("fetch", help="download a GGUF model from a Hugging Face hub into models_dir",
                       description="Download a GGUF model (every shard of a split one) from a Hugging Face hub "
                                   "into models_dir/OWNER/NAME with huggingface_hub (HF_ENDPOINT, HF_TOKEN), check "
                                   "each file against the hub's sha256, and print the path `flux plan` takes. A "
                                   "repository with several models lists them: name one as REPO:FILE.")
    p.add_argument("spec", metavar="REPO[:FILE]", help="OWNER/NAME, or OWNER/NAME:FILE.gguf (any shard of a split "
                                                       "model names all of it)")
    p.add_argument("--revision", default=None, help="a branch, tag or commit (default: main)")
    p.set_defaults(handler=cmd_fetch)


def cmd_fetch(args: argparse.Namespace) -> int:
    """Fetch and check the model; print its path (stdout) for `flux plan`."""
    from artifacts.hub import SeveralModels, fetch, parse_spec

    repo, file = parse_spec(args.spec)
    try:
        got = fetch(repo, file, args.revision, args.settings.models_dir)
    except SeveralModels as exc:
        table = Table("FILE", "files", "GB", title=f"GGUF models in {repo}", show_edge=False)
        for m in exc.models:
            table.add_row(m.name, str(len(m.files)), f"{m.size / 1e9:.3f}")
        console(stderr=True).print(table)
        raise
    err = console(stderr=True)
    checked = "checked now" if got.hashed else "checked before"
    err.print(f"fetched {repo}@{got.commit[:12]}: {len(got.files)} file(s), {got.size / 1e9:.3f} GB, sha256 {checked}")
    err.print(f"plan it with: flux plan {got.path}")
    console().print(str(got.path), soft_wrap=True)
    return 0
