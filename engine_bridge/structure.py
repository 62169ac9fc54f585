"""Does llama.cpp's loader accept a model's tensors and hyperparameters? Asked before anything is planned.

A GGUF of a supported architecture with a tensor missing or mis-shaped, or a hyperparameter missing or out of
range, reads fine from its header and fails only when llama.cpp builds the model. A load that allocates and
reads no weights (``no_alloc``) runs every one of those checks in milliseconds, in a worker process (a file bad
enough to trip an assertion ends the worker, not Flux), so the refusal names the tensor or field.
"""

from __future__ import annotations

import logging
from pathlib import Path

from artifacts.errors import ModelFileError
from engine_bridge import ops
from engine_bridge.client import WorkerClient
from engine_bridge.errors import EngineError

log = logging.getLogger(__name__)
CHECK_TIMEOUT_S = 120.0
REMEDY = ("a file converted by llama.cpp's convert_hf_to_gguf.py (or written by `flux synth`) has every tensor and "
          "field its architecture needs: convert or download it again")


def check_structure(path: Path, log_path: Path, timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """Refuse a model whose structure llama.cpp's loader refuses. A check that could not run for another reason
    (its worker did not start or answer, or died without an assertion of the loader) refuses nothing: it is
    logged, and the loads that follow meet the file as they would have.

    Raises:
        ModelFileError: in one line, the loader's reason (the tensor or field) and what to do.
    """
    try:
        with WorkerClient(log_path=log_path) as w:
            got = w.request(ops.CHECK_STRUCTURE, ops.StructureArgs(model=str(path)), timeout_s)
    except EngineError as exc:
        last = exc.message.split(": ", 1)[1] if ": " in exc.message else ""
        if exc.code == "worker_died" and "GGML_ASSERT" in last:
            raise ModelFileError(path, f"llama.cpp stopped reading its tensors and hyperparameters ({last}); "
                                       f"{REMEDY}") from exc
        log.warning("%s: the check of its tensors and hyperparameters did not run (%s); going on without it",
                    path, exc)
        return
    if got.problem:
        raise ModelFileError(path, f"llama.cpp cannot load it: {' '.join(got.problem.split())}; {REMEDY}")
