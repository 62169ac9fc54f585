"""Validate: the fastest finalists against a reference placement, on held-out prompts and agent chats.

The reference is the plainest configuration (all weights on the CPU, f16 KV, no flash attention). For
each validation sequence the reference writes a greedy continuation; the reference, the noise-floor
variants (the same reference with other correct kernels: :mod:`tasks.quality_gate`) and each candidate
then score that same continuation, and the candidate's next-token distributions must match the
reference's within the gate — unless the user asked for a different quality profile (e.g. ``--kv
q8_0``), in which case the numbers are recorded in the plan, not enforced.

The reference and the floor depend only on the model, the prompts and (for the floor) the machine and
build, so they are kept in a cache directory and computed once per model: a second plan of the same
model at another budget or context pays for its own candidates only.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from artifacts.engine_params import EngineParams
from artifacts.records.evidence import FloorResult, MeasureSummary, ValidationReport, ValidationResult
from artifacts.records.search import Candidate
from engine_bridge import ops
from engine_bridge.client import WorkerClient
from engine_bridge.errors import EngineError
from tasks.quality_gate import Gate, compare_all

log = logging.getLogger(__name__)
Seqs = list[tuple[list[int], list[int]]]
Progress = Callable[[str], None]
# A finalist holding less than the largest measured context must be this much faster to be chosen:
# a shorter context is a loss for the user, worth it only for a real speed-up, not for noise.
SHORTER_CONTEXT_GAIN = 0.05
UNSCORED_KL = 1e30  # a finalist that could not be scored: finite, so its row has a canonical JSON form


def reference_params(n_ctx: int, threads: int, seed: int = 0) -> EngineParams:
    """The reference placement: everything on the CPU in llama.cpp's plain layout (no repacking: the
    plainest kernels, and a mapped load costs no copy), f16 KV, no flash attention, mapped weights."""
    return EngineParams(n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                        n_gpu_layers=0, flash_attn=False, type_k="f16", type_v="f16", load_mode="mmap", seed=seed,
                        repack=False)


def validation_context(prompts: Sequence[Sequence[int]], n_tokens: int) -> int:
    """A context that holds the longest validation sequence (rounded up to 256 tokens)."""
    need = max((len(p) for p in prompts), default=16) + n_tokens + 8
    return (need + 255) // 256 * 256


def rank_measured(summaries: list[MeasureSummary], finalists: list[Candidate]) -> list[MeasureSummary]:
    """Measured finalists, fastest first by workload time; one holding a shorter context than the longest
    measured must be SHORTER_CONTEXT_GAIN faster than the longest-context ones to rank above them."""
    ctx = {c.id: c.params.n_ctx for c in finalists}
    ok = [s for s in summaries if s.workload_s is not None]
    longest = max((ctx[s.candidate_id] for s in ok), default=0)

    def key(s: MeasureSummary) -> float:
        penalty = 1.0 + SHORTER_CONTEXT_GAIN if ctx[s.candidate_id] < longest else 1.0
        return (s.workload_s or 0.0) * penalty

    return sorted(ok, key=key)


@dataclass(frozen=True)
class Cache:
    """Where the reference's and the noise floor's results are kept, under keys the caller derives."""

    directory: Path
    reference_key: str
    floor_key: str

    def reference(self) -> Path:
        """File of the reference's continuations and log-probabilities."""
        return self.directory / f"{self.reference_key}-reference.npz"

    def floor(self) -> Path:
        """File of the noise floor's statistics."""
        return self.directory / f"{self.floor_key}-floor.json"


def _logprobs(w: WorkerClient, seqs: Seqs, tmp: Path, tag: str, timeout_s: float,
              threads_file: Path | None = None) -> list[np.ndarray]:
    out = []
    for i, (prompt, cont) in enumerate(seqs):
        path = tmp / f"{tag}-{i}.npy"
        w.request(ops.LOGPROBS, ops.LogprobsArgs(prompt=prompt, continuation=cont, out=str(path), threads_file=str(
            threads_file) if threads_file else None), timeout_s)
        out.append(np.load(path))
        path.unlink()
    return out


