"""The cache manager: the only caller of the three ledgers (device pool, SWA pool, global-KV store).

For: answering ``lookup(tokens, salt) -> CachePlan`` (how far the global KV hits on device and in
the store, whether a window snapshot exists exactly there, and why not), ``load(plan, view)``
(bringing the hit into a request's :class:`~replaykv.model.cache_view.CacheView`, falling back to
the longest verified shorter prefix when an entry vanished or fails verification in between), and
write-back ``commit(...)`` on a bounded background queue that never blocks the request.

Not for: deciding how to prefill after a partial hit (``replay.py``), running the model, or the
byte format (``cache/layout.py``).

Alignment rules (V4.1 reference §13.7; "turn boundaries are first-class"):

1. Chunks. The chunk size C is a multiple of every KV source's ratio (``CacheLayout`` refuses
   anything else), so a chunk boundary ends a group of every source and a complete chunk holds
   whole groups. Chunk i covers tokens ``[i·C, (i+1)·C)``; its key is ``keys.chunk_keys``'s i-th
   key (SHA-256 chained from the namespace seed over the token ids).
2. Any position can be shared. At a turn boundary H (``commit(..., at_turn_end=True)``) the
   manager also writes a *tail* entry: the complete groups in ``[⌊H/C⌋·C, H)`` plus the pending
   compressor rows of every ratio > 1 source at H (fp32; V4's overlapping compressors also keep
   the previous group's rows, so V4 writes a tail even at a chunk-aligned H). An odd H for V4.1's
   ratio-2 sources is therefore exact, never rounded down. V4.1 at a chunk-aligned H needs no
   carry and writes no tail. Tails go to the store and are cached on the device pool like
   chunks, so turn boundaries hit without a store too.
3. Keys. Tail (store): ``SHA-256(b"RKV-TAIL\\0\\0" ‖ prefix_key(tokens[:H]))``. Window snapshot
   (SWA pool): ``prefix_key(tokens[:H])``; under the ``"v4"`` write policy it is also persisted in
   the store under ``SHA-256(b"RKV-SNAP\\0\\0" ‖ prefix_key(tokens[:H]))``. The ``"v41"`` policy
   never puts a snapshot on disk.
4. Namespace. Every key is derived from a :class:`~replaykv.cache.keys.KeyNamespace` holding the
   model config digest, weights digest, layout version, KV encodings, compression schedule, chunk
   size and the tenant salt; the manager refuses a base namespace that does not match its layout.
   Every blob also records the namespace digest and its token range, checked on load.
5. The hit. H = the longest run of complete chunks from chunk 0 found on device or in the store,
   extended by the longest tail entry in ``[that, that + C)``; by default H ≤ len(tokens) − 1 so
   the request computes at least its last token. The snapshot counts only exactly at H.
6. Races. An entry that vanishes (eviction, expiry) or fails verification between lookup and load
   shortens the hit to the last verified chunk boundary; a snapshot is then looked for there.

``load`` never changes ``view.positions`` (the runner owns positions): after a load with
``snapshot_at_hit`` and ``carry_at_hit`` the row continues exactly at ``plan.hit_tokens``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from replaykv.cache.device_pool import DevicePool
from replaykv.cache.faultlog import FaultLog
from replaykv.cache.keys import (
    ImageKeyPart,
    KeyNamespace,
    PrefixKeyBuilder,
    TokenIds,
    prefix_key_from_parent,
    token_array,
)
from replaykv.cache.layout import (
    CacheLayout,
    GlobalChunk,
    LayoutError,
    WindowSnapshot,
    extract_chunk,
    extract_snapshot,
    extract_tail,
    load_chunk,
    load_snapshot,
)
from replaykv.cache.metrics import Counter, Histogram, LabeledCounter
from replaykv.cache.store import EntryMeta, GlobalKVStore
from replaykv.cache.swa_pool import SwaPool
from replaykv.model.cache_view import CacheView
from replaykv.model.spec import ModelSpec

__all__ = ["WRITE_POLICIES", "CacheManager", "CachePlan", "snapshot_store_key", "tail_store_key"]

log = logging.getLogger(__name__)

WRITE_POLICIES = ("v41", "v4")
"""``v41``: window snapshots go to the SWA pool only. ``v4``: also persisted in the store."""

# A load hints the store to read in its chunks this many at a time (``prefetch``).
STORE_READ_AHEAD = 16

_TAIL_TAG = b"RKV-TAIL\x00\x00"
_SNAPSHOT_TAG = b"RKV-SNAP\x00\x00"


def tail_store_key(prefix: bytes) -> bytes:
    """Store key of the tail entry at the end of ``prefix`` (a ``keys.prefix_key``)."""
    return hashlib.sha256(_TAIL_TAG + prefix).digest()


def snapshot_store_key(prefix: bytes) -> bytes:
    """Store key of a window snapshot persisted under the ``"v4"`` write policy."""
    return hashlib.sha256(_SNAPSHOT_TAG + prefix).digest()


def _prefix_key(parent: bytes, tail: np.ndarray) -> bytes:
    """``keys.prefix_key`` computed from the last complete chunk's key (or the seed) and the tail."""
    return prefix_key_from_parent(parent, tail)


