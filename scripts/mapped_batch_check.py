#!/usr/bin/env python3
"""A diagnosis on a CUDA machine: does a mapped split (patch 0006) compute decode batches of 5-8 tokens right?

Flux lets a mapped split's GPU compute the cold picks of batches up to what CUDA's vector kernels take (8 tokens of
Q4_0, ``EngineParams.expert_mapped_tokens``) instead of the patch's default 4. This starts llama-server of the
patched build three times on MODEL with N parallel sequences (so that each decode step is a batch of N tokens):
stock (no split), a mapped split of half of every layer's experts with FLUX_MOE_MAPPED_MAX_TOKENS=4 (batches above
4 take the host path) and with 8 (they stay on the GPU), sends the same N greedy requests to each at once, and
prints how many generated tokens each split agrees with the stock run on and its decode speed.

    python3 scripts/mapped_batch_check.py MODEL.gguf OUT [--parallel 6] [--tokens 48] [--layers 4 --experts 8]

Standard library only (the lent machine's Python has no Flux dependencies); OUT/mapped_batch_check.json keeps
every reply. Not the product path: a check of the kernels beneath it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

PROMPTS = ["The history of the city begins", "def fibonacci(n):", "In the morning the market", "Dear committee,",
           "The experiment measured", "Once upon a time there", "SELECT name FROM", "The recipe calls for"]


def gguf_counts(model: Path, layers: int | None, experts: int | None) -> tuple[int, int]:
    """(layers, experts): as given, else from the file's header with the gguf package."""
    if layers and experts:
        return layers, experts
    try:
        from gguf import GGUFReader
    except ImportError:
        raise SystemExit("mapped_batch_check: no gguf package here to read the model's header: give --layers and "
                         "--experts (tiny-moe: 4 and 8)") from None
    r = GGUFReader(model)
    arch = str(r.fields["general.architecture"].contents())
    return int(r.fields[f"{arch}.block_count"].contents()), int(r.fields[f"{arch}.expert_count"].contents())


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def run(server: str, model: Path, env: dict[str, str], n: int, tokens: int, port: int, log: Path) -> list[dict[str, object]]:
    """Start llama-server with ``env``, send ``n`` greedy requests at once, return their replies."""
    cmd = [server, "-m", str(model), "-ngl", "999", "-np", str(n), "-c", str(512 * n), "--port", str(port),
           "--no-warmup", *(["-ot", r"\.ffn_(up|down|gate)_exps\.=CPU"] if "FLUX_MOE_SPLIT" in env else [])]
    with log.open("a") as fh:
        fh.write(f"$ {' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        out: list[dict[str, object]] = [{} for _ in range(n)]

        def one(i: int) -> None:
            out[i] = post(f"http://127.0.0.1:{port}/completion", {
                "prompt": PROMPTS[i % len(PROMPTS)], "n_predict": tokens, "temperature": 0.0, "top_k": 1,
                "cache_prompt": False, "return_tokens": True})

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--parallel", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--server", default=str(Path.home() / ".cache/flux/backend/current/bin/llama-server"))
    ap.add_argument("--layers", type=int, default=None, help="the model's layer count (else read from its header)")
    ap.add_argument("--experts", type=int, default=None, help="its experts per layer (else read from its header)")
    ap.add_argument("--only", default="", help="comma-separated configurations to run (stock, mapped-max4, mapped-max8)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    layers, experts = gguf_counts(args.model, args.layers, args.experts)
    split = "CUDA0|" + ";".join(f"{i}:" + ",".join(str(e) for e in range(experts // 2)) for i in range(layers))
    configs = {"stock": {}, **{f"mapped-max{m}": {"FLUX_MOE_SPLIT": split, "FLUX_MOE_MAPPED": "1",
                                                  "FLUX_MOE_MAPPED_MAX_TOKENS": str(m)} for m in (4, 8)}}
    if args.only:
        configs = {k: v for k, v in configs.items() if k in args.only.split(",")}
    got = {name: run(args.server, args.model, env, args.parallel, args.tokens, 18200 + k, args.out / "server.log")
           for k, (name, env) in enumerate(configs.items())}
    base = got.get("stock") or next(iter(got.values()))
    summary = {}
    for name, replies in got.items():
        same = total = 0
        for a, b in zip(base, replies, strict=True):
            ta, tb = list(a.get("tokens") or []), list(b.get("tokens") or [])
            total += len(ta)
            for x, y in zip(ta, tb, strict=False):
                if x != y:
                    break
                same += 1
        tps = [float((r.get("timings") or {}).get("predicted_per_second", 0.0)) for r in replies]  # type: ignore[union-attr]
        summary[name] = {"tokens_same_as_stock_before_first_difference": same, "tokens": total,
                         "decode_tps_per_sequence_median": sorted(tps)[len(tps) // 2] if tps else None}
        print(f"mapped_batch_check: {name}: {same}/{total} tokens as stock before the first difference, "
              f"decode {summary[name]['decode_tps_per_sequence_median']} tok/s per sequence ({args.parallel} at once)")
    (args.out / "mapped_batch_check.json").write_text(json.dumps({"summary": summary, "replies": got}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
