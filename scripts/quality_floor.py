#!/usr/bin/env python3
"""The validate gate on a twin: the noise floor of correct configurations, and configurations a bug makes.

A labelled diagnosis (it times nothing and plans nothing): for one twin it writes the reference
continuation of the validation prompts (all CPU, f16 KV, no flash attention), then scores that same
continuation with

* correct configurations, which only change kernels or their order: flash attention, another micro-batch,
  loaded instead of mapped weights, and with ``--gpu`` every layer on the GPU and the hybrids of a plan;
* wrong ones, which a real bug in a placement or a runtime setting would produce: a KV type outside the
  requested profile (q4_0), a model that uses fewer experts than it was trained with, a wrong rope base,
  and two tensors swapped (a tensor override or a loader that puts one tensor's data under another name);

and prints, for each, the statistics the gate can use (mean, p90 and max KL, top-1 agreement) and whether
:func:`tasks.validation.gate.passes` lets it through. Wrong configurations are separate twin files whose header
or data differ from the reference twin in just that one respect (same weights otherwise).

    python3 scripts/quality_floor.py --like qwen3moe-small --set n_layer=48 [--gpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from artifacts.config import load_settings  # noqa: E402
from artifacts.engine_params import EngineParams  # noqa: E402
from artifacts.gguf_header import read_header  # noqa: E402
from artifacts.records.evidence import FloorResult, QualityStats  # noqa: E402
from artifacts.synth import synthesize  # noqa: E402
from engine_bridge import ops  # noqa: E402
from engine_bridge.client import WorkerClient  # noqa: E402
from tasks.quality_gate import Gate, compare_all  # noqa: E402
from tasks.workload import validation_prompts  # noqa: E402


def twin(cache: Path, preset: str, sets: dict[str, str], quant: str, tag: str = "") -> Path:
    """The twin for ``preset`` with ``sets``, written once into the cache."""
    name = "-".join([preset, quant, *(f"{k}{v}" for k, v in sorted(sets.items()))]) + tag
    path = cache / "models" / "quality-floor" / f"{name}.gguf"
    if not path.exists():
        synthesize(preset, path, quant=quant, overrides=sets or None)  # type: ignore[arg-type]
    return path


def swapped(src: Path, a: str, b: str) -> Path:
    """A copy of ``src`` whose tensors ``a`` and ``b`` (same size) hold each other's data."""
    dst = src.with_name(src.stem + f"-swap-{a}-{b}.gguf")
    if dst.exists():
        return dst
    hdr = read_header(src)
    ta, tb = (next(t for t in hdr.tensors if t.name == n) for n in (a, b))
    if ta.n_bytes != tb.n_bytes:
        raise SystemExit(f"{a} and {b} differ in size: cannot swap them")
    tmp = dst.with_suffix(".partial")
    shutil.copyfile(src, tmp)
    with tmp.open("r+b") as f:
        f.seek(hdr.data_offset + ta.offset)
        da = f.read(ta.n_bytes)
        f.seek(hdr.data_offset + tb.offset)
        db = f.read(tb.n_bytes)
        f.seek(hdr.data_offset + ta.offset)
        f.write(db)
        f.seek(hdr.data_offset + tb.offset)
        f.write(da)
    tmp.replace(dst)
    return dst


def logprobs(model: Path, params: EngineParams, seqs: list[tuple[list[int], list[int]]], tmp: Path,
             log: Path) -> list[np.ndarray]:
    """Log-softmax rows of ``model`` with ``params`` before each continuation token of ``seqs``."""
    out = []
    with WorkerClient(log_path=log, env=params.environment()) as w:
        w.request(ops.LOAD, ops.LoadArgs(model=str(model), params=params), 1800)
        for i, (prompt, cont) in enumerate(seqs):
            path = tmp / f"lp-{i}.npy"
            w.request(ops.LOGPROBS, ops.LogprobsArgs(prompt=prompt, continuation=cont, out=str(path)), 1800)
            out.append(np.load(path))
    return out


def reference(model: Path, params: EngineParams, prompts: list[list[int]], n_tokens: int,
              log: Path) -> list[tuple[list[int], list[int]]]:
    """The reference's greedy continuation of each prompt."""
    with WorkerClient(log_path=log) as w:
        w.request(ops.LOAD, ops.LoadArgs(model=str(model), params=params), 1800)
        return [(p, w.request(ops.GREEDY, ops.GreedyArgs(prompt=p, n_gen=n_tokens, stop_eog=False), 1800).tokens)
                for p in prompts]


