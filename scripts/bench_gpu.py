#!/usr/bin/env python3
"""GPU benchmark record: Flux's plan vs llama-server --fit, the best --n-cpu-moe, and llama-cpp-python.

For each synthetic twin and GPU memory budget (GiB per GPU llama.cpp sees; 0 = the whole cards):
1. plan: probe → enumerate (under the budget) → prune → measure the finalists (Flux's own stages,
   without Prefect so that it runs on a bare GPU machine) → the fastest on the workload;
2. baselines: (a) llama-server with its automatic fit given the same budget (--fit-target = free
   memory minus the budget, so only the budget is usable), (b) the best --n-cpu-moe from a sweep of
   every value whose measured VRAM fits the budget, (c) llama-cpp-python with the most layers that fit;
3. a final race: plan, (b) and (c) in paired randomized rounds through the same worker; (a) in the same
   rounds through llama-server's own timings;
and reports pp512, tg128 and the validation-workload time (an agent conversation: long prompt, short
reply) as ratios, with the plan's measured peak VRAM and planning time. Results: Parquet in --out.

    python3 scripts/bench_gpu.py --out DIR [--models qwen3-30b-a3b,llama3-8b] [--budgets 8,12,16,24,0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from artifacts.config import load_settings  # noqa: E402
from artifacts.model_info import ModelInfo, model_info  # noqa: E402
from artifacts.synth import synthesize  # noqa: E402
from engine_bridge.backend import llama_server_path  # noqa: E402
from engine_bridge.client import WorkerClient  # noqa: E402
from engine_bridge.errors import EngineError  # noqa: E402
from engine_bridge.gpumem import GpuMemoryMeter  # noqa: E402
from engine_bridge.params import EngineParams, TensorOverride  # noqa: E402
from flows.workload import tune_prompts  # noqa: E402
from tasks.costmodel import Workload  # noqa: E402
from tasks.enumerate import enumerate_placements, gpu_limits  # noqa: E402
from tasks.measure import measure  # noqa: E402
from tasks.models import Candidate, HardwareReport, Placement, PlanRequest  # noqa: E402
from tasks.probe import probe  # noqa: E402
from tasks.prune import prune  # noqa: E402

GIB = 2**30
PROMPTS: dict[str, list[int]] = {}  # 'pp', 'agent' and 'chat': corpus text in the model's own tokens
CTX = 4096
PP, TG = 512, 128
AGENT_PROMPT, AGENT_GEN = 2048, 32
CHAT_PROMPT, CHAT_GEN = 128, 512  # a chat turn with a cached history: a short new message, a long reply


def gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f}"


def log(msg: str) -> None:
    print(f"[bench-gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


METER: GpuMemoryMeter | None = None


def gpu_used_by(pid: int | None) -> list[int] | None:
    """GPU bytes a process holds on each GPU of the host (NVML; see engine_bridge.gpumem)."""
    used = METER.used_by(pid) if METER else None
    return used if used else None


def within(used: list[int] | None, budget: int) -> bool:
    """A measured use fits a per-GPU budget (0: no budget) when no GPU holds more than it."""
    return used is not None and (budget <= 0 or max(used) <= budget)


def vram(used: list[int] | None) -> str:
    """GiB held in all, with the per-GPU split when several GPUs hold some."""
    if not used:
        return "n/a"
    busy = [u for u in used if u]
    return gib(sum(used)) + (f" ({' + '.join(gib(u) for u in busy)})" if len(busy) > 1 else "")


def gpu_free() -> list[int]:
    """Free bytes, now, of each GPU llama.cpp sees, in its order (NVML indices from CUDA_VISIBLE_DEVICES).

    NVML, not ggml: loading llama.cpp here would give this process a CUDA context of its own.
    """
    import pynvml

    pynvml.nvmlInit()
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip().isdigit()]
    indices = [int(d) for d in visible] or list(range(pynvml.nvmlDeviceGetCount()))
    return [int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).free) for i in indices]


def cand(cid: str, params: EngineParams, placement: Placement | None = None) -> Candidate:
    return Candidate(id=cid, family=cid, placement=placement or Placement(layer_device=["CPU"]), params=params,
                     weights_bytes={}, kv_bytes={}, compute_bytes={})


def ncmoe_params(n: int, n_layer: int, threads: int) -> EngineParams:
    """llama.cpp's --n-cpu-moe N: every layer on the GPU, the first N layers' experts on the CPU."""
    ov = (TensorOverride(pattern=rf"^blk\.({'|'.join(str(i) for i in range(n))})\.ffn_(up|down|gate)_exps", device="CPU"),) if n else ()
    return EngineParams(n_ctx=CTX, n_batch=2048, n_ubatch=512, n_threads=threads, n_threads_batch=threads, n_gpu_layers=999,
                        flash_attn=True, tensor_overrides=ov)


def probe_vram(model: Path, params: EngineParams, log_path: Path) -> tuple[list[int] | None, dict[str, Any] | None]:
    """Load a configuration, warm it up, time pp512 + 32 decode steps; return (GPU bytes held per GPU, timing).

    The memory is read after the timed run, when llama.cpp has allocated everything it will hold (weights,
    KV cache, compute buffers reserved for the worst-case batch): the configuration's peak.
    """
    w = WorkerClient(log_path=log_path, env=params.environment())
    try:
        if METER:
            METER.rebase()
        w.start()
        w.call("load", {"model": str(model), "params": params.model_dump()}, timeout=600)
        w.call("timed_run", {"prompt": PROMPTS["pp"][:64], "n_gen": 4}, timeout=600)
        t = w.call("timed_run", {"prompt": PROMPTS["pp"], "n_gen": 32}, timeout=600)
        return gpu_used_by(w.pid), t
    except EngineError as exc:
        log(f"  {exc}")
        return None, None
    finally:
        w.close()


def predicted_gpu_bytes(info: ModelInfo, cpu_expert_layers: set[int], gpu_layers: set[int]) -> int:
    """Weights a configuration puts on the GPU (before KV and compute buffers)."""
    total = 0
    for layer in info.layers:
        if layer.index not in gpu_layers:
            continue
        for role, b in layer.bytes_by_role.items():
            if not (role.startswith("experts_") and layer.index in cpu_expert_layers):
                total += b
    return total + info.bytes_by_role.get("output", 0)


def expert_layer_bytes(info: ModelInfo) -> int:
    """Bytes of one layer's expert tensors (what one more --n-cpu-moe step moves off the GPU)."""
    sizes = [sum(b for r, b in layer.bytes_by_role.items() if r.startswith("experts_")) for layer in info.layers]
    return max(1, max(sizes, default=1))


