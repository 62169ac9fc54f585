"""Engines other than the native worker, and the seam that puts them behind the worker protocol.

``spec.py``: how the engine a plan records (:class:`artifacts.engine_spec.EngineSpec`) is started (a command
template with ``{port}``, ``{model}`` and ``{ctx}``); ``registry.py``: the engines a name can mean (``native``,
``llama-server``, a configured ``[engines.NAME]``); ``process.py``: one engine process on a loopback port;
``stream.py``: the one OpenAI client every engine is timed and scored through; ``host.py`` (``python -m
engine_bridge.engines``): a process that speaks the worker's protocol (``serve_load``, ``generate``, ...) and
serves it through an engine, so the server supervises an engine exactly as it supervises a worker.
"""
