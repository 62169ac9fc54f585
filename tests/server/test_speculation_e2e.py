"""Speculation end to end on the CPU: `flux plan --speculation --draft-model` on a twin and its draft twin (the
Prefect flow and its store) measures drafting candidates (a draft model, prompt lookup) beside the finalists in
the same rounds, records their acceptance and speedup, and `flux show` prints them; `flux serve` of the plan
answers greedy requests with the tokens plain greedy decoding gives (the worker's own greedy op); a draft of
another vocabulary, and --draft-model without --speculation, are one line, exit 2, no plan saved."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from support import ServeEnv, serve_env, start_server, stop_server

from artifacts.records.kinds import PLAN
from artifacts.records.plan import Plan
from artifacts.records.store import Records
from artifacts.synth import synthesize
from artifacts.synth.draft import draft_twin
from engine_bridge import ops
from engine_bridge.client import WorkerClient
from tasks.bench.spec_facts import speculation_facts

REPO = Path(__file__).resolve().parents[2]


def _flux(env: ServeEnv, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flows", *args], env=env.env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _env(root: Path) -> ServeEnv:
    env = serve_env(root, "[serve]\nmin_reply = 16\nqueue_wait_s = 30.0\n")
    (root / "cache" / "flux").mkdir(parents=True, exist_ok=True)
    if not (root / "cache" / "flux" / "backend").exists():
        (root / "cache" / "flux" / "backend").symlink_to(Path.home() / ".cache" / "flux" / "backend")
    return env


def test_a_plan_measures_drafting_and_serves_it(tmp_path: Path, tiny_moe: Path) -> None:
    env = _env(tmp_path)
    draft = draft_twin(tiny_moe, tmp_path / "draft.gguf", 1).path
    planned = _flux(env, "plan", str(tiny_moe), "--ctx", "512", "--speculation", "--draft-model", str(draft),
                    "--budget-s", "300")
    assert planned.returncode == 0, planned.stderr[-4000:]
    plan_id = planned.stdout.strip().splitlines()[-1]
    plan = json.loads(_flux(env, "show", plan_id[:12], "--json").stdout)
    measured = {s["candidate_id"]: s for s in plan["finalists"] if s["workload_s"]}
    assert any(c.endswith("+draft") for c in measured) and any(c.endswith("+ngram") for c in measured), measured
    trials = {t["candidate_id"]: t for t in plan["speculation"]}
    assert trials and all(t["base_id"] in measured for t in trials.values())
    assert all(t["acceptance"] is not None and 0.0 <= t["acceptance"] <= 1.0 and t["speedup"] > 0
               for t in trials.values()), (trials, measured)
    assert any(n.startswith("speculation ") for n in plan["notes"]), plan["notes"]
    # the GPU record's row of this plan (flux bench record, a `+draftK` pair): its drafting and its best trial
    facts = speculation_facts(Plan.model_validate(plan))
    best = max(trials.values(), key=lambda t: t["speedup"])
    assert facts["spec_trials"] == len(trials) and facts["spec_candidate"] == best["candidate_id"]
    assert facts["spec_speedup"] == best["speedup"] and facts["spec_acceptance"] == best["acceptance"]
    assert facts["plan_draft"] == (plan["candidate"].get("draft") or {}).get("kind")
    shown = _flux(env, "show", plan_id[:12]).stdout
    assert "acceptance" in shown and "speedup" in shown, shown[-3000:]

    # serve the plan with drafting forced on (whichever candidate won, the twin's pair drafts in serving too)
    winner = plan["candidate"]
    prompts = ["The quick brown fox", "def add(a, b):\n    return a + b\n\ndef add(a, b):"]
    with WorkerClient() as w:
        w.request(ops.LOAD, ops.LoadArgs(model=str(tiny_moe), params=winner["params"]))
        plain = [w.request(ops.GREEDY, ops.GreedyArgs(
            prompt=w.request(ops.TOKENIZE, ops.TokenizeArgs(text=p)).tokens, n_gen=24, stop_eog=True)).tokens
            for p in prompts]
    server = start_server(env, plan_id)
    try:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none")
        model = client.models.list().data[0].id
        for p, want in zip(prompts, plain, strict=True):
            got = client.completions.create(model=model, prompt=p, max_tokens=24, temperature=0, logprobs=1)
            toks = got.choices[0].logprobs.tokens if got.choices[0].logprobs else None
            assert got.usage and got.usage.completion_tokens == len(want), (got, want)
            assert toks is not None and len(toks) == len(want)
        stats = server.stats()["worker"]["serve_stats"]
        if (winner.get("draft") or {}).get("kind") == "model":  # the draft twin proposes at every step
            assert stats["drafted"] > 0 and stats["draft_accepted"] > 0, stats
        elif winner.get("draft"):  # prompt lookup proposes only where the text repeats itself, which these short
            # replies need not do (its serving is tested on repeating text: tests/engine_bridge/test_serve_draft.py)
            assert stats["drafted"] >= stats["draft_accepted"] >= 0, stats
        sampled = client.completions.create(model=model, prompt="abc", max_tokens=8, temperature=0.9)
        assert sampled.choices[0].text is not None
    finally:
        stop_server(server)


@pytest.mark.parametrize("case", ["vocab", "no-speculation"])
def test_bad_draft_input_is_one_line_exit_2_and_no_plan(tmp_path: Path, tiny_moe: Path, case: str) -> None:
    env = _env(tmp_path)
    if case == "vocab":
        other = synthesize("tiny-dense", tmp_path / "o.gguf", quant="Q4_0", overrides={"n_vocab": "640"}).path
        args, says = ("--speculation", "--draft-model", str(other)), "a draft must share the model's tokenizer"
    else:
        draft = draft_twin(tiny_moe, tmp_path / "d.gguf", 1).path
        args, says = ("--draft-model", str(draft)), "drafting is measured with --speculation"
    out = _flux(env, "plan", str(tiny_moe), *args, "--budget-s", "5", timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not Records.at(env.settings.data_dir).all(PLAN), "a refused request saved a plan"


def test_a_plan_on_llama_server_measures_the_models_next_token_head(tmp_path: Path) -> None:
    """`flux plan --speculation --engines native,llama-server` of a qwen35moe twin with its next-token (MTP)
    block: the best llama-server placement is also measured drafting with the block (`+mtp`), its proposals
    counted from llama-server's timings, beside the same placement without it; the note that says the block
    was not measured is absent."""
    env = _env(tmp_path)
    model = synthesize("tiny-qwen35moe", tmp_path / "mtp.gguf", overrides={"n_mtp": "1"}).path
    planned = _flux(env, "plan", str(model), "--ctx", "512", "--speculation", "--engines", "native,llama-server",
                    "--budget-s", "300")
    assert planned.returncode == 0, planned.stderr[-4000:]
    plan = json.loads(_flux(env, "show", planned.stdout.strip().splitlines()[-1][:12], "--json").stdout)
    trials = {t["candidate_id"]: t for t in plan["speculation"] if t["kind"] == "mtp"}
    assert len(trials) == 1, plan["speculation"]
    (cid, trial), = trials.items()
    assert cid.endswith("@llama-server+mtp") and trial["base_id"] == cid.removesuffix("+mtp")
    assert trial["acceptance"] is not None and trial["acceptance"] >= 0.9 and trial["speedup"] > 0, trial
    assert not any("next-token (MTP)" in n for n in plan["notes"]), plan["notes"]


def test_a_plan_on_two_engines_measures_drafting_on_both(tmp_path: Path, tiny_moe: Path) -> None:
    """`flux plan --speculation --draft-model D --engines native,llama-server`: the best placement of each
    engine is also measured drafting with the draft model and with prompt lookup (on llama-server, the pin's
    own drafters: `--spec-type draft-simple`, `ngram-simple`), each beside its placement in the same rounds,
    llama-server's proposals and kept tokens read from its timings."""
    env = _env(tmp_path)
    draft = draft_twin(tiny_moe, tmp_path / "draft.gguf", 1).path
    planned = _flux(env, "plan", str(tiny_moe), "--ctx", "512", "--speculation", "--draft-model", str(draft),
                    "--engines", "native,llama-server", "--budget-s", "300")
    assert planned.returncode == 0, planned.stderr[-4000:]
    plan = json.loads(_flux(env, "show", planned.stdout.strip().splitlines()[-1][:12], "--json").stdout)
    trials = {t["candidate_id"]: t for t in plan["speculation"]}
    kinds = {(cid.split("+")[0].partition("@")[2] or "native", t["kind"]) for cid, t in trials.items()}
    assert kinds == {(e, k) for e in ("native", "llama-server") for k in ("model", "ngram")}, sorted(trials)
    served = next(t for cid, t in trials.items() if cid.endswith("@llama-server+draft"))
    assert served["base_id"].endswith("@llama-server") and served["speedup"] > 0, served
    assert served["acceptance"] is not None and served["acceptance"] > 0.5, served  # the 1-layer draft agrees
    measured = {s["candidate_id"]: s for s in plan["finalists"]}
    assert measured[served["candidate_id"]]["drafted"] > 0, measured[served["candidate_id"]]


