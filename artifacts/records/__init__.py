"""Records: what outlives a planning run, shared by the planner (``tasks/``, ``flows/``) and the server.

- the stored models, one module per role: :mod:`.hardware` (the probe report and the machine facts it is keyed
  by), :mod:`.search` (placements, candidates, finalists), :mod:`.evidence` (measurements and validation),
  :mod:`.plan` (the request and the immutable plan), :mod:`.routing` (a routing profile);
- :mod:`.keys`: the ids and keys records are found by (hardware fingerprint, probe key, plan key, plan id);
- :mod:`.kinds`: one declaration per stored kind (name -> model), and :mod:`.store`: the typed store over them
  (``put``, ``get``, ``find_by_prefix``);
- :mod:`.fit`: what a plan holds on a device, and the expert copies dropped to fit the memory free now.

Nothing here imports ``tasks``, ``flows`` or ``server``: they all import it. Records hold data: reading this
machine's facts (``/proc``, NVML) is :mod:`engine_bridge.machine_facts`.
"""