@dataclass(frozen=True)
class CachePlan:
    """What the cache holds for one request (``lookup``), or what was loaded (``load``).

    Token counts: ``tokens`` requested; ``device_hit_tokens`` covered by complete chunks on the
    device from chunk 0; ``store_hit_tokens`` covered by complete chunks when the store fills in
    after the device (chunks ``[device, store)`` come from the store); ``hit_tokens`` = H, the
    usable global-KV hit (``store_hit_tokens`` plus a tail entry at a turn boundary).
    ``tail_at_hit``: H is the end of a tail entry. ``snapshot_at_hit``: a window snapshot exists
    exactly at H. ``carry_at_hit``: the compressor rows needed at H are available (none needed,
    or in the tail or snapshot). ``reasons``: why each of these is not better, as short strings.
    """

    tokens: int
    device_hit_tokens: int
    store_hit_tokens: int
    hit_tokens: int
    tail_at_hit: bool
    snapshot_at_hit: bool
    carry_at_hit: bool
    reasons: tuple[str, ...] = ()
    loaded: bool = False
    chunk_size: int = 256
    chunk_sources: tuple[str, ...] = ()  # per chunk of [0, H // C): "device" or "store"
    snapshot_source: str | None = None  # "pool" or "store"
    namespace_digest: bytes = field(default=b"", repr=False)
    chunk_keys: tuple[bytes, ...] = field(default=(), repr=False)  # keys of chunks [0, H // C)
    prefix_key: bytes | None = field(default=None, repr=False)  # keys.prefix_key(tokens[:H])

    @property
    def miss_tokens(self) -> int:
        return self.tokens - self.hit_tokens

    @property
    def exact(self) -> bool:
        """The row can continue exactly at H after ``load`` (snapshot and carry present)."""
        return self.hit_tokens > 0 and self.snapshot_at_hit and self.carry_at_hit


@dataclass
class _WriteJob:
    namespace: KeyNamespace
    chunks: list[tuple[bytes, GlobalChunk]]
    tail: tuple[bytes, GlobalChunk] | None
    snapshot: tuple[bytes, WindowSnapshot] | None

    def keys(self) -> list[bytes]:
        out = [k for k, _ in self.chunks]
        if self.tail is not None:
            out.append(tail_store_key(self.tail[0]))
        return out


class _LedgerTokens:
    """Token counters of one ledger, with their denominators."""

    def __init__(self) -> None:
        self.lookups = Counter()
        self.requested_tokens = Counter()
        self.hit_tokens = Counter()
        self.loaded_tokens = Counter()

    def as_dict(self) -> dict[str, object]:
        req, hit = self.requested_tokens.value, self.hit_tokens.value
        return {
            "lookups": self.lookups.value,
            "requested_tokens": req,
            "hit_tokens": hit,
            "miss_tokens": req - hit,
            "hit_rate": hit / req if req else None,
            "loaded_tokens": self.loaded_tokens.value,
        }


