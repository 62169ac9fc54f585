"""Search stages: the memory-feasible placements (``enumerate``) and the cost model's finalists (``prune``).
Each module declares one :class:`tasks.stage.Stage`; the work itself lives in ``tasks.search.space`` (with
``layer_split``, ``expert_*``, ``gpu_memory``), ``tasks.costmodel`` and ``tasks.search.ranking``. A new search dimension
is a field of the placement space (``tasks.search.space``) and of the cost model, not a new stage."""
