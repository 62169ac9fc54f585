#!/usr/bin/env python3
"""Time to first token of prompts that extend what a sequence already holds, through ``flux serve``.

For each prompt length it sends, through ``POST /v1/chat/completions`` (streamed, the chat template and the
tokenizer included, as an agent's turns arrive):

1. ``cold``: a prompt nobody sent before (new random words: every token is computed);
2. ``same``: that prompt again (all but its last token are cached: llama.cpp computes the last one for its logits);
3. ``ext``: that prompt with about ``--ext`` tokens more at the end of its user turn (the prefix is cached, the new
   tokens and the template's closing tokens are computed);
4. ``turn``: the conversation's next turn as a coding agent sends it: the prompt, the last reply written otherwise
   (other words, as an agent that drops the reply's thinking re-templates it) and a new user turn of about
   ``--ext`` tokens. The prompt is cached; on a hybrid model (``--twin tiny-qwen3next``) its recurrent state is
   rewound to the checkpoint at the prompt's end (docs/serving.md, "Hybrid and recurrent models").

Each cold prompt is followed by ``--runs`` ``same`` requests, then ``--runs`` ``ext`` ones (each with new words, so
that none can come back whole from a parked state); every reply runs to ``--max-tokens`` (or its end), so the
sequence holds prompt + reply when the next request comes, as in a conversation. Each row prints the median time to
first token seen by this client (one kept-alive connection, from sending the request to the first chunk after the
role chunk) and the server's own (``ttft_ms`` of its access log: from the request's arrival to the worker's first
token), with the prompt tokens, the cached tokens and the tokens computed (prompt - cached) the server reported.

Without a plan id it serves a twin (``--twin``, tiny-moe by default) with a 65,536-token trained context from a
throwaway home (a stored hand-built plan: ``--n-ctx`` tokens per sequence, two sequences, on the CPU, or wholly on
the GPU with ``--gpu``), so it runs anywhere; with one it serves that plan from the user's own store (lengths that
do not fit the plan's context are skipped).

    python3 scripts/bench_cached_ttft.py [PLAN_ID] [--lengths 1024,4096,16384,32768] [--runs 5] [--cold-runs 1]
                                         [--ext 32] [--max-tokens 64] [--port 8098] [--json out.json]
    python3 scripts/bench_cached_ttft.py --twin qwen3-30b-a3b --gpu --workdir /dev/shm/cttft   # a GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
ACCESS = re.compile(r"access id=(\S+) .*?ttft_ms=([\d.]+|-)")
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
         "romeo sierra tango uniform victor whiskey xray yankee zulu river stone cloud paper green orange silver "
         "window garden engine number letter castle bridge forest market planet signal yellow winter summer").split()
TWIN_TOML = """
[serve]
prefill_timeout_s = 3600.0
decode_timeout_s = 600.0
queue_wait_s = 60.0
"""


@dataclass
class Sample:
    """One request: what the client and the server saw."""

    kind: str
    length: int
    client_ms: float
    server_ms: float | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def computed(self) -> int:
        """Prompt tokens the worker computed."""
        return self.prompt_tokens - self.cached_tokens


@dataclass
class Bench:
    """A running server and what it was asked."""

    base: str
    log: Path
    http: httpx.Client  # one connection, kept alive: a new client costs ~20 ms (its TLS context) before any byte
    samples: list[Sample] = field(default_factory=list)
    n: int = 0

    def ask(self, kind: str, length: int, content: str, max_tokens: int,
            then: tuple[str, str] | None = None) -> Sample:
        """Send one streamed chat request (``then``: an assistant reply and the next user turn after ``content``);
        its timings and usage."""
        self.n += 1
        rid = f"cttft-{os.getpid()}-{self.n}"
        more = [{"role": "assistant", "content": then[0]}, {"role": "user", "content": then[1]}] if then else []
        body = {"messages": [{"role": "system", "content": "You are a terse assistant."},
                             {"role": "user", "content": content}, *more],
                "max_tokens": max_tokens, "temperature": 0.7, "seed": self.n, "stream": True,
                "stream_options": {"include_usage": True}}
        first: float | None = None
        usage: dict[str, Any] = {}
        t0 = time.perf_counter()
        with self.http.stream("POST", f"{self.base}/v1/chat/completions", json=body, headers={"x-request-id": rid},
                              timeout=httpx.Timeout(3600.0)) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"{kind} {length}: HTTP {resp.status_code}: {resp.read()[:500]!r}")
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                delta = choices[0].get("delta", {}) if choices else {}
                if first is None and choices and (delta.get("content") or delta.get("tool_calls")
                                                  or choices[0].get("finish_reason")):
                    first = time.perf_counter()
        client_ms = ((first or time.perf_counter()) - t0) * 1e3
        sample = Sample(kind=kind, length=length, client_ms=client_ms, server_ms=self._server_ttft(rid),
                        prompt_tokens=int(usage.get("prompt_tokens", 0)),
                        cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)),
                        completion_tokens=int(usage.get("completion_tokens", 0)))
        self.samples.append(sample)
        return sample

    def _server_ttft(self, rid: str) -> float | None:
        """The server's ttft_ms for ``rid`` from its access log (written as the request ends)."""
        for _ in range(50):
            for m in ACCESS.finditer(self.log.read_text(errors="replace")):
                if m.group(1) == rid:
                    return None if m.group(2) == "-" else float(m.group(2))
            time.sleep(0.02)
        return None


