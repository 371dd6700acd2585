"""DevicePool: sizing from the layout, refcounts, LRU eviction, prefixes, window rings, a model-based test."""

from __future__ import annotations

import hashlib
import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from replaykv.cache.device_pool import DevicePool, PoolExhausted
from replaykv.cache.layout import CacheLayout
from replaykv.model.accounting import kv_ledger
from replaykv.model.presets_v41 import v41_tiny
from replaykv.model.spec import ModelSpec


def layout(quant: bool = False) -> CacheLayout:
    return CacheLayout(ModelSpec.from_config(v41_tiny()), chunk_size=8, kv_quant=quant)


def k(i: int) -> bytes:
    return hashlib.sha256(b"chunk-%d" % i).digest()


def test_sizing_from_layout_and_accounting() -> None:
    lay = layout(quant=True)
    pool = DevicePool(lay, budget_bytes=10 * lay.resident_page_bytes + 5)
    assert lay.page_bytes == kv_ledger(v41_tiny()).global_bytes(8)
    assert pool.page_bytes == lay.resident_page_bytes > lay.page_bytes  # float32 tensors, not FP4
    assert pool.capacity == 10
    assert pool.counts() == {"free": 10, "used": 0, "cached": 0, "window": 0}
    with pytest.raises(ValueError, match="smaller than one page"):
        DevicePool(lay, budget_bytes=lay.resident_page_bytes - 1)
    pool.check_integrity()


def test_exhaustion_and_a_refused_window_are_logged_once_then_recovery(caplog: pytest.LogCaptureFixture) -> None:
    lay = layout()
    pool = DevicePool(lay, budget_bytes=2 * lay.resident_page_bytes)
    held = pool.allocate(2)
    with caplog.at_level("WARNING", logger="replaykv.cache.device_pool"):
        for _ in range(3):
            with pytest.raises(PoolExhausted):
                pool.allocate(1)
        assert not pool.reserve_window("req", nbytes=lay.resident_page_bytes)
    failures = [r for r in caplog.records if "cannot hold" in r.getMessage()]
    assert len(failures) == 1, caplog.messages  # rate-limited while it persists
    assert "1 pages asked, 0 free + 0 evictable of 2" in failures[0].getMessage()
    assert any("window rings refused" in m for m in caplog.messages), caplog.messages
    caplog.clear()
    pool.free(held)
    with caplog.at_level("WARNING", logger="replaykv.cache.device_pool"):
        pool.allocate(1)
    assert len(caplog.records) == 1 and "exhausted" in caplog.messages[0], caplog.messages
    pool.check_integrity()


def test_allocate_free_cache_match_and_refcounts() -> None:
    pool = DevicePool(layout(), budget_bytes=4 * layout().resident_page_bytes)
    assert pool.can_allocate(4) and not pool.can_allocate(5)
    pages = pool.allocate(3)
    for i, p in enumerate(pages):
        pool.write(p, f"payload-{i}")
    assert pool.cache_prefix([k(0), k(1), k(2)], pages) == 3
    assert pool.peek_prefix([k(0), k(1), k(9)]) == 2
    # A second request shares the first two pages.
    shared = pool.match_prefix([k(0), k(1), k(7)])
    assert shared == pages[:2]
    pool.check_integrity()
    pool.free(pages)  # first request done: page 2 becomes cached, 0 and 1 are still held
    assert pool.counts() == {"free": 1, "used": 2, "cached": 1, "window": 0}
    pool.free(shared)
    assert pool.counts() == {"free": 1, "used": 0, "cached": 3, "window": 0}
    assert pool.payload(pages[1]) == "payload-1"
    stats = pool.stats()
    assert (stats["hits"], stats["misses"], stats["gets"]) == (2, 1, 3)
    with pytest.raises(ValueError, match="double free"):
        pool.free([pages[0]])
    pool.check_integrity()


def test_lru_evicts_unreferenced_tail_first() -> None:
    pool = DevicePool(layout(), budget_bytes=4 * layout().resident_page_bytes)
    a = pool.allocate(3)
    for p in a:
        pool.write(p, p)
    pool.cache_prefix([k(0), k(1), k(2)], a)
    pool.free(a)  # the tail (k2) is queued first, so it goes first
    b = pool.allocate(2)  # 1 free + evicts k2
    assert pool.peek_prefix([k(0), k(1), k(2)]) == 2
    held = pool.match_prefix([k(0)])  # a referenced page is never evicted
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    c = pool.allocate(1)  # evicts k1 (k0 is held)
    assert pool.contains(k(0)) and not pool.contains(k(1))
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    assert pool.stats()["evictions"] == 2
    pool.free(b + c + held)
    assert pool.evict_unreferenced() == 1
    assert pool.counts()["free"] == 4
    pool.check_integrity()


