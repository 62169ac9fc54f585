"""The engine worker's side of the process boundary: every module here runs inside the worker process.

``python -m engine_bridge.worker`` (:mod:`engine_bridge.client` spawns it) is the only process that links
llama.cpp. No module outside this package imports it: clients speak the typed protocol of
:mod:`engine_bridge.ops`. :mod:`.process` reads requests and runs the loop, :mod:`.state` holds what the
process has loaded, :mod:`.handlers` answers each op,
:mod:`.load` is the one translation of :class:`~artifacts.engine_params.EngineParams` into llama.cpp's model and
context parameters, :mod:`.native` measures one model, :mod:`.serving` is the batched serving engine (with
:mod:`.sampling`, :mod:`.grammar` and :mod:`.parking`), and :mod:`.routing` records routing traces.
"""
