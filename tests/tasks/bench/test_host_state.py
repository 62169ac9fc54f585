"""The host read around a served race and compared with this machine's stored probes (tasks.bench.host_state)."""

from __future__ import annotations

from pathlib import Path

from artifacts.records.kinds import PROBE
from artifacts.records.store import Records
from tasks.bench.host_state import HostCheck, HostState, host_columns, host_flag, read_host, usual_state
from tasks.testing import h200_report


def test_read_host_measures_this_machines_ram_and_no_copies_without_a_gpu() -> None:
    got = read_host()
    assert got.ram_read_gbs > 0.5, "a real read of RAM"
    assert got.h2d_pageable_gbs is None and got.h2d_pinned_gbs is None, "no GPU here to copy to"


def test_run_19s_host_is_flagged_against_the_machines_usual_figures() -> None:
    usual = HostState(ram_read_gbs=81.4, h2d_pinned_gbs=54.5, h2d_pageable_gbs=8.0)
    run19 = HostState(ram_read_gbs=45.4, h2d_pinned_gbs=44.4, h2d_pageable_gbs=5.1)
    flag = host_flag(run19, usual, 14)
    assert flag is not None
    assert "RAM read 45.4 GB/s against 81.4" in flag and "pageable host-to-device 5.1 GB/s against 8.0" in flag
    assert "14 stored probe(s)" in flag
    quiet = HostState(ram_read_gbs=70.9, h2d_pinned_gbs=55.2, h2d_pageable_gbs=6.6)  # run 10's probe: in range
    assert host_flag(quiet, usual, 14) is None
    assert host_flag(run19, None, 0) is None, "nothing stored to compare with: no flag"


def test_usual_figures_are_the_medians_of_the_plans_machine_only(tmp_path: Path) -> None:
    records = Records.at(tmp_path)
    for ram, pageable in ((94.0, 8.2), (80.0, 7.0), (45.0, 5.0)):
        rep = h200_report(model_hash=f"m{ram}")
        gpus = [rep.gpus[0].model_copy(update={"h2d_pageable_gbs": pageable})]
        records.put(PROBE, rep.model_copy(update={"ram_read_gbs": ram, "gpus": gpus}))
    other = h200_report(n_gpus=2, model_hash="other").model_copy(update={"ram_read_gbs": 10.0})
    records.put(PROBE, other)
    usual, n = usual_state(records, "h200x1")
    assert n == 3 and usual is not None
    assert usual.ram_read_gbs == 80.0 and usual.h2d_pageable_gbs == 7.0 and usual.h2d_pinned_gbs == 55.5
    assert usual_state(records, "elsewhere") == (None, 0)


def test_record_columns_take_the_slower_reading_and_the_flag() -> None:
    usual = HostState(ram_read_gbs=80.0, h2d_pageable_gbs=8.0)
    check = HostCheck(start=HostState(ram_read_gbs=70.0, h2d_pageable_gbs=7.5),
                      end=HostState(ram_read_gbs=50.0, h2d_pageable_gbs=7.9), usual=usual, probes=3)
    check.flag = host_flag(check.slowest(), usual, 3)
    cols = host_columns(check.model_dump())
    assert cols["race_ram_read_gbs"] == 50.0 and cols["race_h2d_pageable_gbs"] == 7.5
    assert cols["probe_ram_read_gbs"] == 80.0 and "RAM read 50.0 GB/s against 80.0" in str(cols["host_flag"])
    assert host_columns(None) == {}, "a row from before the host reading has no host columns"


def test_the_records_runs_on_a_slow_host_are_runs_11_and_19() -> None:
    import pyarrow.parquet as pq

    from tasks.bench.host_state import flag_record, probe_readings

    h200 = Path(__file__).resolve().parents[3] / "docs" / "benchmarks" / "h200"
    readings = probe_readings(h200)
    rows = [{k: v for k, v in r.items() if k not in ("probe_ram_read_gbs", "probe_h2d_pageable_gbs", "host_flag")}
            for r in pq.read_table(h200 / "record.parquet").to_pylist()]
    assert flag_record(rows, readings) >= 20, "most rows' runs kept their probe's log lines"
    flagged = {r["run"] for r in rows if r.get("host_flag")}
    assert flagged == {"h200-2026-12-03d", "h200-2026-12-04e"}, flagged
    run19 = next(r for r in rows if r["run"] == "h200-2026-12-04e")
    assert run19["probe_ram_read_gbs"] == 45.4 and run19["probe_h2d_pageable_gbs"] == 5.1
    assert "at the run's probe" in run19["host_flag"] and "RAM read 45.4 GB/s" in run19["host_flag"]
