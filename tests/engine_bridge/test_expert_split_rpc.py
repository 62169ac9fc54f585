"""The expert split across two backends on a CPU-only machine: the hot copies on a llama.cpp RPC device (a real
`flux rpc-server` on 127.0.0.1, its CPU backend), the full expert tensors on this host. The scheduler then makes
the split's own splits (host part, device part) as it does with a GPU, so the idle-host-part skip of patch 0004
runs here: a decode step whose picks of a layer are all hot skips that layer's host part (zeroing its output)
and the logits stay bit for bit those of the same split without the skip (``FLUX_MOE_SKIP_IDLE=0``), and those
of no split at all up to the kernels' rounding. Each run is its own process: an RPC server serves one client at a time, for the client's life.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from engine_bridge import rpc

pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")
REPO = Path(__file__).resolve().parents[2]
SKIPPED = re.compile(r"flux-moe-host-profile: .* skipped_splits=([\d.]+)")

RUN = """
import json, sys
import numpy as np
from pathlib import Path
from artifacts.engine_params import EngineParams, ExpertSplit, TensorOverride
from engine_bridge.worker.native import NativeModel
model, endpoint, mode, out = sys.argv[1:5]
# 6 of the 8 experts of each layer hot on the RPC device: with 2 picks per token, about half the steps of a
# layer have no cold pick
split = ExpertSplit.on("RPC0", {il: [0, 1, 2, 3, 4, 5] for il in range(4)})
common = dict(n_ctx=256, n_batch=64, n_ubatch=1, n_gpu_layers=99, n_threads=1, n_threads_batch=1,
              rpc_servers=(endpoint,))
if mode == "unsplit":
    p = EngineParams(**common, tensor_overrides=(TensorOverride(pattern=r"\\.ffn_(gate|up|down)_exps\\.", device="CPU"),))
else:
    p = EngineParams(**common, tensor_overrides=(split.host_override(),), expert_split=split)
m = NativeModel(Path(model), p)
rng = np.random.default_rng(0)
np.save(out, m.logprobs(rng.integers(0, 500, size=8).tolist(), rng.integers(0, 500, size=40).tolist()))
m.close()
"""


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    from artifacts.config import load_settings
    from flows.commands.rpc import rpc_server_path

    try:
        rpc_server_path(load_settings().cache_dir)
    except Exception as exc:  # noqa: BLE001 - a build without rpc-server
        pytest.skip(str(exc))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "flows", "rpc-server", "--port", str(port), "--threads", "1"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ep = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not rpc.reachable(ep) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    yield ep
    proc.terminate()
    proc.wait(timeout=10)


def _run(model: Path, ep: str, mode: str, tmp: Path, skip: str = "1") -> tuple[np.ndarray, float]:
    out = tmp / f"{mode}-{skip}.npy"
    env = {**os.environ, "FLUX_MOE_SKIP_IDLE": skip, "FLUX_MOE_HOST_PROFILE": "8",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", RUN, str(model), ep, mode, str(out)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    skipped = [float(x) for x in SKIPPED.findall(proc.stderr)]
    return np.load(out), (max(skipped) if skipped else 0.0)


def test_idle_host_parts_are_skipped_and_the_logits_do_not_move(tiny_moe: Path, endpoint: str, tmp_path: Path) -> None:
    skipping, n_skipped = _run(tiny_moe, endpoint, "split", tmp_path)
    running, n_run = _run(tiny_moe, endpoint, "split", tmp_path, skip="0")
    unsplit, _ = _run(tiny_moe, endpoint, "unsplit", tmp_path)
    assert n_skipped > 0, "no layer's host part was ever skipped"
    assert n_run == 0, "FLUX_MOE_SKIP_IDLE=0 still skipped"
    assert np.array_equal(skipping, running), f"max |diff| {np.abs(skipping - running).max()}"
    # against no split: the hot picks run on the server's plain layout, the unsplit experts on this host's
    # repacked one (other kernels, so rounding differs in the last digits, as any other placement does)
    assert np.abs(skipping - unsplit).max() < 1e-4, f"split vs unsplit: max |diff| {np.abs(skipping - unsplit).max()}"
