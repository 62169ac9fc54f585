"""The KV page ledger's arithmetic (server/kv_pages.py), without a server: pools from a plan's KV placement, the
pages a sequence holds, admission exactly at the limit, and pages coming back."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from artifacts.model_info import model_info
from server.errors import ContextLengthExceeded, PagesExhausted
from server.kv_pages import (
    HOST,
    PAGE_TOKENS,
    HostRam,
    PageLedger,
    kv_page_bytes,
    memlock_warning,
    page_budget,
)

P = PAGE_TOKENS


def test_page_bytes_are_inspects_kv_bytes_per_token_times_a_page(tiny_moe: Path) -> None:
    info = model_info(tiny_moe)
    assert not info.swa_kv_bytes_per_token
    assert kv_page_bytes(info, "f16", "f16") == info.kv_bytes_per_token["f16"] * P
    assert kv_page_bytes(info, "q8_0", "q8_0") == info.kv_bytes_per_token["q8_0"] * P
    mixed = (info.kv_bytes_per_token["q8_0"] + info.kv_bytes_per_token["f16"]) * P / 2
    assert kv_page_bytes(info, "q8_0", "f16") == round(mixed)


def test_kv_on_the_host_is_one_pool_capped_by_the_context_and_by_ram() -> None:
    b = page_budget({"CPU": 8 << 20}, n_ctx=1024, n_seq=4, page_bytes=1000, host_kv_bytes=10**9)
    (pool,) = b.pools
    assert (pool.name, pool.role, pool.pages, pool.page_bytes) == (HOST, "window", 16, 1000)  # 4 x 1024 / 256
    assert pool.ram_pages == 10**6 and b.pinned_bytes() == 0
    small = page_budget({"CPU": 8 << 20}, n_ctx=1024, n_seq=4, page_bytes=1000, host_kv_bytes=5999)
    assert small.pools[0].pages == 5 and small.pools[0].ram_pages == 5


def test_kv_on_gpus_splits_page_bytes_by_their_share_and_overflows_to_the_host() -> None:
    b = page_budget({"CUDA0": 300, "CUDA1": 100, "CPU": 0}, n_ctx=4096, n_seq=2, page_bytes=4000,
                    host_kv_bytes=40_000)
    assert [(p.name, p.role, p.page_bytes, p.pages) for p in b.pools] == [
        ("CUDA0", "window", 3000, 32), ("CUDA1", "window", 1000, 32), (HOST, "overflow", 4000, 0)]
    assert b.pools[2].ram_pages == 10 and b.window == 4096  # default: every cell on the GPUs, none on the host
    w = page_budget({"CUDA0": 1}, n_ctx=4096, n_seq=2, page_bytes=4000, host_kv_bytes=40_000, window=1100)
    assert w.window == 1024  # a page boundary
    assert [(p.name, p.pages) for p in w.pools] == [("CUDA0", 8), (HOST, 10)]  # 2 x 12 past it; RAM holds 10
    assert w.pages_for(1024) == {"CUDA0": 4, HOST: 0} and w.pages_for(1025) == {"CUDA0": 4, HOST: 1}
    assert w.pinned_bytes() == 40_000


def test_admission_refuses_exactly_past_the_free_pages_and_pages_return() -> None:
    ledger = PageLedger(page_budget({"CPU": 1}, n_ctx=1024, n_seq=4, page_bytes=100, host_kv_bytes=300))
    a = ledger.reserve("a", prompt=700, least=768, most=1024)  # 3 pages hold 768 tokens: the reply is cut there
    assert (a.tokens, a.reply_tokens, a.pages) == (768, 68, {HOST: 3})
    assert ledger.free() == {HOST: 0}
    with pytest.raises(PagesExhausted) as refused:
        ledger.reserve("b", prompt=1, least=2, most=2)
    assert isinstance(refused.value, ContextLengthExceeded) and refused.value.code == "context_length_exceeded"
    assert refused.value.status == 400 and "free pages hold 0 tokens" in refused.value.message
    ledger.release("a")
    ledger.release("a")  # every ending may call it
    assert ledger.free() == {HOST: 3} and ledger.holders == 0
    assert ledger.reserve("c", prompt=704, least=768, most=768).pages == {HOST: 3}  # exactly the free pages
    ledger.release("c")
    with pytest.raises(PagesExhausted):
        ledger.reserve("d", prompt=705, least=769, most=769)  # one token more
    assert ledger.free() == {HOST: 3}  # a refusal holds nothing


def test_report_lists_every_pool() -> None:
    ledger = PageLedger(page_budget({"CUDA0": 1}, n_ctx=512, n_seq=1, page_bytes=100, host_kv_bytes=1000))
    ledger.reserve("a", prompt=10, least=20, most=300)
    got = {u.name: (u.pages_total, u.pages_used, u.pages_free, u.page_bytes) for u in ledger.report()}
    assert got == {"CUDA0": (2, 2, 0, 100), HOST: (0, 0, 0, 100)}
    assert ledger.summary()["pools"][0]["name"] == "CUDA0" and ledger.summary()["requests"] == 1


def test_host_ram_subtracts_the_weights_and_the_reserve_unless_overridden() -> None:
    assert HostRam(available=100, weights=30, reserve=10).kv_bytes == 60
    assert HostRam(available=100, weights=95, reserve=10).kv_bytes == 0
    assert HostRam(available=100, weights=95, reserve=10, override=5000).kv_bytes == 5000


def test_memlock_warning_names_the_limit_only_when_pinned_pages_exceed_it() -> None:
    gpu = page_budget({"CUDA0": 1}, n_ctx=4096, n_seq=1, page_bytes=1 << 20, host_kv_bytes=1 << 40, window=1024)
    assert gpu.pinned_bytes() == 12 << 20
    line = memlock_warning(gpu, limit=8 << 20)
    assert line is not None and "ulimit -l" in line and "8192 KiB" in line and "pageable" in line
    assert "\n" not in line
    assert memlock_warning(gpu, limit=12 << 20) is None
    assert memlock_warning(gpu, limit=resource.RLIM_INFINITY) is None
    host = page_budget({"CPU": 1}, n_ctx=4096, n_seq=1, page_bytes=1 << 20, host_kv_bytes=1 << 40, window=1024)
    assert host.pinned_bytes() == 0 and memlock_warning(host, limit=0) is None  # KV on the host: nothing pinned


_devices = st.dictionaries(st.sampled_from(["CUDA0", "CUDA1", "CPU"]), st.integers(0, 10**6), max_size=3)


@settings(max_examples=200, deadline=None)
@given(kv=_devices, n_ctx=st.integers(16, 9000), n_seq=st.integers(1, 4), page_bytes=st.integers(1, 10**5),
       host=st.integers(0, 10**7), window=st.one_of(st.none(), st.integers(0, 9000)),
       asks=st.lists(st.tuples(st.integers(1, 9000), st.integers(0, 9000), st.booleans()), max_size=12))
def test_ledger_never_gives_out_more_than_it_holds(kv: dict[str, int], n_ctx: int, n_seq: int, page_bytes: int,
                                                   host: int, window: int | None,
                                                   asks: list[tuple[int, int, bool]]) -> None:
    budget = page_budget(kv, n_ctx, n_seq, page_bytes, host, window)
    total = {p.name: p.pages for p in budget.pools}
    ledger = PageLedger(budget)
    for i, (least, extra, release_first) in enumerate(asks):
        if release_first and ledger.holders:
            ledger.release(f"r{i - 1}")
        free = ledger.free()
        fit = budget.tokens_fit(free)
        # the fit is exact: its pages are free, one token more is not
        assert all(n <= free[k] for k, n in budget.pages_for(fit).items())
        assert any(n > free[k] for k, n in budget.pages_for(fit + 1).items())
        try:
            held = ledger.reserve(f"r{i}", prompt=least // 2, least=least, most=least + extra)
        except PagesExhausted:
            assert fit < least and ledger.free() == free
            continue
        assert least <= held.tokens <= least + extra
        assert held.tokens == min(least + extra, fit)  # as much as it asked for, else as much as is free
        assert all(0 <= n <= total[k] for k, n in ledger.used().items())
    for i in range(len(asks)):
        ledger.release(f"r{i}")
    assert ledger.free() == total