def words(rng: random.Random, n: int) -> str:
    """``n`` random words."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def twin_plan(root: Path, twin: str, model: Path | None, n_ctx: int, threads: int,
              gpu: bool) -> tuple[str, dict[str, str]]:
    """A throwaway home holding a plan for ``model`` (else a twin with a 65,536-token trained context, written there):
    on the CPU, or with every layer on the GPU (flash attention)."""
    from artifacts.config import load_settings
    from artifacts.engine_params import EngineParams
    from artifacts.synth import synthesize
    from tasks.testing import stored_plan

    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLUX_", "XDG_"))}
    (root / "home").mkdir(parents=True, exist_ok=True)
    (root / "flux.toml").write_text(TWIN_TOML)
    env.update({"HOME": str(root / "home"), "XDG_DATA_HOME": str(root / "data"), "XDG_CACHE_HOME": str(root / "cache"),
                "XDG_CONFIG_HOME": str(root / "config"), "FLUX_CONFIG": str(root / "flux.toml"),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))})
    if model is None:
        model = root / f"{twin}-64k.gguf"
        if not model.exists():
            synthesize(twin, model, quant="Q4_0", overrides={"n_ctx_train": "65536"})
    placement: dict[str, Any] = {"n_gpu_layers": 999, "flash_attn": True} if gpu else {}
    params = EngineParams(n_ctx=n_ctx, n_seq_max=2, n_batch=512, n_ubatch=512, n_threads=threads,
                          n_threads_batch=threads, **placement)
    plan = stored_plan(load_settings(env), model, params)
    return plan.id, env


def start(plan_id: str, port: int, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``flux serve PLAN`` with its stderr (the access log) in ``log``; returns once /health answers."""
    proc = subprocess.Popen([sys.executable, "-m", "flows", "serve", plan_id[:12], "--port", str(port)], env=env,
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"flux serve exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"flux serve did not answer: {log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT, then kill."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def calibrate(bench: Bench, rng: random.Random) -> tuple[float, int]:
    """Tokens per random word and the tokens around the user's text (template, system turn)."""
    a = bench.ask("calibrate", 0, words(rng, 50), 1).prompt_tokens
    b = bench.ask("calibrate", 0, words(rng, 1050), 1).prompt_tokens
    per_word = (b - a) / 1000
    return per_word, max(0, round(a - 50 * per_word))


def run(bench: Bench, lengths: list[int], n_ctx: int, args: argparse.Namespace) -> None:
    """The cold / same / ext series at each length."""
    rng = random.Random(args.seed)
    per_word, overhead = calibrate(bench, rng)
    ext_words = max(1, round(args.ext / per_word))
    for length in lengths:
        if length + args.ext + 16 + args.max_tokens > n_ctx:
            print(f"{length}: skipped (the context holds {n_ctx} tokens per sequence)", flush=True)
            continue
        n_words = max(1, round((length - overhead) / per_word))
        for _ in range(args.cold_runs):
            text = words(rng, n_words)
            bench.ask("cold", length, text, args.max_tokens)
            for _ in range(args.runs):
                bench.ask("same", length, text, args.max_tokens)
            for _ in range(args.runs):  # new words each time: an extension sent before could come back parked whole
                bench.ask("ext", length, f"{text} {words(rng, ext_words)}", args.max_tokens)
            for _ in range(args.runs):  # the next turn after a reply written otherwise; `same` first leaves the
                bench.ask("same", length, text, args.max_tokens)  # sequence holding the prompt and its own reply
                bench.ask("turn", length, text, args.max_tokens, (words(rng, 24), words(rng, ext_words)))
        report(bench.samples, length)


def report(samples: list[Sample], length: int) -> None:
    """One line per kind at ``length``: medians."""
    for kind in ("cold", "same", "ext", "turn"):
        got = [s for s in samples if s.length == length and s.kind == kind]
        if not got:
            continue
        server = [s.server_ms for s in got if s.server_ms is not None]
        print(f"{length:>6} {kind:<5} n={len(got):<2} prompt={statistics.median(s.prompt_tokens for s in got):>7.0f} "
              f"cached={statistics.median(s.cached_tokens for s in got):>7.0f} "
              f"computed={statistics.median(s.computed for s in got):>6.0f} "
              f"ttft client={statistics.median(s.client_ms for s in got):>9.1f} ms "
              f"server={statistics.median(server) if server else float('nan'):>9.1f} ms "
              f"(min {min(s.client_ms for s in got):.1f}, max {max(s.client_ms for s in got):.1f})", flush=True)


def main() -> int:
    """Parse, serve, measure, print."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plan", nargs="?", help="a stored plan id (prefix); none: a tiny twin in a throwaway home")
    ap.add_argument("--lengths", default="1024,4096,16384,32768", help="prompt lengths in tokens")
    ap.add_argument("--runs", type=int, default=5, help="same/ext pairs after each cold prompt")
    ap.add_argument("--cold-runs", type=int, default=1, help="cold prompts per length (each followed by --runs pairs)")
    ap.add_argument("--ext", type=int, default=32, help="tokens the extended prompt adds")
    ap.add_argument("--max-tokens", type=int, default=64, help="reply length of every request")
    ap.add_argument("--port", type=int, default=8098)
    ap.add_argument("--twin", default="tiny-moe", help="the twin's preset (flux synth) without a plan id")
    ap.add_argument("--model", type=Path, help="without a plan id: serve this GGUF instead of writing a twin")
    ap.add_argument("--gpu", action="store_true", help="the twin's plan puts every layer on the GPU")
    ap.add_argument("--n-ctx", type=int, default=33792, help="the twin's context per sequence")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the twin's CPU threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write every sample here")
    ap.add_argument("--workdir", type=Path, help="keep the twin's home and the server's log here (default: a "
                    "temporary directory, removed at the end)")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    with tempfile.TemporaryDirectory(prefix="flux-cached-ttft-") as tmp:
        root = args.workdir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        if args.plan:
            plan_id, env = args.plan, dict(os.environ)
        else:
            plan_id, env = twin_plan(root, args.twin, args.model, args.n_ctx, args.threads, args.gpu)
        log = root / "serve.log"
        proc = start(plan_id, args.port, env, log)
        try:
            base = f"http://127.0.0.1:{args.port}"
            card = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]
            n_ctx = int(card["context_length"])
            print(f"plan {plan_id[:12]} model {card['id']} n_ctx {n_ctx}/sequence; medians of TTFT in ms", flush=True)
            with httpx.Client() as http:
                bench = Bench(base=base, log=log, http=http)
                run(bench, lengths, n_ctx, args)
            if args.json:
                args.json.write_text(json.dumps([asdict(s) | {"computed": s.computed} for s in bench.samples], indent=1))
        finally:
            stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
