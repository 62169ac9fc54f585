"""Load the GPU tests' tiny twins on CUDA0, experts on the host, once per host layout, each in a fresh process
(a diagnosis: on the H200 the first load inside pytest died with SIGSEGV while the worker's loads did not).

    python3 scripts/gpu_load_check.py OUT_DIR

Prints one line per (twin, layout): the exit status of the load (-11 = SIGSEGV) and the log's last line. The
first load that dies is run once more under cuda-gdb where the machine has it (OUT_DIR/gdb-TWIN.log: the native
backtrace of the crashing thread and the frames of every thread), and its innermost frames are printed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

CHILD = """
import sys
from pathlib import Path
from artifacts.synth import synthesize
from artifacts.engine_params import EngineParams, TensorOverride
from engine_bridge.worker.native import NativeModel
path = Path(sys.argv[1])
if not path.exists():
    synthesize(sys.argv[3], path, quant="Q4_0")
p = EngineParams(n_ctx=256, n_batch=16, n_ubatch=16, n_gpu_layers=99, flash_attn=True, repack=sys.argv[2] == "1",
                 tensor_overrides=(TensorOverride(pattern=r"\\.ffn_(gate|up|down)_exps\\.", device="CPU"),))
m = NativeModel(path, p)
print("logprobs", m.logprobs([1, 2, 3, 4], [5, 6]).shape)
m.close()
"""


def backtrace(out: Path, args: list[str], twin: str) -> None:
    """Run the crashing load under cuda-gdb: where the SIGSEGV lands, natively."""
    gdb = shutil.which("cuda-gdb")
    if gdb is None:
        return
    cmd = [gdb, "-batch", "-ex", "set pagination off", "-ex", "set confirm off", "-ex", "run", "-ex", "bt 30",
           "-ex", "info threads", "-ex", "thread apply all bt 8", "--args", sys.executable, *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    except subprocess.TimeoutExpired:
        sys.stdout.write(f"{twin}: cuda-gdb ran past 240 s\n")
        return
    log = out / f"gdb-{twin}.log"
    log.write_text(proc.stdout + proc.stderr)
    frames = [ln for ln in proc.stdout.splitlines() if ln.startswith("#")][:12]
    sys.stdout.write(f"{twin} under cuda-gdb ({log}):\n" + "\n".join(f"  {f[:200]}" for f in frames) + "\n")


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    traced = False
    for twin in ("tiny-moe", "qwen3moe-small"):
        for repack in ("1", "0"):
            args = ["-X", "faulthandler", "-c", CHILD, str(out / f"{twin}.gguf"), repack, twin]
            proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, check=False)
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
            sys.stdout.write(f"{twin} repack={repack}: rc={proc.returncode} {tail[0][:160]}\n")
            sys.stdout.flush()
            if proc.returncode < 0 and not traced:
                traced = True
                backtrace(out, args, twin)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
