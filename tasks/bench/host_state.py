"""How fast the host was while a served race ran, against this machine's probes.

A baseline that keeps experts in host memory runs at the host's memory bandwidth (decode) and at its pageable
host-to-device copies (prefill: llama.cpp copies the host's expert tensors to the GPU for each large micro-batch);
a plan that keeps most of the work on the GPU, or copies from pinned memory, slows far less. A race on a host
slowed by someone else's work therefore favours the plan, and its ratios are larger than on a quiet host: on the
H200, run 19's probe read 45 GB/s from RAM and 5.1 GB/s pageable, where the earlier runs of the same machine read
66-110 and 5.5-8.9, and ``--fit`` prefilled at 148 tok/s against 320 in run 18.

``flux bench run --via serve`` reads the host before the first contender starts and after the last one stops
(:func:`read_host`), compares the slower reading with the medians of this machine's stored probes
(:func:`usual_state`), and records both with a flag (:func:`host_flag`) when the host was slower than usual: the
ratios stand for that state only, and the flag says so wherever they are shown.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
from pydantic import BaseModel, Field

from artifacts.records.hardware import HardwareReport
from artifacts.records.kinds import PROBE
from artifacts.records.store import Records
from engine_bridge.gpu_inventory import nvml_inventory
from tasks.probing.gpu import host_to_device_bandwidth
from tasks.probing.host import ram_read_bandwidth, usable_cpus

SLOW = 0.75  # a reading under this share of the machine's usual one flags the race


class HostState(BaseModel):
    """One reading of the host: RAM read GB/s with every usable CPU, and the first GPU's copies from the host."""

    ram_read_gbs: float
    h2d_pinned_gbs: float | None = None
    h2d_pageable_gbs: float | None = None


class HostCheck(BaseModel):
    """The host before and after a race, what this machine's probes read, and the flag when it was slower."""

    start: HostState
    end: HostState | None = None
    usual: HostState | None = Field(None, description="medians over this machine's stored probes")
    probes: int = Field(0, description="how many stored probes of this machine the medians are over")
    flag: str | None = None

    def slowest(self) -> HostState:
        """The slower of the two readings, figure by figure."""
        if self.end is None:
            return self.start
        return HostState(ram_read_gbs=min(self.start.ram_read_gbs, self.end.ram_read_gbs),
                         h2d_pinned_gbs=_least(self.start.h2d_pinned_gbs, self.end.h2d_pinned_gbs),
                         h2d_pageable_gbs=_least(self.start.h2d_pageable_gbs, self.end.h2d_pageable_gbs))


def _least(a: float | None, b: float | None) -> float | None:
    return min((x for x in (a, b) if x is not None), default=None)


def read_host() -> HostState:
    """Read the host now (a few seconds): RAM read bandwidth as the probe measures it, and the first GPU's
    host-to-device copies (in a child process, as the probe does; none without a GPU)."""
    ram = ram_read_bandwidth(int(psutil.virtual_memory().available), threads=usable_cpus(), repeats=2)
    bus_ids = nvml_inventory().bus_ids[:1]
    copies = next(iter(host_to_device_bandwidth(bus_ids, timeout_s=60.0).values()), None) if bus_ids else None
    return HostState(ram_read_gbs=ram.gbs, h2d_pinned_gbs=copies[0] if copies else None,
                     h2d_pageable_gbs=copies[1] if copies else None)


def usual_state(records: Records, fingerprint: str) -> tuple[HostState | None, int]:
    """Medians of the stored probes of the machine with ``fingerprint`` (the plan's), and how many there were."""
    probes: list[HardwareReport] = [p for p in records.readable(PROBE)[0] if p.fingerprint == fingerprint]
    if not probes:
        return None, 0
    pinned = [p.gpus[0].h2d_pinned_gbs for p in probes if p.gpus and p.gpus[0].h2d_pinned_gbs]
    pageable = [p.gpus[0].h2d_pageable_gbs for p in probes if p.gpus and p.gpus[0].h2d_pageable_gbs]
    return HostState(ram_read_gbs=statistics.median(p.ram_read_gbs for p in probes),
                     h2d_pinned_gbs=statistics.median(pinned) if pinned else None,
                     h2d_pageable_gbs=statistics.median(pageable) if pageable else None), len(probes)


