"""The managed child process (engine_bridge.procgroup) with real subprocesses: a stop that is ignored ends in a kill
of the whole group, an early exit is told with the last lines of the log, a readiness wait ends at its timeout;
the engine process and llama-server say the same through it."""

from __future__ import annotations

import signal
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from artifacts.engine_params import EngineParams
from artifacts.engine_spec import EngineSpec
from engine_bridge.engines.process import EngineProcess, EngineStartError
from engine_bridge.llama_server import LlamaServer, LlamaServerError
from engine_bridge.procgroup import ManagedProcess

# A leader that starts a grandchild (in its group), says so in the log, then waits. ``{leader}`` and ``{grandchild}``
# set each one's SIGINT handling before the grandchild is started.
FAMILY = textwrap.dedent("""
    import signal, subprocess, sys, time
    {leader}
    kid = subprocess.Popen([sys.executable, "-c", "import signal, time\\n{grandchild}\\ntime.sleep(3600)"])
    print("grandchild", kid.pid, flush=True)
    time.sleep(3600)
""")
IGNORE = "signal.signal(signal.SIGINT, signal.SIG_IGN)"
DEFAULT = "signal.signal(signal.SIGINT, signal.default_int_handler)"


def family(leader: str, grandchild: str) -> list[str]:
    return [sys.executable, "-c", FAMILY.format(leader=leader, grandchild=grandchild)]


def logged(path: Path, text: str) -> Callable[[], bool]:
    """A readiness check: ``text`` is in the log at ``path``."""
    return lambda: path.is_file() and text in path.read_text()


def group_members(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that have not exited (zombies left to their new parent do not count)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            live.append(int(stat.parent.name))
    return live


def group_gone(pgid: int) -> bool:
    """Whether group ``pgid`` has no live member once SIGKILL has been delivered (it is asynchronous)."""
    deadline = time.monotonic() + 60
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not group_members(pgid)


def test_a_child_that_ignores_the_polite_signal_is_killed_after_the_grace_with_its_whole_group(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = ManagedProcess(family(IGNORE, IGNORE), log_path=log, stop_signal=signal.SIGINT)
    child.start()
    assert child.wait_ready(logged(log, "grandchild"), 60) == "ready"
    pgid = child.pid
    assert pgid is not None and len(group_members(pgid)) == 2
    child.stop(grace_s=0.5)
    assert child.returncode == -signal.SIGKILL, "SIGINT was ignored: the group was killed"
    assert not child.alive and group_gone(pgid)
    child.stop()  # idempotent
    child.kill()


def test_a_child_that_stops_politely_is_not_killed_and_what_it_left_behind_is(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    with ManagedProcess(family(DEFAULT, IGNORE), log_path=log, stop_signal=signal.SIGINT) as child:
        assert child.wait_ready(logged(log, "grandchild"), 60) == "ready"
        pgid = child.pid
        assert pgid is not None
    assert child.returncode is not None and child.returncode != -signal.SIGKILL, "the leader stopped on SIGINT"
    assert group_gone(pgid), "the grandchild that ignored SIGINT was killed with the group"


def test_a_child_that_exits_early_is_told_by_its_last_log_lines(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    log.write_text("an older child's words\n")
    code = "import sys\nfor i in range(1, 6): print(f'line {i}')\nprint('fatal: no such file', file=sys.stderr)\nsys.exit(3)"
    child = ManagedProcess([sys.executable, "-c", code], log_path=log)
    child.start()
    assert child.wait_ready(lambda: False, 60) == "exited" and child.returncode == 3
    assert child.log_note(400, 3) == f"; log {log}: line 4 | line 5 | fatal: no such file"
    assert child.last_words() == "fatal: no such file"
    child.stop()


def test_the_engine_and_llama_server_say_why_they_did_not_start(tmp_path: Path) -> None:
    say = "import sys\nprint('loading')\nprint('error: bad model', flush=True)\nsys.exit(4)"
    spec = EngineSpec(name="mine", kind="command", command=(sys.executable, "-c", say, "{port}"))
    log = tmp_path / "engine.log"
    with pytest.raises(EngineStartError) as err:
        EngineProcess(spec, "m.gguf", EngineParams(), log_path=log).start()
    assert str(err.value.message) == f"engine mine: exited with code 4 before answering; log {log}: loading | error: bad model"

    exe, model = tmp_path / "llama-server", tmp_path / "m.gguf"
    exe.write_text("#!/bin/sh\necho \"$@\"\necho 'error: failed to load model'\nexit 1\n")
    exe.chmod(0o755)
    model.write_bytes(b"")
    with pytest.raises(LlamaServerError) as server_err:
        LlamaServer(exe, model, ["-c", "64"], log_path=tmp_path / "server.log").start()
    said = str(server_err.value.message)
    assert said.startswith(f"llama-server did not start: exited with code 1; log {tmp_path / 'server.log'}: -m ")
    assert "-c 64 --host 127.0.0.1 --port" in said and said.endswith("--no-webui | error: failed to load model")


def test_a_command_that_cannot_run_raises_and_leaves_nothing_open(tmp_path: Path) -> None:
    child = ManagedProcess([str(tmp_path / "missing")], log_path=tmp_path / "child.log")
    with pytest.raises(OSError):
        child.start()
    assert not child.alive and child.pid is None and child.exited(0)
    child.stop()


def test_a_readiness_wait_ends_at_its_timeout(tmp_path: Path) -> None:
    asked = []

    def never() -> bool:
        asked.append(1)
        return False

    with ManagedProcess([sys.executable, "-c", "import time; time.sleep(3600)"], log_path=tmp_path / "c.log") as child:
        t0 = time.monotonic()
        assert child.wait_ready(never, 0.3, poll_s=0.05) == "timeout"
        assert time.monotonic() - t0 >= 0.3 and asked and child.alive
        asked.clear()
        assert child.wait_ready(never, 5, since=time.monotonic() - 10) == "timeout" and not asked, \
            "the timeout counts from `since`"
        answers = iter([False, False, True])
        assert child.wait_ready(lambda: next(answers), 60, poll_s=0.01) == "ready"
        assert not child.exited(0)
    assert child.exited(0) and child.returncode == -signal.SIGTERM
