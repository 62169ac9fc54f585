"""``python -m engine_bridge.worker``: serve the protocol on stdin/stdout until EOF or shutdown."""

# ruff: noqa: I001  (llama_cpp is imported first on purpose: see engine_bridge.worker.process)
import llama_cpp  # noqa: F401
import sys

from engine_bridge.worker.process import main

sys.exit(main())