def host_flag(now: HostState, usual: HostState | None, probes: int, when: str = "during the race",
              against: str = "stored probe(s) of this machine") -> str | None:
    """A line when the host read under SLOW of its usual figures ``when`` (None when it did not, or when no
    probe of this machine is stored to compare with); ``probes`` of ``against`` made the usual figures."""
    if usual is None:
        return None
    slow: list[str] = []
    pairs: Sequence[tuple[str, float | None, float | None]] = (
        ("RAM read", now.ram_read_gbs, usual.ram_read_gbs),
        ("pageable host-to-device", now.h2d_pageable_gbs, usual.h2d_pageable_gbs))
    for what, got, want in pairs:
        if got is not None and want and got < SLOW * want:
            slow.append(f"{what} {got:.1f} GB/s against {want:.1f}")
    if not slow:
        return None
    return (f"host slower than usual {when} ({'; '.join(slow)}, the median of {probes} {against}): baselines "
            "that run experts on the host slow more than the plan, so these ratios hold for this host state only; "
            "rerun on a quiet host before quoting them")


def host_columns(host: dict[str, object] | None) -> dict[str, object]:
    """A record row's host columns from a race's ``host`` metrics (a :class:`HostCheck`; none before run 20):
    the slower reading during the race, the machine's usual figures, and the flag."""
    if not host:
        return {}
    check = HostCheck.model_validate(host)
    now, usual = check.slowest(), check.usual
    return {"race_ram_read_gbs": now.ram_read_gbs, "race_h2d_pageable_gbs": now.h2d_pageable_gbs,
            "probe_ram_read_gbs": usual.ram_read_gbs if usual else None,
            "probe_h2d_pageable_gbs": usual.h2d_pageable_gbs if usual else None, "host_flag": check.flag}


_RAM = re.compile(r"probe: RAM read ([0-9.]+) GB/s \(\d+ threads\)")
_COPY = re.compile(r"host-to-device ([0-9.]+) GB/s pinned, ([0-9.]+)")
_PLAN_ID = re.compile(r"^[0-9a-f]{64}$", re.MULTILINE)  # `flux plan` prints the plan's id alone on a line


def probe_readings(root: Path) -> dict[str, HostState]:
    """Plan id -> the probe's reading of the run that made it, from the logs kept beside a record (each
    ``runN/`` folder, and folders under it, with the probe's log lines and the plans' ids)."""
    out: dict[str, HostState] = {}
    for folder in sorted({p.parent for p in root.glob("run*/**/*.log")}):
        text = "\n".join(p.read_text(errors="replace") for p in sorted(folder.glob("*.log")))
        ram, copy = _RAM.search(text), _COPY.search(text)
        if ram is None:
            continue
        state = HostState(ram_read_gbs=float(ram[1]), h2d_pinned_gbs=float(copy[1]) if copy else None,
                          h2d_pageable_gbs=float(copy[2]) if copy else None)
        for plan_id in _PLAN_ID.findall(text):
            out.setdefault(plan_id, state)
    return out


def flag_record(rows: list[dict[str, Any]], readings: dict[str, HostState]) -> int:
    """Give a record's rows their run's probe reading (where they lack one) and flag, by :func:`host_flag`, each
    row whose reading is slow against the median of the record's runs (one reading per run). Returns how many
    rows gained a reading."""
    gained = 0
    for r in rows:
        got = readings.get(r.get("plan_id") or "")
        if got is not None and r.get("probe_ram_read_gbs") is None:
            r.update(probe_ram_read_gbs=got.ram_read_gbs, probe_h2d_pageable_gbs=got.h2d_pageable_gbs)
            gained += 1
    per_run = {r["run"]: (r["probe_ram_read_gbs"], r.get("probe_h2d_pageable_gbs"))
               for r in rows if r.get("probe_ram_read_gbs") is not None}
    if not per_run:
        return gained
    pageable = [p for _, p in per_run.values() if p]
    usual = HostState(ram_read_gbs=statistics.median(ram for ram, _ in per_run.values()),
                      h2d_pageable_gbs=statistics.median(pageable) if pageable else None)
    for r in rows:
        if r.get("probe_ram_read_gbs") is not None and r.get("race_ram_read_gbs") is None:
            now = HostState(ram_read_gbs=r["probe_ram_read_gbs"], h2d_pageable_gbs=r.get("probe_h2d_pageable_gbs"))
            r["host_flag"] = host_flag(now, usual, len(per_run), when="at the run's probe",
                                       against="runs' probes in the record")
    return gained