def test_a_plan_grafts_next_token_heads_onto_a_model_without_them(tmp_path: Path) -> None:
    """`flux plan --speculation --heads H --engines native,llama-server` of a qwen35moe twin converted without
    its block, H its block alone (`flux synth --heads-of`): the best llama-server placement drafts with the
    grafted heads (`+mtp`), keeping what the block proposes; `flux show` names the file; its hash is in the key."""
    from artifacts.synth.heads import heads_of

    env = _env(tmp_path)
    trunk = synthesize("tiny-qwen35moe", tmp_path / "trunk.gguf").path
    heads = heads_of(synthesize("tiny-qwen35moe", tmp_path / "mtp.gguf", overrides={"n_mtp": "1"}).path,
                     tmp_path / "heads.gguf").path
    planned = _flux(env, "plan", str(trunk), "--ctx", "512", "--speculation", "--heads", str(heads),
                    "--engines", "native,llama-server", "--budget-s", "300")
    assert planned.returncode == 0, planned.stderr[-4000:]
    plan_id = planned.stdout.strip().splitlines()[-1]
    plan = json.loads(_flux(env, "show", plan_id[:12], "--json").stdout)
    (trial,) = [t for t in plan["speculation"] if t["kind"] == "mtp"]
    assert trial["candidate_id"].endswith("@llama-server+mtp"), plan["speculation"]
    assert trial["acceptance"] is not None and trial["acceptance"] >= 0.9 and trial["speedup"] > 0, trial
    stored = Plan.model_validate(plan)
    assert stored.key.get("heads_hash"), stored.key
    if stored.candidate.draft is not None and stored.candidate.draft.kind == "mtp":
        assert "grafted from" in _flux(env, "show", plan_id[:12]).stdout


