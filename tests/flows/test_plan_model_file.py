"""`flux plan` and `flux inspect` of a file that is no model: one line, exit 2, before anything starts.

A FIFO once blocked both forever (the header reader waited for a writer); an empty or malformed file took
`flux plan` 45-116 s to refuse, because the file was read only once Prefect's temporary server had started.
Now the header is read first: the line is `flux inspect`'s, and no server starts (its database never appears).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TIMEOUT = 120  # a hang is a failure, not a stuck run


def _one_line(proc: object) -> str:
    rc, err = proc.returncode, proc.stderr  # type: ignore[attr-defined]
    assert rc == 2, (rc, err)
    assert "Traceback" not in err
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture()
def prefect_home(tmp_path: Path) -> Path:
    return tmp_path / "prefect-home"


def _plan_and_inspect(flux, path: Path, prefect_home: Path) -> tuple[str, str]:
    env = {"PREFECT_HOME": str(prefect_home)}
    inspected = _one_line(flux("inspect", str(path), timeout=TIMEOUT, env=env))
    planned = _one_line(flux("plan", str(path), "--budget-s", "30", timeout=TIMEOUT, env=env))
    assert not (prefect_home / "prefect.db").exists(), "Prefect's temporary server started"
    return inspected, planned


def test_a_fifo_is_refused_in_one_line(flux, tmp_path: Path, prefect_home: Path) -> None:
    fifo = tmp_path / "x.gguf"
    os.mkfifo(fifo)
    inspected, planned = _plan_and_inspect(flux, fifo, prefect_home)
    assert inspected == planned
    assert str(fifo) in planned and "named pipe" in planned and "not a GGUF file" in planned


def test_a_directory_is_refused_in_one_line(flux, tmp_path: Path, prefect_home: Path) -> None:
    folder = tmp_path / "d.gguf"
    folder.mkdir()
    inspected, planned = _plan_and_inspect(flux, folder, prefect_home)
    assert inspected == planned and "is a directory" in planned


@pytest.mark.parametrize(("content", "says"), [(b"", "only 0 bytes"), (b"hello, I am text\n" * 10, "not a GGUF"),
                                               (b"GGUF" + (9).to_bytes(4, "little") + bytes(40), "version 9")])
def test_an_empty_or_malformed_file_is_refused_by_plan_as_by_inspect(flux, tmp_path: Path, prefect_home: Path,
                                                                     content: bytes, says: str) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    inspected, planned = _plan_and_inspect(flux, bad, prefect_home)
    assert inspected == planned, (inspected, planned)
    assert str(bad) in planned and says in planned


def test_a_truncated_model_is_refused_by_plan_as_by_inspect(flux, tiny_moe: Path, tmp_path: Path,
                                                            prefect_home: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_moe.read_bytes()[:200_000])
    inspected, planned = _plan_and_inspect(flux, cut, prefect_home)
    assert inspected == planned and "truncated" in planned
