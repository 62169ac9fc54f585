"""Anatomy of a hybrid decode step (a diagnosis, not the product path: llama.cpp's own llama-bench from Flux's
installed backend build, on a skewed twin, with the switches of patches/llama.cpp/README.md).

    python3 scripts/gpu_anatomy.py TWIN OUT_DIR [--preset qwen3-30b-a3b] [--hot 64,96] [--threads 16] [--reps 3]

For each variant: decode tok/s (`llama-bench -p 0 -n 128`, mean and sd of `--reps` runs) and the scheduler's
per-step profile (`FLUX_MOE_HOST_PROFILE=1`: host expert ms, host splits, overlapped, skipped, wait ms, call ms).
Variants: every weight on the GPU; every expert on the host; stock `--n-cpu-moe 19`; and for each hot count the
split with idle host parts skipped (the default), without the skip (`FLUX_MOE_SKIP_IDLE=0`), with a spinning
OpenMP team (`OMP_WAIT_POLICY=active`), without CUDA graphs (`GGML_CUDA_DISABLE_GRAPHS=1`) and with the host
part waiting for the device (`FLUX_MOE_HOST_SYNC=1`). Writes OUT_DIR/anatomy.json and OUT_DIR/anatomy.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from moe_split_twins import split_value

PROFILE = re.compile(r"flux-moe-host-profile: steps=(\d+) host_experts_ms=([\d.]+) host_expert_splits=([\d.]+) "
                     r"overlapped_splits=([\d.]+) wait_ms=([\d.]+) compute_call_ms=([\d.]+)"
                     r"(?: skipped_splits=([\d.]+))?")
CACHE_LOG = re.compile(r"flux-moe-cache: round=(\d+) swapped=(\d+) swaps=(\d+) reads=(\d+)")
OP_PROFILE = re.compile(r"flux-cuda-op-profile: computes=\d+ gpu_ms=([\d.]+)((?: \S+=[\d.]+/\d+)*)")
FIELDS = ("host_experts_ms", "host_expert_splits", "overlapped_splits", "wait_ms", "compute_call_ms", "skipped_splits")


def bench_binary() -> Path:
    """llama-bench of the installed backend build (backend/current)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flux" / "backend" / "current" / "bin"
    exe = Path(os.environ.get("FLUX_LLAMA_BENCH") or cache / "llama-bench")  # another build of it, for a quick A/B
    if not exe.exists():
        sys.exit(f"gpu_anatomy: no {exe}: build the backend first (scripts/build-backend.sh)")
    return exe


def run_variant(exe: Path, twin: Path, args: list[str], env: dict[str, str], threads: int, reps: int) -> dict:
    """One llama-bench decode run; its tok/s and the decode steps' profile (the last profile line of the run)."""
    cmd = [str(exe), "-m", str(twin), "-ngl", "99", "-fa", "1", "-t", str(threads), "-p", "0", "-n", "128",
           "-r", str(reps), "-o", "json", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env={**os.environ, "FLUX_MOE_HOST_PROFILE": "32", **env}, capture_output=True,
                          text=True, timeout=900, check=False)
    row: dict = {"args": args, "env": env, "wall_s": round(time.perf_counter() - t0, 1), "rc": proc.returncode}
    if proc.returncode != 0:
        row["error"] = proc.stderr.strip().splitlines()[-3:]
        return row
    result = json.loads(proc.stdout)[0]
    row["tok_s"] = round(float(result["avg_ts"]), 2)
    row["tok_s_sd"] = round(float(result["stddev_ts"]), 2)
    profiles = [m.groups() for m in PROFILE.finditer(proc.stderr)]
    if profiles:
        # the median of the profile lines (each averages 32 graph computes): the warm-up's first lines mix in
        last = [tuple(float(v) if v is not None else 0.0 for v in g[1:]) for g in profiles]
        row["profile"] = {f: round(statistics.median(p[i] for p in last), 3) for i, f in enumerate(FIELDS)}
    swaps = list(CACHE_LOG.finditer(proc.stderr))
    if swaps:  # FLUX_MOE_CACHE=adaptive with FLUX_MOE_CACHE_LOG=1 (patch 0007): the last round's counters
        row["cache"] = dict(zip(("rounds", "swapped", "swaps", "reads"), map(int, swaps[-1].groups()), strict=True))
    ops = list(OP_PROFILE.finditer(proc.stderr))
    if ops:  # FLUX_CUDA_OP_PROFILE (patch 0008): the last line's GPU ms per compute, by op, longest first
        gpu_ms, rest = ops[-1].groups()
        row["op_profile"] = {"gpu_ms": float(gpu_ms), **{k: float(v.split("/")[0]) for k, v in
                                                         (item.split("=", 1) for item in rest.split())}}
    return row