def plan_finalists(st: Any, prefix: str) -> list[Any]:
    """The finalists a saved plan was chosen from (the stored prune result that holds its candidate)."""
    from artifacts.records.kinds import FINALISTS, PLAN
    from artifacts.records.store import Records

    records = Records.at(st.data_dir)
    plan = records.find_by_prefix(PLAN, prefix)
    for fin in records.all(FINALISTS):
        if plan.candidate in fin.finalists:
            return [c for c in fin.finalists if c.placement.gpus()]
    raise SystemExit(f"plan {prefix}: its finalists are not in the store")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--like", default="qwen3moe-small")
    ap.add_argument("--set", action="append", default=[], help="synth override k=v (repeatable)")
    ap.add_argument("--quant", default="Q4_0")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--gpu", action="store_true", help="also every layer on the GPU")
    ap.add_argument("--plan", action="append", default=[], help="also every finalist of this saved plan (repeatable)")
    ap.add_argument("--model", type=Path, help="the twin file to use (default: synthesized from --like/--set)")
    ap.add_argument("--out", type=Path, help="write quality_floor.parquet here")
    ap.add_argument("--only", default="", help="comma-separated substrings: run only the variants they match")
    ap.add_argument("--prompts", type=int, default=0, help="use only this many validation prompts")
    ap.add_argument("--record", type=Path, help="also save every variant's log-probabilities (.npz)")
    args = ap.parse_args()
    st = load_settings()
    sets = dict(s.split("=", 1) for s in args.set)
    model = args.model or twin(st.cache_dir, args.like, sets, args.quant)
    hdr = read_header(model)
    arch = str(hdr.metadata["general.architecture"])
    n_used = int(hdr.metadata.get(f"{arch}.expert_used_count", 0) or 0)
    rope = float(hdr.metadata[f"{arch}.rope.freq_base"])
    threads = args.threads or 2
    n_ctx = 1024
    ref = EngineParams(n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads)
    variants: list[tuple[str, str, Path, EngineParams]] = [
        ("reference again", "correct", model, ref),
        ("flash attention", "correct", model, ref.model_copy(update={"flash_attn": True})),
        ("n_ubatch 64", "correct", model, ref.model_copy(update={"n_ubatch": 64, "n_batch": 64})),
        ("loaded weights + FA", "correct", model, ref.model_copy(update={"load_mode": "load", "flash_attn": True})),
        ("kv q8_0 + FA (other profile)", "profile", model, ref.model_copy(update={"type_k": "q8_0", "type_v": "q8_0", "flash_attn": True})),
        ("kv q4_0 + FA", "wrong", model, ref.model_copy(update={"type_k": "q4_0", "type_v": "q4_0", "flash_attn": True})),
        (f"rope base {rope:g} -> {rope / 8:g}", "wrong", twin(st.cache_dir, args.like, {**sets, "rope_base": str(rope / 8)}, args.quant), ref),
    ]
    if n_used > 1:
        fewer = max(1, n_used * 3 // 4)
        variants.append((f"experts used {n_used} -> {fewer}", "wrong",
                         twin(st.cache_dir, args.like, {**sets, "n_expert_used": str(fewer)}, args.quant), ref))
    part = "ffn_down_exps" if n_used else "ffn_down"
    variants.append((f"blk.1/blk.2 {part} swapped", "wrong",
                     swapped(model, f"blk.1.{part}.weight", f"blk.2.{part}.weight"), ref))
    if args.gpu:
        gpu = ref.model_copy(update={"n_gpu_layers": 999, "flash_attn": True})
        variants += [("all on GPU + FA", "correct", model, gpu),
                     ("all on GPU", "correct", model, gpu.model_copy(update={"flash_attn": False}))]
    for prefix in args.plan:
        variants += [(f"{prefix[:8]} {c.id} {c.family}", "correct", model, c.params.model_copy(update={"n_ctx": n_ctx}))
                     for c in plan_finalists(st, prefix)]
    if args.only:
        keys = args.only.split(",")
        variants = [v for v in variants if v[0] == "reference again" or any(k in v[0] for k in keys)]
    log = st.logs_dir / "quality-floor.log"
    prompts, _ = validation_prompts(model, n_ctx, args.tokens, 0, log)
    prompts = prompts[: args.prompts] if args.prompts else prompts
    t0 = time.monotonic()
    seqs = reference(model, ref, prompts, args.tokens, log)
    rows: list[dict[str, Any]] = []
    recorded: dict[str, np.ndarray] = {}
    stats: list[tuple[str, str, QualityStats]] = []
    with tempfile.TemporaryDirectory(prefix="flux-floor-") as d:
        ref_lp = logprobs(model, ref, seqs, Path(d), log)
        recorded |= {f"reference/{i}": lp.astype(np.float32) for i, lp in enumerate(ref_lp)}
        print(f"# {model.name}: {len(seqs)} sequences x {args.tokens} tokens; reference {time.monotonic() - t0:.0f} s")
        print(f"{'variant':34s} {'kind':8s} {'mean KL':>9s} {'p90 KL':>9s} {'max KL':>9s} {'top-1':>6s}")
        for name, kind, path, params in variants:
            lps = logprobs(path, params, seqs, Path(d), log)
            s = compare_all(ref_lp, lps)
            stats.append((name, kind, s))
            recorded |= {f"{kind}:{name}/{i}": lp.astype(np.float32) for i, lp in enumerate(lps)}
            rows.append({"twin": model.name, "variant": name, "kind": kind, **s.model_dump()})
            print(f"{name:34s} {kind:8s} {s.mean_kl:9.2e} {s.p90_kl:9.2e} {s.max_kl:9.2e} {s.top1:6.3f}", flush=True)
    floor = [FloorResult(name=n, stats=q) for n, k, q in stats if k == "correct" and n != "reference again"]
    gate = Gate()
    kl_limit, top1_limit = gate.limits(floor)
    print(f"# gate (tasks.quality_gate, defaults): the correct variants are the noise floor; limits mean KL "
          f"{kl_limit:.2e}, top-1 {top1_limit:.3f}")
    for n, k, q in stats:
        ok, why = gate.verdict(q, floor)
        print(f"{n:34s} {k:8s} {'pass' if ok else 'FAIL':5s} {why}")
        rows[[r["variant"] for r in rows].index(n)]["gate_pass"] = ok
    if args.record:
        np.savez_compressed(args.record, **recorded)  # type: ignore[arg-type]
    if args.out:
        import pyarrow as pa
        import pyarrow.parquet as pq

        args.out.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), args.out / f"quality_floor-{model.stem}.parquet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
