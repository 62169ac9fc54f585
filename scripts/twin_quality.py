#!/usr/bin/env python3
"""How close two CPU configurations come to the reference placement on a twin (the validate stage's gates).

Runs Flux's validate stage (real workers) on the TinyLlama twin for flash attention on (ub 512, loaded
weights) and off (ub 128, mmap), against the reference (CPU, f16 KV, no flash attention), and prints each
one's mean KL and top-1 agreement over the validation sequences.

    python3 scripts/twin_quality.py [--tokens 32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from artifacts.config import load_settings  # noqa: E402
from artifacts.synth import cached_twin  # noqa: E402
from engine_bridge.params import EngineParams  # noqa: E402
from flows.workload import validation_prompts  # noqa: E402
from tasks.models import Candidate, MeasureSummary, Placement  # noqa: E402
from tasks.validate import validate  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    st = load_settings()
    model = cached_twin(st.cache_dir, "tinyllama-1.1b")
    configs = {
        "flash-attn-on": EngineParams(n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=2, n_threads_batch=2,
                                      flash_attn=True, load_mode="load"),
        "flash-attn-off": EngineParams(n_ctx=1024, n_batch=128, n_ubatch=128, n_threads=1, n_threads_batch=2,
                                       flash_attn=False, load_mode="mmap"),
    }
    cands = [Candidate(id=name, family=name, placement=Placement(layer_device=["CPU"]), params=p, weights_bytes={},
                       kv_bytes={}, compute_bytes={}) for name, p in configs.items()]
    log = st.logs_dir / "twin-quality.log"
    seqs, held = validation_prompts(model, 1024, args.tokens, 0, log)
    report = validate(cands, [MeasureSummary(candidate_id=c.id, prefill_tps=1.0, decode_tps=1.0, workload_s=1.0,
                                             n_trials=1) for c in cands],
                      model, seqs, held[:1], n_tokens=args.tokens, max_kl=1.0, min_top1=0.0,
                      quality_profile="reference", log_path=log, timeout_s=600)
    for r in report.results:
        print(f"{r.candidate_id:15s} mean KL {r.mean_kl:.4f}  top-1 {r.top1_agreement:.3f}  over {r.n_tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