def test_cache_prefix_keeps_the_first_page_for_a_key() -> None:
    pool = DevicePool(layout(), budget_bytes=4 * layout().resident_page_bytes)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.write(a[0], "a")
    pool.write(b[0], "b")
    assert pool.cache_prefix([k(0)], a) == 1
    assert pool.cache_prefix([k(0)], b) == 0  # duplicate content: b stays private and is freed
    pool.free(a + b)
    assert pool.counts() == {"free": 3, "used": 0, "cached": 1, "window": 0}
    with pytest.raises(ValueError, match="held and written"):
        pool.cache_prefix([k(1)], [a[0]])
    pool.check_integrity()


def test_window_rings_are_charged_against_the_budget() -> None:
    lay = layout(quant=True)
    need = -(-lay.max_snapshot_bytes // lay.resident_page_bytes)
    spare = need - 1  # req-2 needs `need` pages: one short
    pool = DevicePool(lay, budget_bytes=(need + spare) * lay.resident_page_bytes)
    assert pool.window_pages(lay.max_snapshot_bytes) == need
    assert pool.reserve_window("req-1")
    assert pool.counts()["window"] == need
    assert pool.stats()["window_bytes"] == lay.max_snapshot_bytes
    assert not pool.reserve_window("req-2")  # does not fit next to req-1: nothing charged
    assert pool.stats()["window_owners"] == 1
    assert pool.can_allocate(spare) and not pool.can_allocate(spare + 1)
    assert pool.release_window("req-1") and not pool.release_window("req-1")
    assert pool.counts() == {"free": need + spare, "used": 0, "cached": 0, "window": 0}
    pool.check_integrity()


def test_concurrent_match_and_free() -> None:
    pool = DevicePool(layout(), budget_bytes=16 * layout().resident_page_bytes)
    pages = pool.allocate(8)
    for p in pages:
        pool.write(p, p)
    keys = [k(i) for i in range(8)]
    pool.cache_prefix(keys, pages)
    pool.free(pages)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(200):
                got = pool.match_prefix(keys[:5])
                extra = pool.allocate(1) if pool.can_allocate(1) else []
                pool.free(got + extra)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    pool.check_integrity()
    assert pool.counts()["used"] == 0


class DevicePoolMachine(RuleBasedStateMachine):
    """Random allocate / write / cache / match / free / evict / window sequences against a simple model."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = DevicePool(layout(), budget_bytes=6 * layout().resident_page_bytes)
        self.held: list[list[int]] = []  # references held by fake requests
        self.windows: set[int] = set()

    @rule(n=st.integers(0, 4))
    def allocate(self, n: int) -> None:
        if self.pool.can_allocate(n):
            pages = self.pool.allocate(n)
            assert len(set(pages)) == n
            for p in pages:
                self.pool.write(p, ("data", p))
            self.held.append(pages)
        else:
            with pytest.raises(PoolExhausted):
                self.pool.allocate(n)

    @precondition(lambda self: bool(self.held))
    @rule(i=st.integers(0, 10), first=st.integers(0, 6))
    def cache(self, i: int, first: int) -> None:
        pages = self.held[i % len(self.held)]
        self.pool.cache_prefix([k(first + j) for j in range(len(pages))], pages)

    @rule(first=st.integers(0, 6), n=st.integers(1, 4))
    def match(self, first: int, n: int) -> None:
        keys = [k(first + j) for j in range(n)]
        expect = self.pool.peek_prefix(keys)
        pages = self.pool.match_prefix(keys)
        assert len(pages) == expect
        for p in pages:
            assert self.pool.payload(p) is not None
        self.held.append(pages)

    @precondition(lambda self: bool(self.held))
    @rule(i=st.integers(0, 10))
    def free(self, i: int) -> None:
        self.pool.free(self.held.pop(i % len(self.held)))

    @rule(n=st.none() | st.integers(0, 3))
    def evict(self, n: int | None) -> None:
        self.pool.evict_unreferenced(n)

    @rule(owner=st.integers(0, 2), pages=st.integers(1, 3))
    def window(self, owner: int, pages: int) -> None:
        if self.pool.reserve_window(owner, pages * self.pool.page_bytes):
            self.windows.add(owner)

    @rule(owner=st.integers(0, 2))
    def release(self, owner: int) -> None:
        assert self.pool.release_window(owner) == (owner in self.windows)
        self.windows.discard(owner)

    @invariant()
    def integrity(self) -> None:
        self.pool.check_integrity()
        counts = self.pool.counts()
        referenced = {p for pages in self.held for p in pages}
        assert counts["used"] == len(referenced) + counts["window"]


TestDevicePoolMachine = DevicePoolMachine.TestCase
TestDevicePoolMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