def scored(model: Path, params: EngineParams, seqs: Seqs, tmp: Path, tag: str, log_path: Path,
           timeout_s: float, threads_file: Path | None = None) -> list[np.ndarray]:
    """Log-probabilities of ``seqs`` under ``params``, in a fresh worker (its threads following
    ``threads_file`` from one sequence to the next, when given)."""
    with WorkerClient(log_path=log_path, env=params.environment()) as w:
        w.request(ops.LOAD, ops.LoadArgs(model=str(model), params=params), timeout_s)
        return _logprobs(w, seqs, tmp, tag, timeout_s, threads_file)


def reference_continuations(model: Path, params: EngineParams, prompts: list[list[int]], n_tokens: int,
                            log_path: Path, timeout_s: float, cache: Cache | None,
                            generator: EngineParams | None = None,
                            threads_file: Path | None = None) -> tuple[Seqs, list[np.ndarray]]:
    """The greedy continuations (written by ``generator`` when given: a GPU holding the whole model, else by
    the reference) and the reference's log-probabilities of them (from the cache when there); a reference on
    the CPU scores with the threads ``threads_file`` gives (:class:`tasks.cores.CoreShare`)."""
    if cache is not None and cache.reference().exists():
        with np.load(cache.reference()) as z:
            conts = [z[f"cont{i}"].tolist() for i in range(len(prompts))]
            return list(zip(prompts, conts, strict=True)), [z[f"lp{i}"] for i in range(len(prompts))]

    def greedy(w: WorkerClient) -> Seqs:
        return [(p, w.request(ops.GREEDY, ops.GreedyArgs(prompt=p, n_gen=n_tokens, stop_eog=False), timeout_s).tokens)
                for p in prompts]

    with tempfile.TemporaryDirectory(prefix="flux-reference-") as d:
        if generator is not None:
            with WorkerClient(log_path=log_path, env=generator.environment()) as g:
                g.request(ops.LOAD, ops.LoadArgs(model=str(model), params=generator), timeout_s)
                seqs = greedy(g)
        with WorkerClient(log_path=log_path, env=params.environment()) as w:
            w.request(ops.LOAD, ops.LoadArgs(model=str(model), params=params), timeout_s)
            if generator is None:
                seqs = greedy(w)
            lps = _logprobs(w, seqs, Path(d), "ref", timeout_s, threads_file if params.n_gpu_layers == 0 else None)
    if cache is not None:
        cache.directory.mkdir(parents=True, exist_ok=True)
        part = cache.reference().with_suffix(f".{os.getpid()}.partial.npz")
        arrays: dict[str, np.ndarray] = {f"lp{i}": lp for i, lp in enumerate(lps)}
        arrays |= {f"cont{i}": np.asarray(c, dtype=np.int32) for i, (_, c) in enumerate(seqs)}
        np.savez(part, **arrays)  # type: ignore[arg-type]
        os.replace(part, cache.reference())
    return seqs, lps


def floor_results(model: Path, variants: Sequence[tuple[str, EngineParams]], seqs: Seqs, ref: list[np.ndarray],
                  log_path: Path, timeout_s: float, cache: Cache | None,
                  progress: Progress = log.info, threads_file: Path | None = None) -> list[FloorResult]:
    """The reference against itself with other correct kernels (from the cache when there).

    A variant that holds every layer on a GPU runs beside the ones that compute on the host (two lanes, each
    in order): it needs the CPU for little but its load, and on a big model it would otherwise wait out a
    CPU pass of tens of seconds. Two variants that compute on the host never run at once. With ``threads_file``
    (:class:`tasks.cores.CoreShare`), the host lane's threads follow it from one sequence to the next."""
    if cache is not None and cache.floor().exists():
        return [FloorResult.model_validate(x) for x in json.loads(cache.floor().read_text())]
    found: dict[int, FloorResult] = {}

    def lane(items: list[tuple[int, str, EngineParams]], d: Path) -> None:
        for i, name, params in items:
            one(i, name, params, d, threads_file if params.n_gpu_layers >= 0 else None)

    def one(i: int, name: str, params: EngineParams, d: Path, threads_file: Path | None) -> None:
        try:
            stats = compare_all(ref, scored(model, params, seqs, d, f"floor{i}", log_path, timeout_s, threads_file))
        except EngineError as exc:  # a variant that cannot run here (no room on the GPU) samples nothing
            progress(f"validate: noise floor {name}: not measured ({exc})")
            return
        found[i] = FloorResult(name=name, stats=stats)
        progress(f"validate: noise floor {name}: mean KL {stats.mean_kl:.2e}, p90 {stats.p90_kl:.2e}, "
                 f"top-1 {stats.top1:.3f}")

    items = [(i, name, params) for i, (name, params) in enumerate(variants)]
    on_gpu = [it for it in items if it[2].n_gpu_layers < 0]
    on_host = [it for it in items if it[2].n_gpu_layers >= 0]
    with tempfile.TemporaryDirectory(prefix="flux-floor-") as d:
        if on_gpu and on_host:
            with ThreadPoolExecutor(max_workers=2, thread_name_prefix="flux-floor") as pool:
                for f in [pool.submit(lane, on_gpu, Path(d)), pool.submit(lane, on_host, Path(d))]:
                    f.result()
        else:
            lane(items, Path(d))
    out = [found[i] for i in sorted(found)]
    if cache is not None:
        cache.directory.mkdir(parents=True, exist_ok=True)
        cache.floor().write_text(json.dumps([f.model_dump() for f in out]))
    return out


