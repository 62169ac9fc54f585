"""Flux's benchmark suites: evidence for a saved plan, each suite one module.

Every suite module declares itself once, as ``SUITE`` (:class:`tasks.bench.registry.Suite`: name, help,
options model, run function, which options are flags); ``flux bench`` builds its subcommands and their flags
from those declarations (:func:`tasks.bench.registry.suites`). Shared parts: ``common`` (the plan under test,
statistics, engines, storage), ``http`` (``flux serve`` as a client sees it), ``served`` (the served GPU race
of ``run --via serve``), and the helpers of the soak, arrivals and conformance suites.
"""
