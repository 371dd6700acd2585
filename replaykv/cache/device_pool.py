"""Ledger 1: the device KV pool, paged by global-KV chunk.

For: accounting device memory for global KV in pages of one chunk each, sharing cached prefix
pages between concurrent requests by reference count, evicting unreferenced cached pages in LRU
order, and charging each running request's window rings against the same budget. Pages hold a
payload (a :class:`~replaykv.cache.layout.GlobalChunk`, or bytes) so a prefix hit can be copied
into a request's :class:`~replaykv.model.cache_view.CacheView` (the model reads contiguous
per-request tensors; copying hit pages into them is how a hit is loaded).

Not for: the model's tensors (views own those), persistence (``cache/store.py``), window
snapshots (``cache/swa_pool.py``) or choosing keys (``cache/keys.py``).

Page states (every page is in exactly one)::

    free     refcount 0, no key, no payload          -> allocate
    used     refcount > 0 (a request holds it)       -> free() drops a reference
    cached   refcount 0, keyed, payload kept (LRU)   -> match_prefix() revives, eviction frees

Conservation: free + used + cached == capacity (``check_integrity``).

A page is charged :attr:`CacheLayout.resident_page_bytes`, the memory its payload really takes
(a chunk's tensors at the cache dtype, not its packed wire size), so ``budget_bytes`` bounds
what the pool keeps alive; ``write`` refuses a payload larger than one page.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence

import torch

from replaykv.cache.faultlog import FaultLog
from replaykv.cache.keys import KEY_BYTES
from replaykv.cache.layout import CacheLayout, GlobalChunk
from replaykv.cache.metrics import Gauge, TierMetrics

__all__ = ["DevicePool", "PoolExhausted", "resident_bytes"]

log = logging.getLogger(__name__)


def resident_bytes(payload: object) -> int:
    """Memory held by a page payload: the bytes of its tensors (a chunk), or its length (bytes)."""
    if isinstance(payload, torch.Tensor):
        return payload.untyped_storage().nbytes()
    if isinstance(payload, bytes | bytearray | memoryview):
        return len(payload)
    if isinstance(payload, GlobalChunk):
        parts: list[torch.Tensor | None] = []
        for g in payload.sources:
            parts += [g.entries, g.index_keys]
        for c in payload.carry:
            parts += [c.kv, c.gate, c.index_kv, c.index_gate]
        return sum(resident_bytes(t) for t in parts if t is not None)
    return 0


class PoolExhausted(MemoryError):
    """``allocate`` asked for more pages than are free or evictable (check ``can_allocate`` first)."""


class DevicePool:
    """Chunk pages within ``budget_bytes``; one page = :attr:`CacheLayout.resident_page_bytes`.

    * ``can_allocate(n)`` / ``allocate(n)``: pages with refcount 1, evicting cached pages (least
      recently used first) when the free list runs short; ``allocate`` raises
      :class:`PoolExhausted` when ``can_allocate`` is false.
    * ``free(pages)``: drop one reference each; a page reaching 0 becomes cached (if keyed) or
      free. Pages freed together are queued so the later ones (the prefix's tail) go first.
    * ``cache_prefix(keys, pages)``: name pages by chunk key (the caller still holds them);
      ``match_prefix(keys)``: the longest run of keys from the first one that has pages, with a
      reference taken on each (release with ``free``). ``contains(key)`` is a hint.
    * ``reserve_window(owner, nbytes)`` / ``release_window(owner)``: a running request's window
      rings, charged as whole pages.

    All methods are safe to call from several threads (one lock).
    """

    def __init__(self, layout: CacheLayout, budget_bytes: int) -> None:
        page = layout.resident_page_bytes
        if page <= 0:
            raise ValueError("the model has no global KV, so there is nothing to page")
        if budget_bytes < page:
            raise ValueError(
                f"budget_bytes {budget_bytes} is smaller than one page ({page} B = one {layout.chunk_size}-token "
                "chunk of global KV); raise the budget or lower the chunk size"
            )
        self.layout = layout
        self.page_bytes = page
        self.budget_bytes = budget_bytes
        self.capacity = budget_bytes // page
        self._lock = threading.RLock()
        self._free: list[int] = list(range(self.capacity - 1, -1, -1))  # pop() hands out page 0 first
        self._ref = [0] * self.capacity
        self._key: dict[int, bytes] = {}
        self._page: dict[bytes, int] = {}
        self._payload: dict[int, object] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages, least recently used first
        self._windows: dict[Hashable, tuple[list[int], int]] = {}  # owner -> (pages, bytes)
        self.metrics = TierMetrics("device_pool")
        self._faults = FaultLog(log, f"device pool ({self.capacity} pages of {self.page_bytes} B)")
        self.window_bytes = Gauge()

    # ---------------------------------------------------------------- allocation
    def _evictable(self) -> int:
        return len(self._free) + len(self._lru)

    def can_allocate(self, n: int) -> bool:
        with self._lock:
            return 0 <= n <= self._evictable()

    def _evict_one_locked(self) -> None:
        page, _ = self._lru.popitem(last=False)
        key = self._key.pop(page)
        del self._page[key]
        self._payload.pop(page, None)
        self._free.append(page)
        self.metrics.evictions.inc()
        self.metrics.entries.dec()
        self.metrics.bytes_resident.dec(self.page_bytes)

    def allocate(self, n: int) -> list[int]:
        """``n`` pages, each with refcount 1 and no payload."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        with self._lock:
            if n > self._evictable():
                message = f"{n} pages asked, {len(self._free)} free + {len(self._lru)} evictable of {self.capacity}"
                self._faults.failed("exhausted", f"the pool cannot hold a request's pages: {message}")
                raise PoolExhausted(message)
            self._faults.recovered()
            while len(self._free) < n:
                self._evict_one_locked()
            pages = [self._free.pop() for _ in range(n)]
            for p in pages:
                self._ref[p] = 1
            self.metrics.bytes_resident.inc(n * self.page_bytes)
            return pages

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference on each page (a page listed twice loses two)."""
        with self._lock:
            for p, times in Counter(pages).items():
                self._check_page(p)
                if self._ref[p] < times:
                    raise ValueError(
                        f"page {p} has {self._ref[p]} references, {times} released; double free?"
                    )
            # Later pages of a prefix are evicted first: they join the LRU before the earlier ones.
            for p in reversed(pages):
                self._ref[p] -= 1
                if self._ref[p]:
                    continue
                if p in self._key:
                    self._lru[p] = None  # most recent, but behind the later pages of its prefix
                else:
                    self._payload.pop(p, None)
                    self._free.append(p)
                    self.metrics.bytes_resident.dec(self.page_bytes)

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self.capacity:
            raise IndexError(f"page {page} is outside the pool's {self.capacity} pages")

    # ---------------------------------------------------------------- payloads
    def write(self, page: int, payload: object) -> None:
        """Set the payload of a page the caller holds (a chunk's global KV).

        Raises ``ValueError`` when the payload takes more memory than a page.
        """
        size = resident_bytes(payload)
        if size > self.page_bytes:
            raise ValueError(f"a payload of {size} B does not fit a page of {self.page_bytes} B")
        with self._lock:
            self._check_page(page)
            if self._ref[page] <= 0:
                raise ValueError(f"page {page} is not held; allocate it first")
            self._payload[page] = payload
        self.metrics.record_put(True, self.page_bytes)

    def payload(self, page: int) -> object | None:
        with self._lock:
            self._check_page(page)
            return self._payload.get(page)

    # ---------------------------------------------------------------- prefixes
    def cache_prefix(self, keys: Sequence[bytes], pages: Sequence[int]) -> int:
        """Name ``pages[i]`` by ``keys[i]``; returns how many were newly named.

        A key already naming another page keeps that page (the new one stays unnamed and is freed
        normally). Pages must be held and carry a payload.
        """
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        named = 0
        with self._lock:
            for key, p in zip(keys, pages, strict=True):
                self._check_page(p)
                if not isinstance(key, bytes) or len(key) != KEY_BYTES:
                    raise ValueError(f"page keys are {KEY_BYTES}-byte chunk keys")
                if self._ref[p] <= 0 or p not in self._payload:
                    raise ValueError(f"page {p} must be held and written before it is cached")
                if key in self._page or p in self._key:
                    continue
                self._key[p] = key
                self._page[key] = p
                self.metrics.entries.inc()
                named += 1
        return named

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._page

    def peek_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys have pages now; no reference, no recency change, no metrics."""
        with self._lock:
            n = 0
            for key in keys:
                if key not in self._page:
                    break
                n += 1
            return n

    def match_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """Pages of the longest run of leading keys that are cached, each with one more reference.

        Metrics: one hit per matched page, one miss when the run stops before the last key.
        """
        with self._lock:
            pages = []
            for key in keys:
                p = self._page.get(key)
                if p is None:
                    break
                if self._ref[p] == 0:
                    del self._lru[p]
                self._ref[p] += 1
                pages.append(p)
        for _ in pages:
            self.metrics.record_hit(self.page_bytes)
        if len(pages) < len(keys):
            self.metrics.record_miss()
        return pages

    def evict_unreferenced(self, n: int | None = None) -> int:
        """Evict up to ``n`` (default all) cached pages nobody holds, LRU first; returns how many."""
        with self._lock:
            count = 0
            while self._lru and (n is None or count < n):
                self._evict_one_locked()
                count += 1
            return count

    # ---------------------------------------------------------------- window rings
    def window_pages(self, nbytes: int) -> int:
        return math.ceil(nbytes / self.page_bytes) if nbytes > 0 else 0

    def can_reserve_window(self, nbytes: int) -> bool:
        return self.can_allocate(self.window_pages(nbytes))

    def reserve_window(self, owner: Hashable, nbytes: int | None = None) -> bool:
        """Charge ``owner``'s window rings (default: the layout's largest snapshot) as pages.

        ``False`` when the budget cannot hold them (an earlier reservation of ``owner`` is then
        kept); re-reserving replaces the earlier reservation.
        """
        size = self.layout.max_snapshot_bytes if nbytes is None else nbytes
        with self._lock:
            need = self.window_pages(size)
            old = self._windows.get(owner)
            if need > self._evictable() + (len(old[0]) if old is not None else 0):
                self._faults.failed(
                    "window", f"{need} pages of window rings refused: {self._evictable()} free or evictable"
                )
                return False
            self.release_window(owner)
            pages = self.allocate(need)
            self._windows[owner] = (pages, size)
            self.window_bytes.inc(size)
            return True

    def release_window(self, owner: Hashable) -> bool:
        with self._lock:
            held = self._windows.pop(owner, None)
            if held is None:
                return False
            self.free(held[0])
            self.window_bytes.dec(held[1])
            return True

    # ---------------------------------------------------------------- introspection
    def counts(self) -> dict[str, int]:
        """Pages by state: free, used (referenced), cached (unreferenced, keyed), window."""
        with self._lock:
            used = sum(1 for r in self._ref if r > 0)
            window = sum(len(p) for p, _ in self._windows.values())
            return {"free": len(self._free), "used": used, "cached": len(self._lru), "window": window}

    def stats(self) -> dict[str, object]:
        out = self.metrics.as_dict()
        out.update(self.counts())
        out.update(
            capacity_pages=self.capacity,
            page_bytes=self.page_bytes,
            budget_bytes=self.budget_bytes,
            window_bytes=self.window_bytes.value,
            window_owners=len(self._windows),
        )
        return out

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless free + used + cached == capacity and the maps agree."""
        self.metrics.check()
        with self._lock:
            free = set(self._free)
            cached = set(self._lru)
            used = {p for p, r in enumerate(self._ref) if r > 0}
            if len(free) != len(self._free):
                raise AssertionError("a page is on the free list twice")
            if free & cached or free & used or cached & used:
                raise AssertionError("a page is in two states at once")
            if len(free) + len(used) + len(cached) != self.capacity:
                raise AssertionError(
                    f"free {len(free)} + used {len(used)} + cached {len(cached)} != capacity {self.capacity}"
                )
            if any(r < 0 for r in self._ref):
                raise AssertionError("negative refcount")
            if any(p in self._key or p in self._payload for p in free):
                raise AssertionError("a free page keeps a key or a payload")
            if not all(p in self._key and p in self._payload for p in cached):
                raise AssertionError("a cached page lost its key or payload")
            if {self._page[k] for k in self._page} != set(self._key) or any(
                self._page[k] != p for p, k in self._key.items()
            ):
                raise AssertionError("key -> page and page -> key maps disagree")
            window_pages = [p for pages, _ in self._windows.values() for p in pages]
            if len(set(window_pages)) != len(window_pages) or any(
                self._ref[p] < 1 or p in self._key for p in window_pages
            ):
                raise AssertionError("window pages must be held, unnamed and distinct")
            if self.window_bytes.value != sum(b for _, b in self._windows.values()):
                raise AssertionError("window_bytes gauge disagrees with the reservations")
            resident = (len(used) + len(cached)) * self.page_bytes
            if self.metrics.bytes_resident.value != resident:
                raise AssertionError(f"bytes_resident {self.metrics.bytes_resident.value} != {resident}")
            if self.metrics.entries.value != len(self._key):
                raise AssertionError(
                    f"entries gauge {self.metrics.entries.value} != {len(self._key)} keyed pages"
                )
