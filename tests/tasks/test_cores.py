"""The cores the routing trace and the noise floor share: a file their workers follow, between units of work."""

from __future__ import annotations

import threading
from pathlib import Path

import llama_cpp
import pytest

from artifacts.engine_params import EngineParams
from engine_bridge.worker.native import NativeModel
from engine_bridge.worker.threads import SharedThreads
from tasks.cores import CoreShare


def test_each_busy_user_gets_an_equal_share_and_all_of_them_alone() -> None:
    share = CoreShare()
    assert not share.path.exists(), "no file while no one is busy"
    with share.busy("route", 16) as a:
        assert a.threads() == 16 and share.path.read_text() == "16"
        with share.busy("noise floor", 16):
            assert share.threads() == 8 and share.path.read_text() == "8"
        assert share.path.read_text() == "16", "the trace takes every core once the floor is done"
    assert not share.path.exists()


def test_the_same_user_twice_counts_once_and_a_crash_leaves_it() -> None:
    share = CoreShare()
    with share.busy("floor", 4), share.busy("floor", 4):
        assert share.threads() == 4
    with pytest.raises(RuntimeError), share.busy("route", 4):
        raise RuntimeError("trace died")
    assert share.threads() == 4 and not share.path.exists()


def test_shares_change_under_threads() -> None:
    share = CoreShare()
    seen: list[int] = []
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with share.busy("route", 6):
            inside.set()
            leave.wait(10)

    with share.busy("floor", 6):
        t = threading.Thread(target=other)
        t.start()
        inside.wait(10)
        seen.append(int(share.path.read_text()))
        leave.set()
        t.join()
        seen.append(int(share.path.read_text()))
    assert seen == [3, 6]


def test_a_worker_context_follows_the_file(tiny_moe: Path, tmp_path: Path) -> None:
    model = NativeModel(tiny_moe, EngineParams(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1))
    try:
        f = tmp_path / "threads.txt"
        follow = SharedThreads(f)
        assert follow.apply(model.ctx) == 0 and llama_cpp.llama_n_threads(model.ctx) == 1, "no file: unchanged"
        f.write_text("2")
        assert follow.apply(model.ctx) == 2
        assert (llama_cpp.llama_n_threads(model.ctx), llama_cpp.llama_n_threads_batch(model.ctx)) == (2, 2)
        f.write_text("garbage")
        assert follow.apply(model.ctx) == 2, "an unreadable file leaves the threads as they are"
    finally:
        model.close()
