"""KV pages: the ledger ``flux serve`` admits requests by.

KV is counted in pages of :data:`PAGE_TOKENS` tokens, in pools by where it lives. The plan's KV placement
gives the *window* pools: each device holding KV (a GPU, an RPC server, or the host with ``-nkvo`` or a CPU
plan), holding the first ``window`` cells of every sequence (default: all of them, as the worker allocates
today). Cells past the window go to the *host* pool (pinned RAM a GPU reads; none while the window is the whole
context). The host's pages are bounded by the RAM available when ``flux serve`` starts, minus the weights the
plan keeps in RAM and the host reserve (or ``serve.kv_host_bytes``), divided by a page's bytes; no pool holds
more pages than the loaded context (``n_ctx`` cells for each of ``n_seq`` sequences: the worker gives each
sequence its own cells, ``kv_unified`` off).

A request reserves the pages of its prompt plus its whole reply limit when they are free, else at least of its
prompt plus ``min(max_tokens, serve.min_reply)`` (less is :class:`~server.errors.PagesExhausted`, a 400
``context_length_exceeded``); its reply is then cut at what it reserved (``finish_reason: "length"``), so a
running sequence never needs a page it does not hold. Pages return when the request ends, however it ends.
Parked conversation states are copies in RAM outside the KV cells (``llama_state_seq_get_data``), budgeted
apart (the parking budget), so they hold no pages.
"""

from __future__ import annotations

import math
import resource
from collections.abc import Mapping
from typing import Any, Literal

import psutil
from pydantic import BaseModel, ConfigDict, Field

from artifacts.model_info import ModelInfo
from artifacts.records.plan import Plan
from server.errors import PagesExhausted

PAGE_TOKENS = 256  # llama.cpp pads a KV cache to 256 cells, the unit the planner sizes contexts in
HOST = "host"  # the pool of the host's RAM (a plan names the host's device "CPU")
GIB = 2**30
PARK_MAX_BYTES = 1 * GIB  # RAM for parked conversation states at most


def park_budget(reserve_percent: float) -> int:
    """RAM for parked conversation states: available RAM above the host reserve, at most 1 GiB."""
    vm = psutil.virtual_memory()
    return int(max(0, min(PARK_MAX_BYTES, vm.available - vm.total * reserve_percent / 100)))


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Pool(_Frozen):
    """One place KV pages live."""

    name: str = Field(description="the device as the plan names it ('CUDA0', an RPC server), or 'host'")
    role: Literal["window", "overflow"] = Field(description=(
        "window: the first cells of every sequence (a page here per page of tokens); overflow: the cells past it"))
    page_tokens: int
    page_bytes: int = Field(description="this pool's bytes of one page (its share of the layers' KV)")
    pages: int = Field(ge=0, description="pages admission may give out")
    ram_pages: int | None = Field(None, description="host: the pages the RAM for KV holds, before the context's cap")


class PageBudget(_Frozen):
    """The pools of one loaded context, and how a sequence's tokens map onto them."""

    page_tokens: int
    n_ctx: int = Field(description="cells per sequence")
    n_seq: int
    window: int = Field(description="cells per sequence in the window pools; the rest are the host pool's")
    pools: tuple[Pool, ...]
    host_kv_bytes: int = Field(description="RAM given to KV pages on the host")

    def _window_pools(self) -> list[Pool]:
        return [p for p in self.pools if p.role == "window"]

    def _overflow(self) -> Pool | None:
        return next((p for p in self.pools if p.role == "overflow"), None)

    def pages_for(self, tokens: int) -> dict[str, int]:
        """Pages of each pool that a sequence of ``tokens`` tokens holds."""
        t, over = self.page_tokens, self._overflow()
        held = min(tokens, self.window) if over is not None else tokens  # without an overflow, all in the window
        out = {p.name: math.ceil(held / t) for p in self._window_pools()}
        if over is not None:
            out[over.name] = math.ceil(max(0, tokens - self.window) / t)
        return out

    def tokens_fit(self, free: Mapping[str, int]) -> int:
        """The longest sequence (tokens) whose pages ``free`` holds: the window pools' fewest free pages, and
        the host's past a full window."""
        t = self.page_tokens
        window_free = min(free.get(p.name, 0) for p in self._window_pools()) * t
        over = self._overflow()
        if over is None or window_free < self.window:
            return window_free
        return self.window + free.get(over.name, 0) * t

    def pinned_bytes(self) -> int:
        """Host bytes a GPU reads in place (the overflow pool's pages): what must be pinned."""
        over = self._overflow()
        return over.pages * over.page_bytes if over is not None else 0


