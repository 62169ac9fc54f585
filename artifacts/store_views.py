"""The store's named SQL views: what `flux sql`, notebooks and scripts query by name.

Every table kind is a view of its own (its Parquet files unioned by column name); these add rows for the
JSON objects people ask about, and the planner's trials joined to the plan they chose.
"""

from __future__ import annotations

# Views a person (or a notebook) queries by name: every plan and probe as a row, and the planner's trials with
# the plan they chose (a trials table is keyed by the id its plan records: ``plans.trials_table``).
FILENAME_KINDS = {"trials"}
NAMED_VIEWS: dict[str, tuple[tuple[str, ...], str]] = {
    "plans": (("plan",), """
        SELECT id AS plan_id, created_at, model_name, model_hash, model_path, backend_build, hardware_fingerprint,
               driver, quality_profile, trials_table, candidate.id AS candidate_id, candidate.family AS family,
               candidate.params.n_ctx AS ctx, request.kv AS kv, request.workload AS workload,
               request.gpu_mem_budget_gib AS gpu_mem_budget_gib, measured.prefill_tps AS prefill_tps,
               measured.decode_tps AS decode_tps, measured.workload_s AS workload_s,
               validation.mean_kl AS mean_kl, validation.top1_agreement AS top1
        FROM read_json_auto('{plan}', union_by_name = true)"""),
    "probes": (("probe",), """
        SELECT fingerprint, cpu.model AS cpu, cpu.physical_cores AS cores, ram_total, ram_read_gbs,
               storage_read_gbs, len(gpus) AS gpus, driver, model_hash, backend_build
        FROM read_json_auto('{probe}', union_by_name = true)"""),
    "plan_trials": (("plan", "trials"), """
        SELECT p.plan_id, p.model_name AS model, p.candidate_id = t.candidate_id AS chosen, t.* EXCLUDE (filename)
        FROM trials t JOIN plans p ON p.trials_table = regexp_extract(t.filename, '([^/]+)\\.parquet$', 1)"""),
}