class CacheManager:
    """Lookup, load and write-back over the device pool, the SWA pool and the global-KV store.

    Any tier may be ``None`` (off). ``namespace_base`` is the namespace of every key with a
    placeholder salt (build it with :meth:`CacheLayout.namespace`); each call's ``salt`` (set by
    the server per API key, never by the client) replaces it. ``layout`` defaults to the device
    pool's, else ``CacheLayout(spec, chunk_size)``. ``clock`` stamps blobs (snapshot age at hit).

    Thread safety: ``lookup``/``load``/``commit`` may be called from several threads; write-back
    runs on one background thread fed by a queue of ``queue_size`` jobs (a full queue drops the
    job and counts it). ``flush()`` waits for queued jobs; ``close()`` stops the thread.
    """

    def __init__(
        self,
        spec: ModelSpec,
        namespace_base: KeyNamespace,
        device_pool: DevicePool | None,
        swa_pool: SwaPool | None,
        store: GlobalKVStore | None,
        chunk_size: int = 256,
        write_policy: str = "v41",
        queue_size: int = 64,
        *,
        layout: CacheLayout | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}; got {write_policy!r}")
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1; got {queue_size}")
        if layout is None:
            layout = device_pool.layout if device_pool is not None else CacheLayout(spec, chunk_size)
        if layout.spec != spec or layout.chunk_size != chunk_size:
            raise ValueError(
                f"the layout (chunk size {layout.chunk_size}) does not match this manager's spec and chunk size "
                f"{chunk_size}; build the device pool and the manager from one CacheLayout"
            )
        if device_pool is not None and device_pool.layout != layout:
            raise ValueError("the device pool was built for another CacheLayout")
        layout.check_namespace(namespace_base)
        self.spec = spec
        self.layout = layout
        self.chunk_size = chunk_size
        self.namespace_base = namespace_base
        self.device_pool = device_pool
        self.swa_pool = swa_pool
        self.store = store
        self.write_policy = write_policy
        self._clock = clock
        self._namespaces: dict[bytes, KeyNamespace] = {}
        self._ns_lock = threading.Lock()
        where = getattr(store, "root", None)
        self._load_faults = FaultLog(log, f"cache loads (store {where})" if where else "cache loads")
        self._write_faults = FaultLog(log, "cache write-back")
        # metrics
        self.requests = _LedgerTokens()
        self.device_tokens = _LedgerTokens()
        self.store_tokens = _LedgerTokens()
        self.snapshot_found = Counter()
        self.snapshot_loaded = Counter()
        # The SWA ledger by window rows: a lookup at H wants the min(W, H) rows before H.
        self.window_tokens = _LedgerTokens()
        self.snapshot_age_s = Histogram()
        self.loads = Counter()
        self.fallbacks = Counter()
        self.errors = LabeledCounter()
        self.jobs_submitted = Counter()
        self.jobs_enqueued = Counter()
        self.jobs_dropped = Counter()
        self.jobs_done = Counter()
        self.jobs_failed = Counter()
        self.written: dict[str, Counter] = {
            name: Counter()
            for name in (
                "chunks", "chunk_bytes", "tails", "tail_bytes", "snapshots_pool", "snapshot_pool_bytes",
                "snapshots_store", "snapshot_store_bytes", "device_pages",
            )
        }  # fmt: skip
        # write-back
        self._pending: set[bytes] = set()
        self._pending_lock = threading.Lock()
        self._queue: queue.Queue[_WriteJob | None] = queue.Queue(maxsize=queue_size)
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="replaykv-cache-writer", daemon=True)
        self._worker.start()

    # ---------------------------------------------------------------- keys
    def namespace(self, salt: bytes | str) -> KeyNamespace:
        """The base namespace with this tenant's salt."""
        raw = salt.encode("utf-8", "surrogatepass") if isinstance(salt, str) else bytes(salt)
        with self._ns_lock:
            ns = self._namespaces.get(raw)
            if ns is None:
                if len(self._namespaces) >= 1024:
                    self._namespaces.clear()
                ns = dataclasses.replace(self.namespace_base, tenant_salt=raw)
                self._namespaces[raw] = ns
            return ns

    def _boundary_prefix_key(self, keys: tuple[bytes, ...], h: int) -> bytes:
        """prefix_key(tokens[:h]) for a chunk-aligned h > 0, from the chunk keys alone."""
        return prefix_key_from_parent(keys[h // self.chunk_size - 1], ())

    # ---------------------------------------------------------------- lookup
    def lookup(
        self,
        tokens: TokenIds,
        salt: bytes | str,
        *,
        max_hit_tokens: int | None = None,
        images: Sequence[ImageKeyPart] = (),
    ) -> CachePlan:
        """What the tiers hold for ``tokens`` under ``salt``; no data is read.

        ``max_hit_tokens`` caps H (default ``len(tokens) − 1``: the last token is always computed).
        ``images``: the prompt's image spans (start, length, content digest); keys hash them, so
        the same text with another image never hits.
        """
        ns = self.namespace(salt)
        builder = PrefixKeyBuilder(ns, tokens, images)
        n = int(builder.tokens.size)
        limit = max(0, n - 1 if max_hit_tokens is None else min(n, max_hit_tokens))
        c = self.chunk_size
        keys = builder.chunk_keys(limit // c * c)
        sources: list[str] = []
        for key in keys:
            if self.device_pool is not None and self.device_pool.contains(key):
                sources.append("device")
            elif self.store is not None and self.store.contains(key):
                sources.append("store")
            else:
                break
        device_hit = c * next((i for i, s in enumerate(sources) if s != "device"), len(sources))
        store_hit = c * len(sources)
        reasons: list[str] = []
        if store_hit < len(keys) * c:
            reasons.append(f"chunk {len(sources)} (tokens [{store_hit}, {store_hit + c})) is on no tier")
        if device_hit < store_hit:
            reasons.append(
                f"device holds tokens [0, {device_hit}); the store fills [{device_hit}, {store_hit})"
            )

        hit, tail, prefix = store_hit, False, None
        hi = min(limit, store_hit + c - 1)
        if self.store is not None or self.device_pool is not None:
            for h in range(hi, store_hit - 1, -1):
                if h == 0 or (h == store_hit and not self.layout.needs_carry(h)):
                    continue
                candidate = builder.prefix_key(h)  # chunks [0, store_hit) + tokens [store_hit, h)
                if self._tail_exists(tail_store_key(candidate)):
                    hit, tail, prefix = h, True, candidate
                    break
        if not tail and hi > store_hit:
            reasons.append(f"no turn-boundary tail entry in ({store_hit}, {hi}]")
        hit_keys = tuple(keys[: hit // c])
        if prefix is None and hit:
            prefix = self._boundary_prefix_key(hit_keys, hit)

        snapshot, snapshot_source = False, None
        if hit and prefix is not None:
            snapshot_source = self._snapshot_exists(prefix, reasons, hit)
            snapshot = snapshot_source is not None
            rows = min(hit, self.layout.spec.sliding_window)
            self.window_tokens.lookups.inc()
            self.window_tokens.requested_tokens.inc(rows)
            if snapshot:
                self.snapshot_found.inc()
                self.window_tokens.hit_tokens.inc(rows)
        elif limit:
            reasons.append("no global-KV hit")
        carry = not self.layout.needs_carry(hit) or tail or snapshot
        if not carry:
            reasons.append(
                f"compressor carry at {hit} is not cached (replay at least one group before {hit})"
            )

        self.requests.lookups.inc()
        self.requests.requested_tokens.inc(n)
        self.requests.hit_tokens.inc(hit)
        self.device_tokens.lookups.inc()
        self.device_tokens.requested_tokens.inc(limit)
        self.device_tokens.hit_tokens.inc(device_hit)
        self.store_tokens.lookups.inc()
        self.store_tokens.requested_tokens.inc(limit - device_hit)
        self.store_tokens.hit_tokens.inc(hit - device_hit)
        return CachePlan(
            tokens=n,
            device_hit_tokens=device_hit,
            store_hit_tokens=store_hit,
            hit_tokens=hit,
            tail_at_hit=tail,
            snapshot_at_hit=snapshot,
            carry_at_hit=carry,
            reasons=tuple(reasons),
            chunk_size=c,
            chunk_sources=tuple(sources[: hit // c]),
            snapshot_source=snapshot_source,
            namespace_digest=ns.seed(),
            chunk_keys=hit_keys,
            prefix_key=prefix,
        )

    def _snapshot_exists(self, prefix: bytes, reasons: list[str], hit: int) -> str | None:
        if self.swa_pool is not None and self.swa_pool.contains(prefix):
            return "pool"
        if (
            self.write_policy == "v4"
            and self.store is not None
            and self.store.contains(snapshot_store_key(prefix))
        ):
            return "store"
        if self.swa_pool is None:
            reasons.append("no SWA pool configured")
        elif getattr(self.swa_pool, "circuit_open", False):
            reasons.append("SWA pool unavailable")
        else:
            reasons.append(f"no window snapshot at {hit} (never written, expired or evicted)")
        return None

    # ---------------------------------------------------------------- load
    def _view_tokens(self, view: CacheView) -> int:
        caps = []
        for s in self.spec.sources:
            entries = view.layers[s].entries
            caps.append(0 if entries is None else int(entries.shape[1]) * self.spec.layers[s].ratio)
        return min(caps, default=0)

    def load(self, plan: CachePlan, view: CacheView, row: int = 0) -> CachePlan:
        """Copy the plan's hit into ``row`` of ``view``; returns the plan actually loaded.

        Chunks come from the device pool when it still has them, else from the store (and are then
        cached on the device); the tail and the snapshot follow when every chunk loaded. Anything
        missing or failing verification shortens the hit to the last good chunk boundary.
        """
        if plan.loaded:
            raise ValueError("this plan was already loaded; look up again for another view")
        self.loads.inc()
        c = self.chunk_size
        reasons = list(plan.reasons)
        target = plan.hit_tokens
        capacity = self._view_tokens(view)
        if target > capacity:
            target = capacity // c * c
            reasons.append(f"the view holds {capacity} tokens; hit cut to {target}")
        n_chunks = min(len(plan.chunk_keys), target // c)
        keys = plan.chunk_keys[:n_chunks]
        digest = plan.namespace_digest
        sources: list[str] = []
        pages = self.device_pool.match_prefix(keys) if self.device_pool is not None and keys else []
        try:
            for i, key in enumerate(keys):
                page = pages[i] if i < len(pages) else None
                if page is None and self.store is not None and (i - len(pages)) % STORE_READ_AHEAD == 0:
                    # The pages match a prefix, so every chunk from here on comes from the store:
                    # let it read the next few in while they are read one by one.
                    self.store.prefetch(keys[i : i + STORE_READ_AHEAD])
                chunk, source = self._fetch_chunk(key, i, page, digest, reasons)
                if chunk is None:
                    break
                load_chunk(self.layout, chunk, view, row)
                sources.append(source)
        finally:
            if pages and self.device_pool is not None:
                self.device_pool.free(pages)
        hit = len(sources) * c
        tail = False
        if len(sources) == n_chunks and plan.tail_at_hit and target == plan.hit_tokens:
            tail = self._load_tail(plan, view, row, reasons)
            if tail:
                hit = plan.hit_tokens
        if hit < plan.hit_tokens:
            self.fallbacks.inc()
            reasons.append(f"hit shortened from {plan.hit_tokens} to {hit} at load")
        snapshot_source = None
        if hit:
            prefix = plan.prefix_key if hit == plan.hit_tokens else None
            if prefix is None:  # a shortened hit is chunk-aligned and > 0
                prefix = self._boundary_prefix_key(plan.chunk_keys, hit)
            try_snapshot = plan.snapshot_at_hit or hit != plan.hit_tokens
            if try_snapshot:
                snapshot_source = self._load_snapshot(prefix, hit, digest, view, row, reasons)
        device_tokens = c * next((i for i, s in enumerate(sources) if s != "device"), len(sources))
        self.device_tokens.loaded_tokens.inc(device_tokens)
        self.store_tokens.loaded_tokens.inc(hit - device_tokens)
        self.requests.loaded_tokens.inc(hit)
        snapshot = snapshot_source is not None
        carry = not self.layout.needs_carry(hit) or tail or snapshot
        if not carry and plan.carry_at_hit:
            reasons.append(f"compressor carry at {hit} is not cached")
        return dataclasses.replace(
            plan,
            device_hit_tokens=device_tokens,
            store_hit_tokens=len(sources) * c,
            hit_tokens=hit,
            tail_at_hit=tail,
            snapshot_at_hit=snapshot,
            carry_at_hit=carry,
            reasons=tuple(reasons),
            loaded=True,
            chunk_sources=tuple(sources),
            snapshot_source=snapshot_source,
            chunk_keys=plan.chunk_keys[: len(sources)],
            prefix_key=(plan.prefix_key if hit == plan.hit_tokens else None) if hit else None,
        )

    def _fetch_chunk(
        self, key: bytes, index: int, page: int | None, digest: bytes, reasons: list[str]
    ) -> tuple[GlobalChunk | None, str]:
        c = self.chunk_size
        start, end = index * c, (index + 1) * c
        if page is not None:
            obj = self._verified_page(page, digest, start, end)
            if obj is not None:
                return obj, "device"
        if self.store is None:
            reasons.append(f"chunk {index} left the device between lookup and load")
            return None, ""
        data = self.store.get(key)
        if data is None:
            self.errors.inc("load:store_miss")
            reasons.append(f"chunk {index} vanished or failed its checksum between lookup and load")
            return None, ""
        try:
            chunk = GlobalChunk.from_bytes(self.layout, data, namespace_digest=digest, start=start, end=end)
        except LayoutError as exc:
            self.errors.inc(f"load:{exc.reason}")
            self.store.delete(key)
            self._load_faults.failed(
                f"load:{exc.reason}", f"chunk {key.hex()} failed verification ({exc.reason}); deleted it"
            )
            reasons.append(f"chunk {index} failed verification ({exc.reason}); deleted")
            return None, ""
        self._cache_on_device(key, chunk)
        return chunk, "store"

    def _verified_page(self, page: int, digest: bytes, start: int, end: int) -> GlobalChunk | None:
        """The global KV a held device page carries for tokens [start, end), or None (counted)."""
        assert self.device_pool is not None
        obj = self.device_pool.payload(page)
        if not isinstance(obj, GlobalChunk):
            return None
        try:
            obj.verify(self.layout, namespace_digest=digest, start=start, end=end)
        except LayoutError as exc:
            self.errors.inc(f"device:{exc.reason}")
            self._load_faults.failed(
                f"device:{exc.reason}", f"device page {page} failed verification ({exc.reason})"
            )
            return None
        return obj

    def _tail_exists(self, key: bytes) -> bool:
        """A tail entry is on the device (recently written or read) or in the store."""
        if self.device_pool is not None and self.device_pool.contains(key):
            return True
        return self.store is not None and self.store.contains(key)

    def _load_tail(self, plan: CachePlan, view: CacheView, row: int, reasons: list[str]) -> bool:
        if plan.prefix_key is None:
            return False
        key = tail_store_key(plan.prefix_key)
        c = self.chunk_size
        start = plan.hit_tokens // c * c
        pool = self.device_pool
        pages = pool.match_prefix([key]) if pool is not None else []
        if pages and pool is not None:
            try:
                obj = self._verified_page(pages[0], plan.namespace_digest, start, plan.hit_tokens)
                if obj is not None:
                    load_chunk(self.layout, obj, view, row)
                    return True
            finally:
                pool.free(pages)
        if self.store is None:
            reasons.append(f"tail entry at {plan.hit_tokens} left the device between lookup and load")
            return False
        data = self.store.get(key)
        if data is None:
            self.errors.inc("load:tail_miss")
            reasons.append(f"tail entry at {plan.hit_tokens} vanished or failed its checksum")
            return False
        try:
            tail = GlobalChunk.from_bytes(
                self.layout, data, namespace_digest=plan.namespace_digest, start=start, end=plan.hit_tokens
            )
        except LayoutError as exc:
            self.errors.inc(f"load:{exc.reason}")
            self.store.delete(key)
            self._load_faults.failed(
                f"load:{exc.reason}", f"tail {key.hex()} failed verification ({exc.reason}); deleted it"
            )
            reasons.append(f"tail entry failed verification ({exc.reason}); deleted")
            return False
        load_chunk(self.layout, tail, view, row)
        self._cache_on_device(key, tail)
        return True

    def _load_snapshot(
        self, prefix: bytes, hit: int, digest: bytes, view: CacheView, row: int, reasons: list[str]
    ) -> str | None:
        candidates: list[tuple[str, Callable[[], bytes | None], Callable[[], object]]] = []
        if self.swa_pool is not None:
            pool = self.swa_pool
            candidates.append(("pool", lambda: pool.get(prefix), lambda: pool.delete(prefix)))
        if self.write_policy == "v4" and self.store is not None:
            store, skey = self.store, snapshot_store_key(prefix)
            candidates.append(("store", lambda: store.get(skey), lambda: store.delete(skey)))
        for source, get, delete in candidates:
            data = get()
            if data is None:
                continue
            try:
                snap = WindowSnapshot.from_bytes(self.layout, data, namespace_digest=digest, end=hit)
            except LayoutError as exc:
                self.errors.inc(f"load:snapshot_{exc.reason}")
                self._load_faults.failed(
                    f"load:snapshot_{exc.reason}",
                    f"window snapshot {prefix.hex()} from the {source} failed verification ({exc.reason}); "
                    "deleted it",
                )
                delete()
                continue
            load_snapshot(self.layout, snap, view, row)
            self.snapshot_loaded.inc()
            self.window_tokens.loaded_tokens.inc(min(hit, self.layout.spec.sliding_window))
            self.snapshot_age_s.observe(max(0.0, self._clock() - snap.created_at))
            return source
        reasons.append(f"no window snapshot could be read at {hit}")
        return None

    # ---------------------------------------------------------------- write-back
    def commit(
        self,
        tokens: TokenIds,
        view: CacheView,
        row: int,
        salt: bytes | str,
        *,
        at_turn_end: bool,
        images: Sequence[ImageKeyPart] = (),
    ) -> bool:
        """Queue write-back of what ``row`` holds after processing ``tokens`` (its position = len).

        New complete chunks go to the store and the device cache; with ``at_turn_end`` also the
        tail entry at the end (store) and the window snapshot (SWA pool; store too under ``"v4"``).
        ``images``: the image spans of ``tokens`` (as for :meth:`lookup`).
        Call it with ``at_turn_end=True`` where a later request may continue: the end of the
        prefill and the end of the generation; ``False`` (e.g. every few chunks while decoding)
        writes complete chunks only.
        The row's state is copied now (cheap clones); packing and I/O run on the writer thread.
        Returns ``True`` if a job was queued, ``False`` if there was nothing new or the queue was
        full (dropped and counted).
        """
        if self._closed:
            raise RuntimeError("the cache manager is closed; write-back is off")
        arr = token_array(tokens)
        end = int(view.positions[row])
        if arr.size != end:
            raise ValueError(f"row {row} is at position {end} but {arr.size} tokens were given")
        ns = self.namespace(salt)
        digest = ns.seed()
        now = self._clock()
        builder = PrefixKeyBuilder(ns, arr, images)
        keys = builder.chunk_keys()
        chunks: list[tuple[bytes, GlobalChunk]] = []
        with self._pending_lock:
            for i, key in enumerate(keys):
                if key in self._pending or self._chunk_known(key):
                    continue
                chunks.append((key, extract_chunk(self.layout, view, row, i, digest, now)))
            tail = snapshot = None
            if at_turn_end and end:
                prefix = builder.prefix_key(end)
                needs_tail = end % self.chunk_size or self.layout.needs_carry(end)
                has_tier = self.store is not None or self.device_pool is not None
                if has_tier and needs_tail and tail_store_key(prefix) not in self._pending:
                    tail = (prefix, extract_tail(self.layout, view, row, digest, now))
                if self.swa_pool is not None or (self.write_policy == "v4" and self.store is not None):
                    snapshot = (prefix, extract_snapshot(self.layout, view, row, digest, now))
            if not chunks and tail is None and snapshot is None:
                return False
            job = _WriteJob(ns, chunks, tail, snapshot)
            self.jobs_submitted.inc()
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                self.jobs_dropped.inc()
                self.errors.inc("write:queue_full")
                self._write_faults.failed("queue_full", "the write-back queue is full: dropping writes")
                return False
            self.jobs_enqueued.inc()
            self._pending.update(job.keys())
        return True

    def _chunk_known(self, key: bytes) -> bool:
        if self.store is not None:
            return self.store.contains(key)
        return self.device_pool is not None and self.device_pool.contains(key)

    def _cache_on_device(self, key: bytes, chunk: GlobalChunk) -> None:
        pool = self.device_pool
        if pool is None or pool.contains(key) or not pool.can_allocate(1):
            return
        try:
            (page,) = pool.allocate(1)
        except MemoryError:  # taken by a concurrent allocation
            return
        try:
            pool.write(page, chunk)
            pool.cache_prefix([key], [page])
            self.written["device_pages"].inc()
        finally:
            pool.free([page])

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(job)
                self.jobs_done.inc()
                self._write_faults.recovered()
            except Exception as exc:  # never let one bad job stop write-back
                self.jobs_failed.inc()
                self.errors.inc(f"write:{type(exc).__name__}")
                self._write_faults.failed(
                    type(exc).__name__, f"a write-back job failed: {exc!r}", level=logging.ERROR
                )
            finally:
                if job is not None:
                    with self._pending_lock:
                        self._pending.difference_update(job.keys())
                self._queue.task_done()

    def _put_store(self, key: bytes, data: bytes, meta: EntryMeta, what: str) -> bool:
        assert self.store is not None
        ok = self.store.put(key, data, meta)
        if not ok:
            self.errors.inc(f"write:store_{what}_failed")
        return ok

    def _write(self, job: _WriteJob) -> None:
        meta = EntryMeta.for_namespace(job.namespace)
        if self.store is not None and job.chunks:
            blobs = [(key, chunk.to_bytes(self.layout)) for key, chunk in job.chunks]
            if len(blobs) > 1:  # one group commit; each chunk is still all-or-nothing on its own
                results = self.store.put_many(blobs, meta)
            else:
                results = [self.store.put(blobs[0][0], blobs[0][1], meta)]
            for (_, data), ok in zip(blobs, results, strict=True):
                if ok:
                    self.written["chunks"].inc()
                    self.written["chunk_bytes"].inc(len(data))
                else:
                    self.errors.inc("write:store_chunk_failed")
        for key, chunk in job.chunks:
            self._cache_on_device(key, chunk)
        if job.tail is not None:
            prefix, tail = job.tail
            if self.store is not None:
                data = tail.to_bytes(self.layout)
                if self._put_store(tail_store_key(prefix), data, meta, "tail"):
                    self.written["tails"].inc()
                    self.written["tail_bytes"].inc(len(data))
            self._cache_on_device(tail_store_key(prefix), tail)
        if job.snapshot is not None:
            prefix, snap = job.snapshot
            data = snap.to_bytes(self.layout)
            if self.swa_pool is not None:
                if self.swa_pool.put(prefix, data):
                    self.written["snapshots_pool"].inc()
                    self.written["snapshot_pool_bytes"].inc(len(data))
                else:
                    self.errors.inc("write:pool_snapshot_failed")
            persist = self.write_policy == "v4" and self.store is not None
            if persist and self._put_store(snapshot_store_key(prefix), data, meta, "snapshot"):
                self.written["snapshots_store"].inc()
                self.written["snapshot_store_bytes"].inc(len(data))

    def flush(self) -> None:
        """Wait until every queued write-back job has finished."""
        self._queue.join()

    def close(self) -> None:
        """Finish queued jobs and stop the writer thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._worker.join()

    def __enter__(self) -> CacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- accounting
    def stats(self) -> dict[str, Any]:
        """Counters per ledger with their denominators, plus each tier's own ``stats()``."""
        return {
            "requests": {
                **self.requests.as_dict(),
                "loads": self.loads.value,
                "fallbacks": self.fallbacks.value,
            },
            "device": {
                **self.device_tokens.as_dict(),
                "tier": self.device_pool.stats() if self.device_pool is not None else None,
            },
            "store": {
                **self.store_tokens.as_dict(),
                "tier": self.store.stats() if self.store is not None else None,
            },
            "swa_pool": {
                **self.window_tokens.as_dict(),
                "found": self.snapshot_found.value,
                "loaded": self.snapshot_loaded.value,
                "age_at_hit_s": self.snapshot_age_s.as_dict(),
                "tier": self.swa_pool.stats() if self.swa_pool is not None else None,
            },
            "writes": {
                "submitted": self.jobs_submitted.value,
                "enqueued": self.jobs_enqueued.value,
                "dropped": self.jobs_dropped.value,
                "done": self.jobs_done.value,
                "failed": self.jobs_failed.value,
                "queued": self._queue.qsize(),
                **{name: counter.value for name, counter in self.written.items()},
            },
            "errors": self.errors.as_dict(),
            "write_policy": self.write_policy,
            "chunk_size": self.chunk_size,
        }

    def check_integrity(self) -> None:
        """Drain the write queue, then check every tier and the manager's own conservation laws."""
        if not self._closed:
            self.flush()
        for tier in (self.device_pool, self.swa_pool, self.store):
            if tier is not None:
                tier.check_integrity()
        if self.jobs_submitted.value != self.jobs_enqueued.value + self.jobs_dropped.value:
            raise AssertionError("write jobs: submitted != enqueued + dropped")
        if self.jobs_enqueued.value != self.jobs_done.value + self.jobs_failed.value:
            raise AssertionError("write jobs: enqueued != done + failed after a flush")
        with self._pending_lock:
            if self._pending:
                raise AssertionError(f"{len(self._pending)} keys still marked pending after a flush")
        for ledger in (self.requests, self.device_tokens, self.store_tokens, self.window_tokens):
            if ledger.hit_tokens.value > ledger.requested_tokens.value:
                raise AssertionError("more hit tokens than requested tokens")
        if self.device_tokens.hit_tokens.value > self.requests.hit_tokens.value:
            raise AssertionError("device hit tokens exceed the total hit tokens")
        if self.snapshot_found.value > self.window_tokens.lookups.value:
            raise AssertionError("more snapshots found than looked up")
