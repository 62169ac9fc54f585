"""A real `flux plan` under a host budget below the twin (issue 54 item 5): refused with its decode limit from the
drive without --allow-storage-streaming; with it, measured like any plan, and `flux show` prints the limit beside the
measured decode. The budget is Flux's own (--host-mem-budget): the twin still sits in the page cache here, so the
measured decode may pass the drive's limit; the limit is what the drive would allow once RAM is that small."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from artifacts.model_info import model_info
from artifacts.records.kinds import PLAN, PROBE
from artifacts.records.store import Records

REPO = Path(__file__).resolve().parents[2]
BUDGET_GIB = 0.07  # 75 MB: the slow twin's 69 MB of weights do not fit beside its KV cache and compute buffers


def test_a_plan_beyond_the_host_budget_is_refused_then_measured_with_streaming(slow_model: Path, tmp_path: Path) -> None:
    info = model_info(slow_model)
    assert info.weight_bytes < BUDGET_GIB * 2**30 < info.weight_bytes + 25 * 2**20
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLUX_", "XDG_DATA", "XDG_CONFIG"))}
    env.update({"XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CONFIG_HOME": str(tmp_path / "config"),
                "PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONPATH": str(REPO)})

    def flux(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "flows", *args], env=env, cwd=REPO, capture_output=True,
                              text=True, timeout=900)

    plan_args = ("plan", str(slow_model), "--ctx", "512", "--host-mem-budget", str(BUDGET_GIB), "--budget-s", "25")
    refused = flux(*plan_args)
    assert refused.returncode == 2, refused.stderr[-3000:]
    error = [ln for ln in refused.stderr.splitlines() if ln.startswith("error:")]
    assert len(error) == 1 and "--allow-storage-streaming" in error[0], refused.stderr[-3000:]
    found = re.search(r"read from the drive, ([\d,.]+) MB per token at ([\d.]+) GB/s would bound decode to "
                      r"([\d,.]+) tok/s", error[0])
    assert found, error[0]
    drive_mb, gbs, limit = (float(x.replace(",", "")) for x in found.groups())
    probe = Records.at(tmp_path / "data" / "flux").all(PROBE)[-1]
    assert gbs == round(probe.storage_read_gbs, 2)
    assert limit == pytest.approx(probe.storage_read_gbs * 1e3 / drive_mb, rel=0.02)

    planned = flux(*plan_args, "--allow-storage-streaming")
    assert planned.returncode == 0, planned.stderr[-4000:]
    plan_id = planned.stdout.strip().splitlines()[-1]
    plan = Records.at(tmp_path / "data" / "flux").get(PLAN, plan_id)
    assert plan.candidate.needs_storage_streaming and plan.candidate.params.load_mode == "mmap"
    s = plan.storage_streaming
    assert s is not None and s.decode_limit_tps and s.drive_bytes_per_token > 0
    assert plan.measured.decode_tps and plan.measured.decode_tps > 0  # measured like any other plan
    shown = flux("show", plan_id)
    assert shown.returncode == 0, shown.stderr
    line = next(ln for ln in shown.stdout.splitlines() if ln.startswith("storage streaming:"))
    assert f"decode at most {s.decode_limit_tps:,.2f} tok/s" in line
    assert f"measured decode {plan.measured.decode_tps:.2f} tok/s" in line
