"""Flux's benchmarks, beside the planner: evidence for a saved plan (or, for ``synth``, for a part a plan is not
needed for; for ``record``, the GPU record of many plans), each suite one module.

Every suite module declares itself once, as ``SUITE`` (:class:`tasks.bench.registry.Suite`: name, help,
options model, run function, which options are flags); ``flux bench`` builds its subcommands and their flags
from those declarations (:func:`tasks.bench.registry.suites`). Only ``flows/`` (the CLI and its reports) imports
this package; no planning stage does (tests/layout/test_layering.py). Shared parts, by role: ``context`` (the plan
under test, or the machine alone), ``stats`` (paired ratios and their intervals), ``host`` (the machine's load while timing),
``record`` (runs, and how they land in the store), ``engines`` (engines a race restarts every round, the
baselines' parameters), ``errors``, ``http`` (``flux serve`` as a client sees it), ``inprocess``
(llama-cpp-python's in-process baseline), ``served`` (the served GPU race of ``run --via serve``), the helpers
of the soak, arrivals, conformance, serve and ttft suites, and the GPU record's (``flux bench record``,
``gpu_record``): its pairs (``gpu_pairs``), the ``flux`` commands it drives (``gpu_commands``), its rows
(``gpu_rows``, with ``spec_facts``, ``step_facts``, ``host_state``, ``standing``) and files (``gpu_files``).
"""
