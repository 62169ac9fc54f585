"""Flux's planning stages and benchmark suites, as plain functions the Prefect flow composes.

Each stage is declared once (:class:`tasks.stage.Stage`) in a role package: ``probing`` (probe, route),
``search`` (enumerate, prune), ``measurement`` (measure), ``validation`` (reference, validate), ``recording``
(persist); :mod:`tasks.pipeline` lists them in order. Their work lives in the flat modules: ``probe`` (with
``probe_host``, ``probe_gpu``), ``route`` (routing traces), ``enumerate`` (with ``layer_split``,
``expert_select``, ``expert_hot``, ``gpu_memory``), ``costmodel`` and ``prune``, ``measure``, ``reference``,
``validate`` (with ``quality_gate``), ``persist``; ``workload`` sizes the prompts to the budget and context and
``clock`` times the stages. The nouns every stage passes on (PlanRequest, Candidate, Plan, ...) are records
(:mod:`artifacts.records`), shared with the server; ``corpus`` holds the bundled prompts and conversations.
``tasks.bench`` holds the benchmarks beside the planner, one module per ``flux bench`` suite (the GPU record's
``flux bench record`` among them); no stage imports it. Nothing here imports ``flows``: the flow
(flows/plan_model.py) and the CLI compose these.
"""
