"""Flux's planning stages and benchmark suites, as plain functions the Prefect flow composes.

One module per stage: ``probe`` (with ``probe_host``, ``probe_gpu``), ``route`` (routing traces),
``enumerate`` (with ``layer_split``, ``expert_select``, ``expert_hot``), ``costmodel`` and ``prune``,
``measure``, ``validate`` (with ``quality_gate``), ``persist``; the nouns every stage passes on (PlanRequest,
Candidate, Plan, ...) are records (:mod:`artifacts.records`), shared with the server; ``corpus`` holds the bundled
prompts and conversations. ``tasks.bench`` holds one module per ``flux bench`` suite. Nothing here imports
``flows``: the flow (flows/plan_model.py) and the CLI compose these.
"""