def variants(preset: str, hots: list[int], quick: bool = False, mapped: bool = False,
             adaptive: bool = False) -> list[tuple[str, list[str], dict[str, str], float]]:
    """(name, llama-bench args, environment, share of picks on the GPU); ``quick``: the skip's A/B only;
    ``mapped``: per hot count, the split with its cold experts on the host against the same read by the GPU
    from pinned host memory (FLUX_MOE_MAPPED, patch 0006), and at the largest hot count write-combined too
    (FLUX_MOE_MAPPED_WC); ``adaptive``: the mapped split with its GPU copies following recent routing
    (FLUX_MOE_CACHE=adaptive, patch 0007) beside the static one."""
    out: list[tuple[str, list[str], dict[str, str], float]] = [
        ("all on GPU", [], {}, 1.0),
        ("every expert on the host", ["-ot", "exps=CPU"], {}, 0.0),
        ("stock --n-cpu-moe 19", ["-ncmoe", "19"], {}, float("nan")),
    ]
    if quick:
        out = out[:1]
    elif mapped:
        out = [out[0], out[2]]
    for h in hots:
        value, share = split_value(preset, h)
        base = {"FLUX_MOE_SPLIT": value}
        tag = f"split {h} hot"
        if mapped:
            out += [(f"{tag}, cold on the host (default)", ["-ot", "exps=CPU"], base, share),
                    (f"{tag}, cold read by the GPU (mapped)", ["-ot", "exps=CPU"], {**base, "FLUX_MOE_MAPPED": "1"},
                     share)]
            if adaptive:
                out.append((f"{tag}, mapped, adaptive cache", ["-ot", "exps=CPU"],
                            {**base, "FLUX_MOE_MAPPED": "1", "FLUX_MOE_CACHE": "adaptive", "FLUX_MOE_CACHE_LOG": "1"},
                            share))
            if h == max(hots) and not adaptive:  # write-combined pinned memory: not snooped, maybe faster to read over the bus
                out.append((f"{tag}, mapped, write-combined", ["-ot", "exps=CPU"],
                            {**base, "FLUX_MOE_MAPPED": "1", "FLUX_MOE_MAPPED_WC": "1"}, share))
            continue
        if quick:
            out += [(f"{tag}, idle skip (default)", ["-ot", "exps=CPU"], base, share),
                    (f"{tag}, no idle skip", ["-ot", "exps=CPU"], {**base, "FLUX_MOE_SKIP_IDLE": "0"}, share)]
            continue
        out += [
            (f"{tag}, idle skip (default)", ["-ot", "exps=CPU"], base, share),
            (f"{tag}, no idle skip", ["-ot", "exps=CPU"], {**base, "FLUX_MOE_SKIP_IDLE": "0"}, share),
            (f"{tag}, idle skip + OMP active", ["-ot", "exps=CPU"], {**base, "OMP_WAIT_POLICY": "active"}, share),
            (f"{tag}, idle skip, no CUDA graphs", ["-ot", "exps=CPU"], {**base, "GGML_CUDA_DISABLE_GRAPHS": "1"},
             share),
            (f"{tag}, host sync", ["-ot", "exps=CPU"], {**base, "FLUX_MOE_HOST_SYNC": "1"}, share),
        ]
    return out


def table(rows: list[dict]) -> str:
    """The markdown table of anatomy.md."""
    lines = ["| variant | picks on GPU | decode tok/s | step ms | host experts ms | host splits | skipped | "
             "overlapped | wait ms | call ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        share = "" if r["share"] != r["share"] else f"{r['share']:.0%}"
        if "tok_s" not in r:
            lines.append(f"| {r['name']} | {share} | failed: {' '.join(r.get('error', []))[:80]} |||||||")
            continue
        p = r.get("profile", {})
        cells = [f"{p[f]:.2f}" if f in p else "" for f in ("host_experts_ms", "host_expert_splits", "skipped_splits",
                                                            "overlapped_splits", "wait_ms", "compute_call_ms")]
        lines.append(f"| {r['name']} | {share} | {r['tok_s']:.1f} ± {r['tok_s_sd']:.1f} | {1e3 / r['tok_s']:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("twin", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--hot", default="64,96")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="only all-on-GPU and the idle skip's A/B per hot count")
    ap.add_argument("--op-profile", choices=("1", "2"), default=None,
                    help="after the variants, run all-on-GPU and each split again with FLUX_CUDA_OP_PROFILE=1|2 "
                         "(GPU ms per op type / node name; no CUDA graphs, so not timed for speed)")
    ap.add_argument("--adaptive", action="store_true", help="with --mapped: the adaptive cache beside the static")
    ap.add_argument("--mapped", action="store_true",
                    help="all-on-GPU, stock --n-cpu-moe, and per hot count host vs mapped cold experts")
    ns = ap.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    exe = bench_binary()
    rows: list[dict] = []
    todo = variants(ns.preset, [int(h) for h in ns.hot.split(",")], ns.quick, ns.mapped, ns.adaptive)
    if ns.op_profile:
        todo += [(f"{name} [op profile]", args, {**env, "FLUX_CUDA_OP_PROFILE": ns.op_profile}, share)
                 for name, args, env, share in todo
                 if name == "all on GPU" or ("split" in name and "write-combined" not in name)]
    for name, args, env, share in todo:
        reps = 1 if name.endswith("[op profile]") else ns.reps
        row = {"name": name, "share": share, **run_variant(exe, ns.twin, args, env, ns.threads, reps)}
        rows.append(row)
        sys.stdout.write(f"{name}: {row.get('tok_s', 'failed')} tok/s {row.get('profile', '')} "
                         f"{row.get('cache', '')} {row.get('op_profile', '')}\n")
        sys.stdout.flush()
        (ns.out / "anatomy.json").write_text(json.dumps(rows, indent=1, default=str))
        (ns.out / "anatomy.md").write_text(table(rows))


if __name__ == "__main__":
    main()