def _held_out_speeds(timings: Sequence[ops.Timing]) -> tuple[float | None, float | None]:
    """(prefill, decode) tokens/s over the held-out prompts' timed runs."""
    if not timings:
        return None, None
    pre = sum(t.prompt_tokens for t in timings) / max(1e-9, sum(t.prompt_ms for t in timings)) * 1e3
    dec = sum(t.gen_tokens for t in timings) / max(1e-9, sum(t.gen_ms for t in timings)) * 1e3
    return pre, dec


def scored_positions(ref: list[np.ndarray], cand: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The positions a candidate has rows for: an engine reports no logprobs for some tokens (NaN rows)."""
    keep = [~np.isnan(c).any(axis=1) for c in cand]
    return [r[k] for r, k in zip(ref, keep, strict=True)], [c[k] for c, k in zip(cand, keep, strict=True)]


def scored_path(directory: Path, cand_id: str) -> Path:
    """Where a finalist's scores of the reference's continuations are kept (written while it was measured); a
    drafting candidate (``c3+draft``) has its placement's: drafted greedy output is the model's."""
    return directory / f"{cand_id.split('+', 1)[0]}.npz"


def score_loaded(w: WorkerClient, cand_id: str, seqs: Seqs, held_out: list[list[int]], directory: Path,
                 timeout_s: float) -> None:
    """Score the reference's continuations on a loaded finalist and time the held-out prompts, for validation
    without a load of its own (the measure stage calls it in a finalist's first visit)."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="flux-score-", dir=directory) as d:
        lps = _logprobs(w, seqs, Path(d), cand_id, timeout_s)
    timings = [w.request(ops.TIMED_RUN, ops.TimedRunArgs(prompt=p, n_gen=16), timeout_s) for p in held_out]
    pre, dec = _held_out_speeds(timings)
    arrays: dict[str, np.ndarray] = {f"lp{i}": lp for i, lp in enumerate(lps)}
    arrays["held_out"] = np.asarray([pre or np.nan, dec or np.nan], dtype=np.float64)
    part = directory / f".{cand_id}.{os.getpid()}.partial.npz"
    np.savez(part, **arrays)  # type: ignore[arg-type]
    os.replace(part, scored_path(directory, cand_id))


def _from_measurement(path: Path, n: int) -> tuple[list[np.ndarray], float | None, float | None]:
    with np.load(path) as z:
        pre, dec = (float(x) for x in z["held_out"])
        return [z[f"lp{i}"] for i in range(n)], None if np.isnan(pre) else pre, None if np.isnan(dec) else dec


def _candidate(cand: Candidate, model: Path, seqs: Seqs, held_out: list[list[int]], tmp: Path, log_path: Path,
               timeout_s: float) -> tuple[list[np.ndarray], float | None, float | None]:
    with WorkerClient(log_path=log_path, env=cand.params.environment()) as w:
        w.request(ops.LOAD, ops.LoadArgs(model=str(model), params=cand.params), timeout_s)
        lps = _logprobs(w, seqs, tmp, cand.id, timeout_s)
        timings = [w.request(ops.TIMED_RUN, ops.TimedRunArgs(prompt=p, n_gen=16), timeout_s) for p in held_out]
    pre, dec = _held_out_speeds(timings)
    return lps, pre, dec


def validate(ranked: list[Candidate], model: Path, prompts: list[list[int]], held_out: list[list[int]], *,
             n_tokens: int, gate: Gate, quality_profile: str, log_path: Path, timeout_s: float,
             reference: EngineParams, floor_variants: Sequence[tuple[str, EngineParams]] = (),
             cache: Cache | None = None, progress: Progress = log.info, generator: EngineParams | None = None,
             scored_dir: Path | None = None) -> ValidationReport:
    """Check the two fastest measured finalists against the reference; the faster one that passes wins.

    When neither passes, the next finalists are checked in order until one does: a plan is the fastest
    finalist that matches the reference, not an error while a slower match exists.

    Args:
        ranked: finalists ordered fastest first (:func:`rank_measured`; failed ones excluded).
        prompts: validation prompts (held-out prompts + agent conversations), already tokenized.
        held_out: held-out prompts timed again on the checked candidates.
        reference: the reference's parameters (:func:`reference_params`).
        floor_variants: named correct variants of the reference whose differences are the noise floor.
        cache: where the reference and the floor are kept between plans (:mod:`tasks.validation.outputs` fills it first).
        generator: where the greedy continuations are written when the reference is not cached.
        scored_dir: where the measure stage kept finalists' scores of the continuations (no load needed).
    """
    results: list[ValidationResult] = []
    seqs, ref = reference_continuations(model, reference, prompts, n_tokens, log_path, timeout_s, cache, generator)
    floor = floor_results(model, floor_variants, seqs, ref, log_path, timeout_s, cache, progress)
    kl_limit, top1_limit = gate.limits(floor)
    with tempfile.TemporaryDirectory(prefix="flux-validate-") as d:
        tmp = Path(d)
        for i, cand in enumerate(ranked):
            if i >= 2 and any(r.passed for r in results):
                break
            kept = scored_path(scored_dir, cand.id) if scored_dir is not None else None
            try:
                if kept is not None and kept.exists():
                    lps, pre, dec = _from_measurement(kept, len(seqs))
                elif cand.engine != "native":
                    raise EngineError("validation_failed", f"{cand.id}: not scored while it was measured on "
                                                           f"{cand.engine}")
                else:
                    lps, pre, dec = _candidate(cand, model, seqs, held_out, tmp, log_path, timeout_s)
            except EngineError as exc:
                progress(f"validate: {cand.id} failed: {exc}")
                results.append(ValidationResult(candidate_id=cand.id, mean_kl=UNSCORED_KL, max_kl=UNSCORED_KL,
                                                top1_agreement=0.0, n_tokens=0, passed=False, reason=str(exc)))
                continue
            stats = compare_all(*scored_positions(ref, lps))
            ok, why = gate.verdict(stats, floor)
            if quality_profile != "reference":
                ok, why = True, f"{why}; recorded, not enforced (quality profile {quality_profile})"
            results.append(ValidationResult(candidate_id=cand.id, mean_kl=stats.mean_kl, max_kl=stats.max_kl,
                                            p90_kl=stats.p90_kl, top1_agreement=stats.top1, n_tokens=stats.n,
                                            passed=ok, reason=why, held_out_prefill_tps=pre,
                                            held_out_decode_tps=dec))
            progress(f"validate: {cand.id} ({cand.family}) {why} over {stats.n} tokens -> {'pass' if ok else 'FAIL'}")
    winner = next((r.candidate_id for r in results if r.passed), None)
    if winner is None:
        raise EngineError("validation_failed",
                          f"none of the {len(results)} measured finalists matches the reference placement's outputs "
                          f"({', '.join(f'{r.candidate_id}: KL {r.mean_kl:.2e}, top-1 {r.top1_agreement:.2f}' for r in results)}; "
                          f"limits: mean KL {kl_limit:.2e}, top-1 {top1_limit:.3f}); "
                          "run `flux plan --replan` or ask for a quality profile such as --kv q8_0")
    return ValidationReport(results=results, winner_id=winner, quality_profile=quality_profile, reference=reference,
                            floor=floor, kl_limit=kl_limit, top1_limit=top1_limit)