def layer_bytes(info: ModelInfo) -> int:
    """Bytes of the largest layer (what one -ngl step moves off the GPU)."""
    return max(1, max((sum(layer.bytes_by_role.values()) for layer in info.layers), default=1))


def sweep_ncmoe(model: Path, info: ModelInfo, budget: int, n_gpus: int, threads: int,
                log_path: Path) -> tuple[int, EngineParams] | None:
    """Best --n-cpu-moe (by decode) among values whose MEASURED VRAM fits the budget.

    Every step of N moves one more layer's experts to the CPU, which only slows decode and prefill
    (measured: ../shared notes and docs/benchmarks/h200.md), so the best value that fits is the smallest N
    whose measured VRAM fits. The sweep starts where the weights alone would fit, jumps by the measured
    excess over the budget divided by one layer's experts until a value fits, then measures N+1 too, so
    the choice is a measured one, not an assumption. With several GPUs llama.cpp splits the layers
    its own way (-sm layer, by free memory), as a user's --n-cpu-moe does; the fullest GPU must fit.
    """
    every = set(range(info.n_layer))
    n = 0
    if budget > 0:
        n = next((k for k in range(info.n_layer + 1)
                  if predicted_gpu_bytes(info, set(range(k)), every) <= budget * n_gpus), info.n_layer)
    step = expert_layer_bytes(info)
    fitting: list[tuple[float, int, EngineParams]] = []
    seen: set[int] = set()
    while 0 <= n <= info.n_layer and n not in seen and len(fitting) < (1 if budget <= 0 else 2):
        seen.add(n)
        p = ncmoe_params(n, info.n_layer, threads)
        used, t = probe_vram(model, p, log_path)
        if used is None or t is None:
            n += 1
            continue
        tps = t["gen_tokens"] / t["gen_ms"] * 1e3 if t["gen_ms"] else 0.0
        fits = within(used, budget)
        log(f"  --n-cpu-moe {n}: VRAM {vram(used)} GiB, tg {tps:.1f} tok/s{'' if fits else ' (over budget)'}")
        if fits:
            fitting.append((tps, n, p))
            n += 1
        else:
            n += max(1, -(-(max(used) - budget) // step))
    if not fitting:
        return None
    best = max(fitting, key=lambda x: x[0])
    return best[1], best[2]


def most_layers(model: Path, info: ModelInfo, budget: int, n_gpus: int, threads: int,
                log_path: Path) -> EngineParams | None:
    """llama-cpp-python with the most layers (-ngl, last layers first) whose measured VRAM fits."""
    k = info.n_layer
    if budget > 0:
        k = max((n for n in range(info.n_layer + 1)
                 if predicted_gpu_bytes(info, set(), set(range(info.n_layer - n, info.n_layer))) <= budget * n_gpus),
                default=0)
    step = layer_bytes(info)
    while k >= 0:
        p = EngineParams(n_ctx=CTX, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads, n_gpu_layers=k)
        used, _ = probe_vram(model, p, log_path)
        log(f"  -ngl {k}: VRAM {vram(used)} GiB")
        if within(used, budget):
            return p
        k -= max(1, -(-(max(used) - budget) // step)) if used else 1
    return None


class LlamaServerFit:
    """llama-server with --fit (its default), a margin that leaves only the budget usable."""

    def __init__(self, model: Path, budget: int, free: list[int], threads: int, log_path: Path) -> None:
        exe = llama_server_path(load_settings().cache_dir)
        if exe is None:
            raise SystemExit("llama-server not built: run scripts/build-backend.sh")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        args = [str(exe), "-m", str(model), "-c", str(CTX), "--port", str(self.port), "--host", "127.0.0.1",
                "-t", str(threads), "-np", "1", "--fit", "on"]
        if budget > 0:
            args += ["--fit-target", ",".join(str(max(0, (f - budget) // 2**20)) for f in free)]
        self.log = log_path.open("ab")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        import httpx

        # a connection per request, as tasks.bench_http.client_limits (that module needs duckdb, which a bare
        # GPU machine lacks): llama-server can drop a pooled connection; its own timings are what count
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600,
                                 limits=httpx.Limits(max_keepalive_connections=0))
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited: see {log_path}")
            time.sleep(0.5)
        raise SystemExit("llama-server did not become healthy")

    def run(self, prompt: list[int], n_gen: int) -> dict[str, Any]:
        """One completion of ``n_gen + 1`` tokens: llama-server's prompt time, then ``n_gen`` decode steps
        (its first token comes from the prompt's logits, as in the worker's timing)."""
        r = self.http.post("/completion", json={"prompt": prompt, "n_predict": n_gen + 1, "cache_prompt": False,
                                                "temperature": 0, "ignore_eos": True})
        t = r.json()["timings"]
        return {"prompt_tokens": t["prompt_n"], "prompt_ms": t["prompt_ms"], "gen_tokens": t["predicted_n"] - 1,
                "gen_ms": t["predicted_ms"]}

    def vram(self) -> list[int] | None:
        return gpu_used_by(self.proc.pid)

    def close(self) -> None:
        os.killpg(self.proc.pid, 9)
        self.proc.wait()
        self.log.close()


def plan(model: Path, info: ModelInfo, hw: HardwareReport, budget_gib: float, args: argparse.Namespace,
         log_path: Path) -> tuple[Candidate, float, list[dict[str, Any]]]:
    """Flux's stages for one budget: the measured-fastest finalist, planning seconds, finalist rows."""
    t0 = time.monotonic()
    req = PlanRequest(model=str(model), ctx=CTX, gpu_mem_budget_gib=[budget_gib] if budget_gib > 0 else None,
                      finalists=args.finalists, repeats=args.repeats, budget_s=args.plan_budget_s)
    space = enumerate_placements(info, hw, req, 10)
    if args.workload == "chat":  # decode-heavy: what the plan optimises is one chat turn
        work = Workload(prefill_tokens=CHAT_PROMPT, decode_tokens=CHAT_GEN, mean_prompt_tokens=CHAT_PROMPT)
        prompts, n_gen = [PROMPTS["chat"]], CHAT_GEN
    else:  # prefill-heavy, as a coding agent's
        work = Workload(prefill_tokens=PP + AGENT_PROMPT, decode_tokens=TG + AGENT_GEN,
                        mean_prompt_tokens=(PP + AGENT_PROMPT) / 2)
        prompts, n_gen = [PROMPTS["pp"], PROMPTS["agent"]], TG
    fin = prune(space, info, hw, work, args.finalists)
    sums, _, _, _ = measure(fin.finalists, model, prompts, n_gen, budget_s=args.plan_budget_s, repeats=args.repeats,
                            timeout_s=600, log_path=log_path, seed=1, gpu_budgets=gpu_limits(hw, req) if budget_gib > 0 else None)
    ok = [s for s in sums if s.workload_s]
    if not ok:
        raise RuntimeError("no finalist measured: " + "; ".join(f"{s.candidate_id}: {s.error}" for s in sums))
    best = min(ok, key=lambda s: s.workload_s or 1e9)
    chosen = next(c for c in fin.finalists if c.id == best.candidate_id)
    rows = [{"candidate": c.id, "family": c.family, "flags": " ".join(c.params.cli_args()), "pred_decode": p.decode_tps,
             "pred_prefill": p.prefill_tps, "meas_decode": s.decode_tps, "meas_prefill": s.prefill_tps,
             "meas_workload_s": s.workload_s, "gpu_gib": s.gpu_bytes and s.gpu_bytes / GIB, "error": s.error,
             "gpus_used": len(c.placement.gpus()),
             "pred_gpu_gib": json.dumps({d: round((c.weights_bytes.get(d, 0) + c.kv_bytes.get(d, 0)
                                                   + c.compute_bytes.get(d, 0)) / GIB, 2)
                                         for d in sorted(set(c.weights_bytes) | set(c.kv_bytes)) if d != "CPU"})}
            for c, p, s in zip(fin.finalists, fin.predictions, sums, strict=True)]
    return chosen, time.monotonic() - t0, rows


def race(model: Path, entries: dict[str, Candidate], server: LlamaServerFit | None, rounds: int,
         log_path: Path, chat: bool = False) -> dict[str, dict[str, list[float]]]:
    """Paired randomized rounds: every entry runs pp512+tg128 and the agent prompt (and, with ``chat``,
    a chat turn) once per round.

    Every configuration stays loaded in its own worker for the whole race (each fits its budget alone,
    and the card holds them all), so rounds measure steady state, not loads.
    """
    names = [*entries, *(["fit"] if server else [])]
    out: dict[str, dict[str, list[float]]] = {k: {"pp": [], "tg": [], "agent_s": [], **({"chat_s": []} if chat else {})}
                                              for k in names}
    workers: dict[str, WorkerClient] = {}
    rng = random.Random(3)
    pp_prompt, agent = PROMPTS["pp"], PROMPTS["agent"]
    try:
        for name, c in entries.items():
            w = WorkerClient(log_path=log_path, env=c.params.environment())
            w.start()
            w.call("load", {"model": str(model), "params": c.params.model_dump()}, timeout=600)
            workers[name] = w

        def turn(name: str, prompt: list[int], n_gen: int) -> dict[str, Any]:
            if name == "fit" and server is not None:
                return server.run(prompt, n_gen)
            return workers[name].call("timed_run", {"prompt": prompt, "n_gen": n_gen}, timeout=600)

        # One untimed full-size turn each before the rounds: cold, llama-server's first pp512 ran at 45% of
        # its later speed with the whole model on the GPU (runs 3-6: 2,600-3,504 vs 7,565-7,748 tok/s).
        for name in names:
            turn(name, pp_prompt, 4)
        for _ in range(rounds):
            rng.shuffle(names)
            for name in names:
                a, b = turn(name, pp_prompt, TG), turn(name, agent, AGENT_GEN)
                out[name]["pp"].append(a["prompt_tokens"] / a["prompt_ms"] * 1e3)
                out[name]["tg"].append(a["gen_tokens"] / a["gen_ms"] * 1e3)
                out[name]["agent_s"].append((b["prompt_ms"] + b["gen_ms"]) / 1e3)
                if chat:
                    c = turn(name, PROMPTS["chat"], CHAT_GEN)
                    out[name]["chat_s"].append((c["prompt_ms"] + c["gen_ms"]) / 1e3)
    finally:
        for w in workers.values():
            w.close()
    return out


def medians(raw: dict[str, dict[str, list[float]]], skip: int = 0) -> dict[str, dict[str, float]]:
    """Each contender's median of each measure over the rounds after the first ``skip``."""
    return {k: {m: statistics.median(v[skip:]) for m, v in d.items() if v[skip:]} for k, d in raw.items()}


def ratios(raw: dict[str, dict[str, list[float]]], skip: int = 0) -> dict[str, float]:
    """plan ÷ baseline medians (times inverted: higher is better) over the rounds after the first ``skip``."""
    med = medians(raw, skip)
    out: dict[str, float] = {}
    plan = med.get("plan", {})
    for base in ("fit", "ncmoe", "lcp"):
        b = med.get(base, {})
        for m, key in (("tg", "tg"), ("pp", "pp"), ("agent_s", "agent"), ("chat_s", "chat")):
            if m in plan and m in b and plan[m] and b[m]:
                out[f"{key}_vs_{base}"] = plan[m] / b[m] if m in ("tg", "pp") else b[m] / plan[m]
    return out


def rescore(path: Path) -> None:
    """Add ``*_warm`` columns to a results file: the ratios without each contender's first round.

    Runs 1-6 raced without a warm-up turn, and llama-server's first pp512 was cold; rows raced since
    have an untimed warm-up turn and all their rounds count.
    """
    rows = pq.read_table(path).to_pylist()
    for r in rows:
        raw = json.loads(r["raw"]) if r.get("raw") else {}
        n = min((len(v) for d in raw.values() for v in d.values()), default=0)
        warm = ratios(raw, skip=1) if n >= 2 else {}
        for k in ("tg_vs_fit", "pp_vs_fit", "agent_vs_fit", "chat_vs_fit", "tg_vs_ncmoe", "pp_vs_ncmoe",
                  "agent_vs_ncmoe", "chat_vs_ncmoe"):
            r[f"{k}_warm"] = warm.get(k)
        if r.get("model"):
            log(f"{r.get('run', '')} {r['model']} {r['budget_gib']:g} GiB x{r.get('n_gpus') or 1} {r.get('workload') or 'agent'}: "
                + ", ".join(f"{k} {r.get(k) or 0:.2f} -> {v:.2f}" for k, v in warm.items() if k.endswith("fit")))
    write_rows(rows, path)


def store_results(out: Path) -> None:
    """Put a run's Parquet files into the store as tables ``bench_gpu`` and ``bench_gpu_finalists``."""
    from artifacts.ids import content_id

    try:
        from artifacts.store import Store
    except ImportError as exc:  # a bare GPU machine without duckdb: import the files later with --import
        log(f"not stored ({exc}): copy {out} back and run scripts/bench_gpu.py --import --out {out}")
        return
    store = Store(load_settings().data_dir)
    for name, file in (("bench_gpu", "h200_results.parquet"), ("bench_gpu_finalists", "h200_finalists.parquet")):
        if (out / file).exists():
            table = pq.read_table(out / file)
            key = content_id({"table": name, "rows": table.to_pylist()})
            store.put_table(name, table, key=key)
            log(f"stored {out / file} as {name}/{key[:12]} (DuckDB: SELECT * FROM {name})")


def write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    """Rows to Parquet with every column any row has (a failed budget's row has only a few)."""
    names = list(dict.fromkeys(k for r in rows for k in r))
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in names} for r in rows]), path)


class ModelSetup:
    """One twin's file, facts, prompts and probe, made on first use."""

    def __init__(self, preset: str, args: argparse.Namespace, log_path: Path) -> None:
        self.preset = preset
        self.model = args.model_dir / f"{preset}-Q4_0.gguf"
        if not self.model.exists():
            r = synthesize(preset, self.model, quant="Q4_0")
            log(f"synthesized {preset}: {r.file_bytes / 1e9:.2f} GB in {r.seconds:.1f} s")
        self.info = model_info(self.model)
        self.prompts = tune_prompts(self.model, [PP, AGENT_PROMPT, CHAT_PROMPT], 0, log_path)
        self.hw = probe(self.model, "bench", load_settings(), "bench")
        log(f"probe {preset}: {[g.name for g in self.hw.gpus]}, RAM {self.hw.ram_read_gbs:.0f} GB/s, "
            f"H2D {[(g.h2d_pinned_gbs, g.h2d_pageable_gbs) for g in self.hw.gpus]}, kernels {[k.device for k in self.hw.kernels]}")


def one_budget(ms: ModelSetup, b: float, args: argparse.Namespace, threads: int, log_path: Path,
               finalists: list[dict[str, Any]]) -> dict[str, Any]:
    """Plan under one budget, find the baselines, race them; one result row."""
    model, info, hw, preset = ms.model, ms.info, ms.hw, ms.preset
    PROMPTS["pp"], PROMPTS["agent"], PROMPTS["chat"] = ms.prompts
    budget = int(b * GIB)
    log(f"{preset} budget {b:g} GiB: planning for the {args.workload} workload")
    chosen, plan_s, rows = plan(model, info, hw, b, args, log_path)
    finalists += [{"model": preset, "budget_gib": b, "workload": args.workload, **r} for r in rows]
    used, _ = probe_vram(model, chosen.params, log_path)
    log(f"  plan {chosen.family} in {plan_s:.0f} s; peak VRAM {vram(used)} GiB; flags {' '.join(chosen.params.cli_args())}")
    entries = {"plan": chosen}
    free = gpu_free() if hw.gpus else []
    n_gpus = max(1, len(free))
    sw = sweep_ncmoe(model, info, budget, n_gpus, threads, log_path) if info.is_moe and hw.gpus else None
    if sw:
        entries["ncmoe"] = cand(f"ncmoe-{sw[0]}", sw[1])
    lcp = most_layers(model, info, budget, n_gpus, threads, log_path) if hw.gpus else None
    if lcp:
        entries["lcp"] = cand(f"lcp-ngl{lcp.n_gpu_layers}", lcp)
    server = LlamaServerFit(model, budget, free, threads, log_path) if hw.gpus else None
    fit_vram = server.vram() if server else None
    log(f"  llama-server --fit: VRAM {vram(fit_vram)} GiB")
    try:
        res = race(model, entries, server, args.rounds, log_path, chat=args.workload == "chat")
    finally:
        if server:
            server.close()
    med = medians(res)
    row: dict[str, Any] = {
        "model": preset, "model_gib": info.weight_bytes / GIB, "budget_gib": b, "workload": args.workload, "plan_s": plan_s,
        "plan_family": chosen.family, "plan_flags": " ".join(chosen.params.cli_args()),
        "n_gpus": n_gpus if hw.gpus else 0, "plan_vram_gib": used and sum(used) / GIB,
        "plan_vram_max_gib": used and max(used) / GIB, "plan_within_budget": None if used is None else within(used, budget),
        "fit_vram_gib": fit_vram and sum(fit_vram) / GIB, "fit_vram_max_gib": fit_vram and max(fit_vram) / GIB,
        "plan_vram_by_gpu": used and json.dumps([round(u / GIB, 2) for u in used]),
        "fit_vram_by_gpu": fit_vram and json.dumps([round(u / GIB, 2) for u in fit_vram]),
        "ncmoe": sw[0] if sw else None,
        "lcp_ngl": lcp.n_gpu_layers if lcp else None, "rounds": args.rounds, "raw": json.dumps(res)}
    for k, d in med.items():
        for m, v in d.items():
            row[f"{k}_{m}"] = v
    row.update(ratios(res))
    log("  " + ", ".join(f"{k}={v:.3f}" for k, v in row.items()
                         if k.startswith(("tg_vs", "pp_vs", "agent_vs", "chat_vs", "plan_tg", "plan_pp")) and v))
    return row


def main() -> int:
    global METER
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default="qwen3-30b-a3b")
    ap.add_argument("--budgets", default="8,12,16,24,0")
    ap.add_argument("--pairs", default="", help="model:budget,... in this order (instead of models x budgets)")
    ap.add_argument("--model-dir", type=Path, default=Path("/dev/shm/flux-models"))
    ap.add_argument("--finalists", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workload", choices=("agent", "chat"), default="agent",
                    help="the mix the plan optimises: agent (2,560 prompt + 160 generated tokens, prefill-heavy) or "
                         "chat (128 + 512, decode-heavy); chat also races a chat turn")
    ap.add_argument("--plan-budget-s", type=float, default=120)
    ap.add_argument("--stop-after-s", type=float, default=0, help="start no new budget after this many seconds")
    ap.add_argument("--import", dest="import_only", action="store_true",
                    help="only store --out's Parquet files in the store (after copying them from a GPU machine)")
    ap.add_argument("--rescore", action="store_true",
                    help="add *_warm ratio columns (first round dropped) to --out's results file, then store it")
    args = ap.parse_args()
    if args.rescore:
        rescore(args.out / "h200_results.parquet")
    if args.import_only or args.rescore:
        store_results(args.out)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    args.model_dir.mkdir(parents=True, exist_ok=True)
    METER = GpuMemoryMeter()
    log_path = args.out / "workers.log"
    threads = os.cpu_count() or 1
    pairs = ([(m, float(b)) for m, b in (x.split(":") for x in args.pairs.split(","))] if args.pairs else
             [(m, float(b)) for m in args.models.split(",") for b in args.budgets.split(",")])
    setups: dict[str, ModelSetup] = {}
    results: list[dict[str, Any]] = []
    finalists: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for preset, b in pairs:
        if args.stop_after_s and time.monotonic() - t0 > args.stop_after_s:
            log(f"stopping before {preset} at {b:g} GiB: --stop-after-s {args.stop_after_s:g} reached")
            break
        if preset not in setups:
            setups[preset] = ModelSetup(preset, args, log_path)
        try:
            results.append(one_budget(setups[preset], b, args, threads, log_path, finalists))
        except (EngineError, SystemExit, RuntimeError) as exc:
            log(f"  {preset} at {b:g} GiB failed: {exc}")
            results.append({"model": preset, "budget_gib": b, "error": str(exc)})
        write_rows(results, args.out / "h200_results.parquet")
        write_rows(finalists, args.out / "h200_finalists.parquet")
    store_results(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