@pytest.mark.parametrize("case", ["no-speculation", "no-llama-server", "own-heads", "other-model"])
def test_heads_that_cannot_draft_are_one_line_exit_2_and_no_plan(tmp_path: Path, tiny_moe: Path, case: str) -> None:
    from artifacts.synth.heads import heads_of

    env = _env(tmp_path)
    trunk = synthesize("tiny-qwen35moe", tmp_path / "trunk.gguf").path
    mtp = synthesize("tiny-qwen35moe", tmp_path / "mtp.gguf", overrides={"n_mtp": "1"}).path
    heads = heads_of(mtp, tmp_path / "heads.gguf").path
    model, args, says = {
        "no-speculation": (trunk, ("--heads", str(heads), "--engines", "native,llama-server"), "add it"),
        "no-llama-server": (trunk, ("--speculation", "--heads", str(heads)), "--engines native,llama-server"),
        "own-heads": (mtp, ("--speculation", "--heads", str(heads), "--engines", "native,llama-server"),
                      "the model has its own next-token block"),
        "other-model": (tiny_moe, ("--speculation", "--heads", str(heads), "--engines", "native,llama-server"),
                        "its architecture is qwen35moe, the model's qwen3moe"),
    }[case]
    out = _flux(env, "plan", str(model), *args, "--budget-s", "5", timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not Records.at(env.settings.data_dir).all(PLAN), "a refused request saved a plan"