class HostRam(_Frozen):
    """The RAM that sizes the host pool: available when ``flux serve`` starts (or as the probe found it), minus
    the weights the plan keeps in RAM and the host reserve; ``override`` (``serve.kv_host_bytes``) replaces it."""

    available: int
    weights: int
    reserve: int
    override: int | None = None

    @property
    def kv_bytes(self) -> int:
        """Bytes for KV pages on the host."""
        if self.override is not None:
            return self.override
        return max(0, self.available - self.weights - self.reserve)

    @classmethod
    def now(cls, plan: Plan, reserve_percent: float, override: int | None = None) -> HostRam:
        """This machine's RAM now (call it before the worker loads the weights)."""
        vm = psutil.virtual_memory()
        return cls(available=vm.available, weights=plan.candidate.weights_bytes.get("CPU", 0),
                   reserve=int(vm.total * reserve_percent / 100), override=override)


def kv_page_bytes(info: ModelInfo, type_k: str, type_v: str) -> int:
    """Bytes of one page of tokens: ``flux inspect``'s KV bytes per token (:attr:`ModelInfo.kv_bytes_per_token`)
    less the sliding-window layers' share (their cache stops growing at the window, as the planner sizes a
    context), times :data:`PAGE_TOKENS`. K and V of different types cost the mean of the two (each is half)."""
    per = info.kv_bytes_per_token
    swa = info.swa_kv_bytes_per_token

    def of(kind: str, table: Mapping[str, int]) -> int:
        return table.get(kind, table.get("f16", 0))

    growing = (of(type_k, per) + of(type_v, per) - of(type_k, swa) - of(type_v, swa)) / 2
    return max(1, round(growing * PAGE_TOKENS))


