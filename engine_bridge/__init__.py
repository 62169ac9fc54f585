"""Flux's bridge to llama.cpp: the worker process, its typed protocol, and the engines Flux races.

The client side (imported by planning, benchmarks and the server; none of it imports llama_cpp):
``ops`` (every worker op's argument and result models, declared once), ``protocol`` (the JSON-lines
format), ``client`` / ``aclient`` (a worker subprocess driven synchronously / from asyncio, with typed
``request``), ``expert_split``, ``routing_trace``, ``gbnf`` (grammars), ``llama_server`` (llama.cpp's own server, a
baseline), ``gpumem``, ``backend`` (the build id), ``machine_facts`` and ``gpu_inventory`` (this machine's CPU,
GPUs and driver, read from ``/proc`` and NVML), ``sampling`` (one request's sampling). The worker side,
``engine_bridge.worker``, runs only inside the worker process (``python -m engine_bridge.worker``) and is the only
importer of llama_cpp. The data it is driven by (``EngineParams``, the patches' switches, ``Drafting``,
``EngineSpec``) is declared in ``artifacts``, beside the records that hold it.
"""