def page_budget(kv_bytes: Mapping[str, int], n_ctx: int, n_seq: int, page_bytes: int, host_kv_bytes: int,
                window: int | None = None) -> PageBudget:
    """The pools of a context of ``n_seq`` sequences of ``n_ctx`` cells whose KV the plan puts on ``kv_bytes``'
    devices ('CPU' is the host).

    Args:
        page_bytes: a page's bytes over every layer (:func:`kv_page_bytes`); each device's pages cost its share.
        host_kv_bytes: RAM for KV pages on the host (:attr:`HostRam.kv_bytes`).
        window: cells per sequence kept on the KV devices, rounded down to a page; the rest go to the host
            pool. None: all of them (the worker's allocation today). Ignored when the plan keeps KV on the host.
    """
    if window is not None:  # a KV window (patch 0009): the host's bytes are the copy of every cell, the overflow
        kv_bytes = {d: b for d, b in kv_bytes.items() if d != "CPU"} or kv_bytes
    held = {(HOST if d == "CPU" else d): b for d, b in kv_bytes.items() if b > 0} or {HOST: 1}
    total = sum(held.values())
    on_host = HOST in held
    cells = n_ctx if window is None or on_host else min(n_ctx, max(0, window) // PAGE_TOKENS * PAGE_TOKENS)
    per_seq = math.ceil(cells / PAGE_TOKENS)
    pools: list[Pool] = []
    for name, b in sorted(held.items()):
        share = max(1, round(page_bytes * b / total))
        ram = host_kv_bytes // share if name == HOST else None
        pages = n_seq * per_seq if ram is None else min(n_seq * per_seq, ram)
        pools.append(Pool(name=name, role="window", page_tokens=PAGE_TOKENS, page_bytes=share, pages=pages,
                          ram_pages=ram))
    if not on_host:
        ram = host_kv_bytes // page_bytes
        over = n_seq * math.ceil((n_ctx - cells) / PAGE_TOKENS)
        pools.append(Pool(name=HOST, role="overflow", page_tokens=PAGE_TOKENS, page_bytes=page_bytes,
                          pages=min(over, ram), ram_pages=ram))
    return PageBudget(page_tokens=PAGE_TOKENS, n_ctx=n_ctx, n_seq=n_seq, window=cells, pools=tuple(pools),
                      host_kv_bytes=host_kv_bytes)


class PoolUse(_Frozen):
    """One pool as ``/flux/stats`` reports it."""

    name: str
    role: Literal["window", "overflow"]
    page_tokens: int
    page_bytes: int
    pages_total: int
    pages_used: int
    pages_free: int
    ram_pages: int | None


class Reservation(_Frozen):
    """The pages one admitted request holds, and the tokens they cover."""

    rid: str
    prompt_tokens: int
    tokens: int = Field(description="prompt plus the reply limit the pages cover")
    pages: dict[str, int]

    @property
    def reply_tokens(self) -> int:
        """The reply's limit: what the reserved pages leave after the prompt."""
        return self.tokens - self.prompt_tokens


class PageLedger:
    """The pages each running request holds, against the pools of one budget (not thread-safe: the server's
    event loop is its one user)."""

    def __init__(self, budget: PageBudget) -> None:
        """Every page free."""
        self.budget = budget
        self._held: dict[str, Reservation] = {}

    def used(self) -> dict[str, int]:
        """Pages held, by pool."""
        out = {p.name: 0 for p in self.budget.pools}
        for r in self._held.values():
            for name, n in r.pages.items():
                out[name] += n
        return out

    def free(self) -> dict[str, int]:
        """Pages free, by pool."""
        used = self.used()
        return {p.name: p.pages - used[p.name] for p in self.budget.pools}

    def reserve(self, rid: str, prompt: int, least: int, most: int) -> Reservation:
        """Hold pages for ``rid``: for ``most`` tokens (prompt plus reply limit) when free pages allow, else for
        as many as they allow, at least ``least`` (prompt plus the reply room it must leave).

        Raises:
            PagesExhausted: the free pages cannot cover ``least`` tokens (nothing is held then).
        """
        self.release(rid)
        fit = self.budget.tokens_fit(self.free())
        tokens = min(most, fit)
        if tokens < least:
            total = self.budget.tokens_fit({p.name: p.pages for p in self.budget.pools})
            raise PagesExhausted(prompt, least - prompt, self.budget.n_ctx, fit, total)
        held = Reservation(rid=rid, prompt_tokens=prompt, tokens=tokens, pages=self.budget.pages_for(tokens))
        self._held[rid] = held
        return held

    def release(self, rid: str) -> None:
        """Give back ``rid``'s pages (nothing when it holds none: every ending calls this once or more)."""
        self._held.pop(rid, None)

    @property
    def holders(self) -> int:
        """Requests holding pages."""
        return len(self._held)

    def summary(self) -> dict[str, Any]:
        """``/flux/stats``' ``kv_pages``: the page size, the window, the host's RAM for KV and every pool."""
        b = self.budget
        return {"page_tokens": b.page_tokens, "n_ctx": b.n_ctx, "n_seq": b.n_seq, "window": b.window,
                "host_kv_bytes": b.host_kv_bytes, "requests": self.holders,
                "pools": [u.model_dump() for u in self.report()]}

    def report(self) -> list[PoolUse]:
        """Every pool's pages: total, used, free."""
        used = self.used()
        return [PoolUse(name=p.name, role=p.role, page_tokens=p.page_tokens, page_bytes=p.page_bytes,
                        pages_total=p.pages, pages_used=used[p.name], pages_free=p.pages - used[p.name],
                        ram_pages=p.ram_pages) for p in self.budget.pools]


def memlock_warning(budget: PageBudget, limit: int | None = None) -> str | None:
    """One line when the host pages a GPU reads need more pinned memory than RLIMIT_MEMLOCK allows (``limit``:
    the soft limit, read from this process when None); None when they fit or none are needed."""
    need = budget.pinned_bytes()
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] if limit is None else limit
    if need == 0 or soft == resource.RLIM_INFINITY or need <= soft:
        return None
    return (f"KV pages: the host pool's {need / GIB:.2f} GiB should be pinned for the GPU to read, beyond the "
            f"locked-memory limit RLIMIT_MEMLOCK of {soft // 1024} KiB (`ulimit -l`): raise it to at least "
            f"{-(-need // 1024)} KiB or to unlimited (`ulimit -l unlimited`, memlock in /etc/security/limits.conf, "
            "LimitMEMLOCK= of a systemd unit); serving with those pages in pageable memory, which the GPU reads "
            "more slowly (not measured here)")
