"""CacheManager: hits with exact state, tenant isolation on every tier, lookup→load races,
corruption, Redis outage, write policies, the bounded write queue, and a model-based test.

Most tests use the deterministic fake filler of ``test_layout`` as the "model" (the state a row
holds depends only on its tokens), so a loaded view can be compared bit for bit with a fresh
fill of the same tokens. Tests that claim "output equals a cold run" run the real V4 model.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import replaykv.cache.manager as manager_module
from replaykv.cache.device_pool import DevicePool
from replaykv.cache.file_store import DirectoryStore
from replaykv.cache.keys import chunk_keys, prefix_key
from replaykv.cache.layout import CacheLayout, extract_snapshot
from replaykv.cache.manager import (
    CacheManager,
    CachePlan,
    _prefix_key,
    snapshot_store_key,
    tail_store_key,
)
from replaykv.cache.pack_store import PackStore
from replaykv.cache.store import EntryMeta
from replaykv.cache.swa_pool import MemorySwaPool, SwaPool
from replaykv.cache.swa_pool_redis import RedisSwaPool
from replaykv.cache.views import advance, allocate_view
from replaykv.model.cache_view import CacheView
from replaykv.model.init import init_weights
from replaykv.model.presets_v41 import v41_tiny
from replaykv.model.spec import ModelSpec
from replaykv.model.v4 import DeepseekV4ForCausalLM
from tests.cache.conftest import FakeClock, RedisServer
from tests.cache.test_layout import DIGEST, fake_fill, fake_view, one_torch_thread, v4_small

__all__ = ["one_torch_thread"]  # the autouse fixture applies here too

SPEC41 = ModelSpec.from_config(v41_tiny())
SPEC4 = ModelSpec.from_config(v4_small())
CAPACITY = 64  # tokens per test view


def tokens_of(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 500, (n,), generator=gen).tolist()


def make_manager(
    root: Path | None,
    clock: FakeClock,
    *,
    spec: ModelSpec = SPEC41,
    chunk: int = 8,
    device: bool = True,
    pool: SwaPool | str | None = "memory",
    policy: str = "v41",
    queue_size: int = 16,
    store: Any = None,
    pages: int = 16,
) -> CacheManager:
    layout = CacheLayout(spec, chunk_size=chunk)
    if store is None and root is not None:
        store = DirectoryStore(root, capacity_bytes=1 << 22, retention_s=3600, clock=clock)
    swa = MemorySwaPool(capacity_bytes=1 << 22, ttl_s=300, clock=clock) if pool == "memory" else pool
    assert swa is None or isinstance(swa, SwaPool)
    device_pool = DevicePool(layout, pages * layout.resident_page_bytes) if device else None
    return CacheManager(
        spec,
        layout.namespace("cfg-test", "weights-0"),
        device_pool,
        swa,
        store,
        chunk_size=chunk,
        write_policy=policy,
        queue_size=queue_size,
        layout=layout,
        clock=clock,
    )


def check_loaded(manager: CacheManager, view: CacheView, tokens: list[int], plan: CachePlan) -> None:
    """The loaded row equals a fresh fill of tokens[:H] where the plan says it was loaded."""
    h = plan.hit_tokens
    spec, layout = manager.spec, manager.layout
    ref = fake_view(spec, tokens[:h], CAPACITY)
    for s in spec.sources:
        r = spec.layers[s].ratio
        got, want = view.layers[s], ref.layers[s]
        assert got.entries is not None and want.entries is not None
        assert torch.equal(got.entries[0, : h // r], want.entries[0, : h // r]), f"layer {s} entries"
        if got.index_keys is not None and want.index_keys is not None:
            assert torch.equal(got.index_keys[0, : h // r], want.index_keys[0, : h // r])
    if h and (plan.snapshot_at_hit or plan.tail_at_hit):
        view.positions[0] = h
        a, b = extract_snapshot(layout, view, 0, DIGEST), extract_snapshot(layout, ref, 0, DIGEST)
        if plan.snapshot_at_hit:
            for wa, wb in zip(a.window, b.window, strict=True):
                assert torch.equal(wa, wb)
        for ca, cb in zip(a.carry, b.carry, strict=True):
            assert torch.equal(ca.kv, cb.kv) and torch.equal(ca.gate, cb.gate)
        view.positions[0] = 0


def serve(
    manager: CacheManager, tokens: list[int], salt: str, *, turn_end: bool = True, flush: bool = True
) -> tuple[CachePlan, CachePlan]:
    """One request with the fake model: lookup, load, check, continue, commit."""
    plan = manager.lookup(tokens, salt)
    view = allocate_view(manager.spec, 1, CAPACITY)
    loaded = manager.load(plan, view, 0)
    assert loaded.hit_tokens <= plan.hit_tokens and loaded.loaded
    check_loaded(manager, view, tokens, loaded)
    start = loaded.hit_tokens if loaded.exact else 0
    if start == 0:
        view = allocate_view(manager.spec, 1, CAPACITY)  # no replay engine here: recompute
    view.positions[0] = start
    fake_fill(manager.spec, view, 0, tokens, start, len(tokens))
    advance(view, len(tokens) - start)
    manager.commit(tokens, view, 0, salt, at_turn_end=turn_end)
    if flush:
        manager.flush()
    return plan, loaded


@pytest.fixture
def managers() -> Any:
    made: list[CacheManager] = []
    yield made
    for m in made:
        m.close()


# ------------------------------------------------------------------------------------------------
# Hits
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("store", [True, False], ids=["store", "device-only"])
@pytest.mark.parametrize("spec_name", ["v41", "v4"])
@pytest.mark.parametrize("turn", [29, 31, 32])
def test_turn_boundary_hit_is_exact(
    tmp_path: Path, clock: FakeClock, managers: Any, spec_name: str, turn: int, store: bool
) -> None:
    spec, chunk = (SPEC41, 8) if spec_name == "v41" else (SPEC4, 16)
    m = make_manager(tmp_path if store else None, clock, spec=spec, chunk=chunk)
    managers.append(m)
    tokens = tokens_of(1, 48)
    serve(m, tokens[:turn], "acme")
    plan, loaded = serve(m, tokens[:44], "acme")
    assert plan.hit_tokens == turn and loaded.hit_tokens == turn
    assert plan.snapshot_at_hit and plan.carry_at_hit and loaded.exact
    aligned = turn % chunk == 0
    needs_tail = not aligned or m.layout.needs_carry(turn)
    assert plan.tail_at_hit == needs_tail
    assert plan.store_hit_tokens == turn // chunk * chunk
    assert plan.device_hit_tokens == plan.store_hit_tokens  # the writer cached the chunks on device
    assert set(loaded.chunk_sources) <= {"device"}
    stats = m.stats()
    assert stats["swa_pool"]["loaded"] == 1
    m.check_integrity()


def test_lookup_reasons_caps_and_keys(tmp_path: Path, clock: FakeClock, managers: Any) -> None:
    m = make_manager(tmp_path, clock)
    managers.append(m)
    empty = m.lookup([], "acme")
    assert empty.hit_tokens == 0 and empty.tokens == 0
    tokens = tokens_of(2, 40)
    cold = m.lookup(tokens, "acme")
    assert cold.hit_tokens == 0 and any("chunk 0" in r for r in cold.reasons)
    serve(m, tokens[:21], "acme")
    # An exact repeat never hits its last token (it must be computed); the cap can be lifted.
    assert m.lookup(tokens[:21], "acme").hit_tokens == 16
    assert m.lookup(tokens[:21], "acme", max_hit_tokens=21).hit_tokens == 21
    assert m.lookup(tokens[:30], "acme", max_hit_tokens=10).hit_tokens == 8
    # The incremental prefix keys equal keys.prefix_key.
    ns = m.namespace("acme")
    keys = chunk_keys(ns, tokens)
    arr = np.asarray(tokens, dtype="<i8")
    for h in (0, 3, 8, 13, 16, 39):
        parent = keys[h // 8 - 1] if h >= 8 else ns.seed()
        assert _prefix_key(parent, arr[h // 8 * 8 : h]) == prefix_key(ns, tokens[:h])


def test_stats_have_real_denominators(tmp_path: Path, clock: FakeClock, managers: Any) -> None:
    m = make_manager(tmp_path, clock, device=False)
    managers.append(m)
    tokens = tokens_of(15, 40)
    serve(m, tokens[:21], "acme")  # cold: 21 requested (20 may hit), 0 hit
    clock.advance(12.0)
    serve(m, tokens[:30], "acme")  # warm: 30 requested, 21 hit (2 chunks + tail), snapshot 12 s old
    stats = m.stats()
    req, store, pool = stats["requests"], stats["store"], stats["swa_pool"]
    assert (req["lookups"], req["requested_tokens"], req["hit_tokens"]) == (2, 51, 21)
    assert req["miss_tokens"] == 30 and req["hit_rate"] == pytest.approx(21 / 51)
    assert (store["requested_tokens"], store["hit_tokens"]) == (20 + 29, 21)
    assert (pool["lookups"], pool["found"], pool["loaded"]) == (1, 1, 1)
    rows = min(21, m.layout.spec.sliding_window)  # the window rows the hit at 21 wants
    assert (pool["requested_tokens"], pool["hit_tokens"], pool["loaded_tokens"]) == (rows, rows, rows)
    assert pool["hit_rate"] == 1.0
    assert pool["age_at_hit_s"]["max"] == pytest.approx(12.0)
    assert pool["tier"]["hit_age_s"]["count"] == 1
    assert stats["writes"]["chunks"] == 3 and stats["writes"]["tails"] == 2
    assert stats["store"]["tier"]["bytes_written"] > 0 and stats["errors"] == {}
    m.check_integrity()


def test_namespace_must_match_layout(tmp_path: Path, clock: FakeClock) -> None:
    layout = CacheLayout(SPEC41, chunk_size=8)
    wrong = CacheLayout(SPEC41, chunk_size=16).namespace("cfg", "w")
    with pytest.raises(ValueError, match="chunk_size"):
        CacheManager(SPEC41, wrong, None, None, None, chunk_size=8, layout=layout)
    with pytest.raises(ValueError, match="write_policy"):
        CacheManager(SPEC41, layout.namespace("c", "w"), None, None, None, chunk_size=8, write_policy="v5")


def test_view_smaller_than_the_hit_cuts_it(tmp_path: Path, clock: FakeClock, managers: Any) -> None:
    m = make_manager(tmp_path, clock)
    managers.append(m)
    tokens = tokens_of(3, 40)
    serve(m, tokens[:37], "acme")
    plan = m.lookup(tokens, "acme")
    assert plan.hit_tokens == 37
    small = allocate_view(SPEC41, 1, 20)
    loaded = m.load(plan, small, 0)
    assert loaded.hit_tokens == 16 and not loaded.snapshot_at_hit
    with pytest.raises(ValueError, match="already loaded"):
        m.load(loaded, small, 0)


# ------------------------------------------------------------------------------------------------
# Tenant isolation: paired tests on every tier (same salt → a real hit, another salt → none)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["device", "store", "pool"])
def test_paired_tenant_isolation(tmp_path: Path, clock: FakeClock, managers: Any, tier: str) -> None:
    m = make_manager(
        tmp_path if tier != "device" else None,
        clock,
        device=tier == "device",
        pool="memory" if tier == "pool" else None,
    )
    managers.append(m)
    tokens = tokens_of(4, 40)
    serve(m, tokens[:24], "org_1")
    other = m.lookup(tokens[:33], "org_12")
    assert other.hit_tokens == 0 and not other.snapshot_at_hit
    m.load(other, allocate_view(SPEC41, 1, CAPACITY))
    before = m.stats()
    plan, loaded = serve(m, tokens[:33], "org_1", turn_end=False)
    assert loaded.hit_tokens == 24
    stats = m.stats()
    if tier == "device":
        tier_stats = stats["device"]["tier"]
        assert loaded.device_hit_tokens == 24 and tier_stats["hits"] > 0
        assert before["device"]["tier"]["hits"] == 0
    elif tier == "store":
        assert loaded.chunk_sources == ("store",) * 3
        assert stats["store"]["tier"]["hits"] >= 3
        assert before["store"]["tier"]["hits"] == 0
    else:
        assert plan.snapshot_at_hit and loaded.snapshot_source == "pool"
        assert stats["swa_pool"]["tier"]["hits"] == 1
        assert before["swa_pool"]["tier"]["hits"] == 0
    assert stats["requests"]["hit_tokens"] == 24
    m.check_integrity()


@pytest.mark.redis
def test_paired_tenant_isolation_redis_pool(
    tmp_path: Path, clock: FakeClock, managers: Any, redis_server: RedisServer
) -> None:
    pool = RedisSwaPool(redis_server.url, ttl_s=300)
    m = make_manager(tmp_path, clock, pool=pool)
    managers.append(m)
    tokens = tokens_of(5, 40)
    serve(m, tokens[:21], "tenant-a")
    other = m.lookup(tokens[:30], "tenant-b")
    assert not other.snapshot_at_hit and other.hit_tokens == 0
    plan, loaded = serve(m, tokens[:30], "tenant-a")
    assert plan.snapshot_at_hit and loaded.exact and loaded.hit_tokens == 21
    assert pool.stats()["hits"] == 1
    m.check_integrity()


# ------------------------------------------------------------------------------------------------
# Lookup → load races
# ------------------------------------------------------------------------------------------------


def test_device_eviction_between_lookup_and_load(tmp_path: Path, clock: FakeClock, managers: Any) -> None:
    with_store = make_manager(tmp_path / "a", clock)
    device_only = make_manager(None, clock, pool=None)
    managers += [with_store, device_only]
    tokens = tokens_of(6, 40)
    for m in (with_store, device_only):
        serve(m, tokens[:24], "acme", turn_end=False)
        plan = m.lookup(tokens[:30], "acme")
        assert plan.device_hit_tokens == 24
        assert m.device_pool is not None and m.device_pool.evict_unreferenced() == 3
        view = allocate_view(SPEC41, 1, CAPACITY)
        loaded = m.load(plan, view, 0)
        check_loaded(m, view, tokens, loaded)
        m.check_integrity()
    assert with_store.device_pool is not None
    # With a store behind it the hit survives (read from the store, promoted to the device again).
    loaded = with_store.load(with_store.lookup(tokens[:30], "acme"), allocate_view(SPEC41, 1, CAPACITY))
    assert loaded.hit_tokens == 24 and loaded.chunk_sources == ("device",) * 3
    # Without one it is gone.
    plan = device_only.lookup(tokens[:30], "acme")
    assert plan.hit_tokens == 0


def test_store_entry_vanishes_between_lookup_and_load(
    tmp_path: Path, clock: FakeClock, managers: Any
) -> None:
    m = make_manager(tmp_path, clock, device=False)
    managers.append(m)
    tokens = tokens_of(7, 48)
    serve(m, tokens[:16], "acme")  # snapshot at 16
    serve(m, tokens[:29], "acme")  # chunks 0-2, tail and snapshot at 29
    plan = m.lookup(tokens[:40], "acme")
    assert plan.hit_tokens == 29 and plan.tail_at_hit and plan.snapshot_at_hit
    assert m.store is not None
    m.store.delete(plan.chunk_keys[2])
    view = allocate_view(SPEC41, 1, CAPACITY)
    loaded = m.load(plan, view, 0)
    # Falls back to the last verified chunk boundary and finds the earlier turn's snapshot there.
    assert loaded.hit_tokens == 16 and loaded.snapshot_at_hit and loaded.exact and not loaded.tail_at_hit
    assert any("shortened" in r for r in loaded.reasons)
    check_loaded(m, view, tokens, loaded)
    assert m.stats()["requests"]["fallbacks"] == 1
    m.check_integrity()


class _ReadRecordingStore(DirectoryStore):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[int] = []

    def prefetch(self, keys: Any) -> None:
        self.batches.append(len(keys))
        super().prefetch(keys)


def test_load_prefetches_store_chunks_in_bounded_batches(
    tmp_path: Path, clock: FakeClock, managers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(manager_module, "STORE_READ_AHEAD", 3)  # 7 chunks fit a test view
    store = _ReadRecordingStore(tmp_path, capacity_bytes=1 << 24, retention_s=3600, clock=clock, io_threads=4)
    m = make_manager(tmp_path, clock, device=False, store=store)
    managers.append(m)
    tokens = tokens_of(11, 7 * 8 + 3)
    serve(m, tokens, "acme")
    plan = m.lookup(tokens, "acme")
    assert plan.hit_tokens == 7 * 8 and len(plan.chunk_keys) == 7  # the chunks, not the tail
    store.batches.clear()
    view = allocate_view(SPEC41, 1, CAPACITY)
    loaded = m.load(plan, view, 0)
    assert loaded.hit_tokens == 7 * 8 and loaded.chunk_sources == ("store",) * 7
    assert store.batches == [3, 3, 1]
    check_loaded(m, view, tokens, loaded)
    # A chunk gone between lookup and load, inside a batch: the hit stops at the boundary before.
    plan = m.lookup(tokens, "acme")
    store.delete(plan.chunk_keys[4])
    store.batches.clear()
    view = allocate_view(SPEC41, 1, CAPACITY)
    loaded = m.load(plan, view, 0)
    assert loaded.hit_tokens == 4 * 8 and store.batches == [3, 3]
    check_loaded(m, view, tokens, loaded)
    m.check_integrity()


def test_expiry_between_lookup_and_load(tmp_path: Path, clock: FakeClock, managers: Any) -> None:
    m = make_manager(tmp_path, clock, device=False)
    managers.append(m)
    tokens = tokens_of(8, 48)
    serve(m, tokens[:27], "acme")
    plan = m.lookup(tokens[:40], "acme")
    assert plan.exact and plan.hit_tokens == 27
    clock.advance(301)  # the SWA pool's TTL passes, the store's retention does not
    loaded = m.load(plan, allocate_view(SPEC41, 1, CAPACITY), 0)
    assert loaded.hit_tokens == 27 and loaded.tail_at_hit and not loaded.snapshot_at_hit
    assert loaded.carry_at_hit  # the tail carries the pending compressor row
    plan = m.lookup(tokens[:40], "acme")
    assert plan.hit_tokens == 27 and not plan.snapshot_at_hit
    assert any("snapshot" in r for r in plan.reasons)
    clock.advance(3601)  # now the store's retention passes too
    view = allocate_view(SPEC41, 1, CAPACITY)
    loaded = m.load(plan, view, 0)
    assert loaded.hit_tokens == 0
    check_loaded(m, view, tokens, loaded)
    assert m.lookup(tokens[:40], "acme").hit_tokens == 0
    m.check_integrity()


# ------------------------------------------------------------------------------------------------
# Corruption and outages, with the real model: output equals a cold run
# ------------------------------------------------------------------------------------------------


@functools.cache
def _v4_model() -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(v4_small())
    init_weights(model, seed=5)
    return model.eval()


def serve_model(manager: CacheManager, ids: torch.Tensor, salt: str) -> tuple[CachePlan, torch.Tensor]:
    """An engine stand-in: exact hits continue, anything else recomputes from 0. Returns the logits
    of [start, end) and the plan actually loaded."""
    model = _v4_model()
    tokens = ids[0].tolist()
    loaded = manager.load(manager.lookup(tokens, salt), view := allocate_view(SPEC4, 1, CAPACITY), 0)
    start = loaded.hit_tokens if loaded.exact else 0
    if start == 0:
        view = allocate_view(SPEC4, 1, CAPACITY)
    view.positions[0] = start
    with torch.no_grad():
        logits = model(ids[:, start:], view)
    advance(view, ids.shape[1] - start)
    manager.commit(tokens, view, 0, salt, at_turn_end=True)
    manager.flush()
    return loaded, logits


def _reference(ids: torch.Tensor, cut: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(split run [0, cut) then [cut, end) on one view, one-shot run of [0, end))."""
    model = _v4_model()
    with torch.no_grad():
        view = allocate_view(SPEC4, 1, CAPACITY)
        model(ids[:, :cut], view)
        advance(view, cut)
        split = model(ids[:, cut:], view)
        cold = model(ids, allocate_view(SPEC4, 1, CAPACITY))
    return split, cold


def test_store_corruption_is_a_miss_and_output_equals_cold(
    tmp_path: Path, clock: FakeClock, managers: Any
) -> None:
    m = make_manager(tmp_path, clock, spec=SPEC4, chunk=16, device=False)
    managers.append(m)
    ids = torch.tensor([tokens_of(9, 50)])
    split, cold = _reference(ids, 37)
    serve_model(m, ids[:, :37], "acme")
    loaded, logits = serve_model(m, ids, "acme")  # a warm hit continues exactly
    assert loaded.exact and loaded.hit_tokens == 37
    assert torch.equal(logits, split[:, :])
    # Flip one payload byte of chunk 0 on disk: checksum → quarantine → miss → cold output.
    assert m.store is not None
    key = m.lookup(ids[0].tolist(), "acme").chunk_keys[0]
    path = next(tmp_path.rglob(f"{key.hex()}.kv"))
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0x40
    path.write_bytes(bytes(raw))
    loaded, logits = serve_model(m, ids, "acme")
    assert loaded.hit_tokens == 0 and not loaded.exact
    assert torch.equal(logits, cold)
    assert m.store.stats()["quarantined"] == 1
    m.check_integrity()


def test_entry_failing_layout_verification_is_deleted(
    tmp_path: Path, clock: FakeClock, managers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A blob with a valid store checksum but the wrong content (another tenant's chunk here)."""
    m = make_manager(tmp_path, clock, device=False)
    managers.append(m)
    tokens = tokens_of(10, 40)
    serve(m, tokens[:24], "a", turn_end=False)
    serve(m, tokens[:24], "b", turn_end=False)
    assert m.store is not None
    key_a = chunk_keys(m.namespace("a"), tokens[:8])[0]
    key_b = chunk_keys(m.namespace("b"), tokens[:8])[0]
    foreign = m.store.get(key_b)
    assert foreign is not None
    m.store.put(key_a, foreign, EntryMeta.for_namespace(m.namespace("a")))
    view = allocate_view(SPEC41, 1, CAPACITY)
    with caplog.at_level(logging.WARNING, logger="replaykv.cache.manager"):
        loaded = m.load(m.lookup(tokens[:30], "a"), view, 0)
    assert loaded.hit_tokens == 0
    assert m.stats()["errors"] == {"load:wrong_namespace": 1}
    assert not m.store.contains(key_a)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and key_a.hex() in record.message
    assert "wrong_namespace" in record.message and str(tmp_path) in record.message
    m.check_integrity()


@pytest.mark.redis
def test_redis_down_is_a_miss_and_the_request_is_unaffected(
    tmp_path: Path, clock: FakeClock, managers: Any, redis_server: RedisServer
) -> None:
    circuit = FakeClock(0.0)
    pool = RedisSwaPool(redis_server.url, ttl_s=300, retry_after_s=0.05, circuit_clock=circuit)
    m = make_manager(tmp_path, clock, spec=SPEC4, chunk=16, device=False, pool=pool)
    managers.append(m)
    ids = torch.tensor([tokens_of(11, 50)])
    split, cold = _reference(ids, 37)
    serve_model(m, ids[:, :37], "acme")
    assert m.lookup(ids[0].tolist(), "acme").snapshot_at_hit
    redis_server.kill()
    plan = m.lookup(ids[0].tolist(), "acme")
    assert plan.hit_tokens == 37 and not plan.snapshot_at_hit  # global KV still hits (store)
    loaded, logits = serve_model(m, ids, "acme")  # commit's snapshot put fails, counted
    assert not loaded.exact and torch.equal(logits, cold)
    errors = m.stats()["errors"]
    assert isinstance(errors, dict) and errors.get("write:pool_snapshot_failed", 0) >= 1
    assert int(pool.stats()["errors_total"]) > 0  # type: ignore[call-overload]
    # Redis comes back (empty): writes succeed again and the next conversation hits exactly.
    redis_server.start()
    circuit.advance(0.05)  # the pool's circuit stays open for retry_after_s
    ids = torch.tensor([tokens_of(12, 50)])
    split, _ = _reference(ids, 37)
    serve_model(m, ids[:, :37], "acme")
    loaded, logits = serve_model(m, ids, "acme")
    assert loaded.exact and loaded.snapshot_source == "pool" and torch.equal(logits, split)
    m.check_integrity()


# ------------------------------------------------------------------------------------------------
# Write-back: policies, queue bound, V4 tails at aligned turn ends
# ------------------------------------------------------------------------------------------------


def test_write_policy_bytes(tmp_path: Path, clock: FakeClock, managers: Any) -> None:
    v41 = make_manager(tmp_path / "v41", clock, policy="v41", device=False)
    v4 = make_manager(tmp_path / "v4", clock, policy="v4", device=False)
    managers += [v41, v4]
    tokens = tokens_of(12, 48)
    for m in (v41, v4):
        serve(m, tokens[:21], "acme")
        serve(m, tokens[:38], "acme")
    w41, w4 = v41.stats()["writes"], v4.stats()["writes"]
    assert isinstance(w41, dict) and isinstance(w4, dict)
    assert w41["snapshots_store"] == 0 and w4["snapshots_store"] == 2
    assert w41["snapshot_pool_bytes"] == w4["snapshot_pool_bytes"] > 0
    assert w41["chunk_bytes"] == w4["chunk_bytes"] and w41["tail_bytes"] == w4["tail_bytes"]
    assert v41.store is not None and v4.store is not None
    s41, s4 = v41.store.stats(), v4.store.stats()
    assert s4["bytes_written"] - s41["bytes_written"] == w4["snapshot_store_bytes"]  # type: ignore[operator]
    assert w4["snapshot_store_bytes"] == w4["snapshot_pool_bytes"]
    # v4 keeps the snapshot when the host pool loses it; v41 does not.
    for m in (v41, v4):
        assert m.swa_pool is not None
        m.swa_pool.flush()
    assert not v41.lookup(tokens, "acme").snapshot_at_hit
    plan = v4.lookup(tokens, "acme")
    assert plan.snapshot_at_hit and plan.snapshot_source == "store"
    assert v4.load(plan, allocate_view(SPEC41, 1, CAPACITY)).snapshot_source == "store"
    for m in (v41, v4):
        m.check_integrity()


class _BlockingStore(DirectoryStore):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def put(self, *args: Any, **kwargs: Any) -> bool:
        self.gate.wait(10)
        return super().put(*args, **kwargs)


def test_full_queue_drops_and_counts(tmp_path: Path, clock: FakeClock, managers: Any) -> None:
    store = _BlockingStore(tmp_path, capacity_bytes=1 << 22, retention_s=None, clock=clock)
    m = make_manager(None, clock, store=store, queue_size=1, device=False)
    managers.append(m)
    results = []
    for seed in range(4):  # the writer holds one job, the queue one more, the rest are dropped
        tokens = tokens_of(100 + seed, 20)
        view = fake_view(SPEC41, tokens, CAPACITY)
        results.append(m.commit(tokens, view, 0, "acme", at_turn_end=True))
    assert results[:1] == [True] and results.count(False) >= 1
    writes = m.stats()["writes"]
    assert isinstance(writes, dict) and writes["dropped"] >= 1
    assert m.stats()["errors"]["write:queue_full"] == writes["dropped"]
    store.gate.set()
    m.check_integrity()
    assert writes["submitted"] == writes["enqueued"] + writes["dropped"]


def test_commit_is_idempotent_and_needs_matching_tokens(
    tmp_path: Path, clock: FakeClock, managers: Any
) -> None:
    m = make_manager(tmp_path, clock)
    managers.append(m)
    tokens = tokens_of(13, 24)
    view = fake_view(SPEC41, tokens, CAPACITY)
    assert m.commit(tokens, view, 0, "acme", at_turn_end=False)
    m.flush()
    assert not m.commit(tokens, view, 0, "acme", at_turn_end=False)  # nothing new
    with pytest.raises(ValueError, match="position 24"):
        m.commit(tokens[:20], view, 0, "acme", at_turn_end=True)
    m.close()
    with pytest.raises(RuntimeError, match="closed"):
        m.commit(tokens, view, 0, "acme", at_turn_end=True)


def test_restart_keeps_store_hits(tmp_path: Path, clock: FakeClock, managers: Any) -> None:
    m = make_manager(tmp_path, clock)
    tokens = tokens_of(14, 40)
    serve(m, tokens[:27], "acme")
    m.close()
    fresh = make_manager(tmp_path, clock)  # new process: empty device pool and host pool
    managers.append(fresh)
    plan, loaded = serve(fresh, tokens[:35], "acme")
    assert plan.hit_tokens == 27 and plan.device_hit_tokens == 0 and not plan.snapshot_at_hit
    assert loaded.chunk_sources == ("store",) * 3 and loaded.carry_at_hit
    fresh.check_integrity()


# ------------------------------------------------------------------------------------------------
# Model-based test
# ------------------------------------------------------------------------------------------------

BASES = [tokens_of(1000 + i, 40) for i in range(3)]
SALTS = ["t1", "t2"]
# Turns end at a few shared boundaries (odd, even, chunk-aligned) so later turns extend earlier ones.
LENGTHS = st.sampled_from([1, 5, 11, 16, 21, 24, 29, 33, 40]) | st.integers(1, 40)


class ManagerMachine(RuleBasedStateMachine):
    """Random request / hold pages / evict / expire / delete / corrupt / restart sequences.

    After every step: ``check_integrity()`` of the manager (which checks the device pool, the SWA
    pool and the store). Every load is compared bit for bit with a fresh fill of the same tokens,
    and a hit is only allowed where the same tenant committed a sequence with that prefix.
    """

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="rkv-manager-"))
        self.clock = FakeClock()
        self.pool = MemorySwaPool(capacity_bytes=120_000, ttl_s=300, clock=self.clock)
        self.manager = self._new_manager()
        self.held: list[list[int]] = []
        self.committed: dict[str, list[tuple[int, ...]]] = {s: [] for s in SALTS}

    store_cls: type[DirectoryStore] | type[PackStore] = DirectoryStore

    def _new_manager(self) -> CacheManager:
        store = self.store_cls(self.root, capacity_bytes=80_000, retention_s=1000, clock=self.clock)
        return make_manager(None, self.clock, store=store, pool=self.pool, pages=5, queue_size=4)

    def teardown(self) -> None:
        self.manager.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def _allowed_hit(self, salt: str, tokens: list[int], hit: int) -> bool:
        return hit == 0 or any(
            len(seq) >= hit and list(seq[:hit]) == tokens[:hit] for seq in self.committed[salt]
        )

    @rule(base=st.integers(0, 2), length=LENGTHS, salt=st.sampled_from(SALTS), turn_end=st.booleans())
    def request(self, base: int, length: int, salt: str, turn_end: bool) -> None:
        tokens = BASES[base][:length]
        plan, loaded = serve(self.manager, tokens, salt, turn_end=turn_end, flush=False)
        assert self._allowed_hit(salt, tokens, plan.hit_tokens)
        assert loaded.hit_tokens <= plan.hit_tokens < max(1, length)
        event("hit" if loaded.hit_tokens else "miss")
        event(f"exact={loaded.exact} tail={loaded.tail_at_hit} sources={sorted(set(loaded.chunk_sources))}")
        self.committed[salt].append(tuple(tokens))

    @rule(base=st.integers(0, 2), length=LENGTHS, salt=st.sampled_from(SALTS), what=st.integers(0, 3))
    def race(self, base: int, length: int, salt: str, what: int) -> None:
        """Something disappears between lookup and load: the load must fall back, never crash."""
        tokens = BASES[base][:length]
        self.manager.flush()
        plan = self.manager.lookup(tokens, salt)
        if what == 0 and self.manager.device_pool is not None:
            self.manager.device_pool.evict_unreferenced()
        elif what == 1:
            self.clock.advance(301)
        elif what == 2 and plan.chunk_keys and self.manager.store is not None:
            self.manager.store.delete(plan.chunk_keys[-1])
        elif what == 3:
            self.pool.flush()
        view = allocate_view(SPEC41, 1, CAPACITY)
        loaded = self.manager.load(plan, view, 0)
        assert loaded.hit_tokens <= plan.hit_tokens
        event(f"race {what}: {'shortened' if loaded.hit_tokens < plan.hit_tokens else 'kept'}")
        check_loaded(self.manager, view, tokens, loaded)

    @rule(n=st.integers(1, 4))
    def hold_pages(self, n: int) -> None:
        pool = self.manager.device_pool
        assert pool is not None
        if pool.can_allocate(n):
            self.held.append(pool.allocate(n))

    @precondition(lambda self: bool(self.held))
    @rule()
    def release_pages(self) -> None:
        assert self.manager.device_pool is not None
        self.manager.device_pool.free(self.held.pop())

    @rule(seconds=st.sampled_from([10, 299, 301, 1001]))
    def expire(self, seconds: int) -> None:
        self.clock.advance(seconds)

    @rule()
    def gc(self) -> None:
        self.manager.flush()
        assert self.manager.store is not None
        self.manager.store.gc()  # type: ignore[attr-defined]

    @rule(i=st.integers(0, 1000), offset=st.integers(1, 400))
    def corrupt(self, i: int, offset: int) -> None:
        self.manager.flush()
        files = sorted(self.root.rglob("*.kv")) + sorted(self.root.rglob("*.pack"))
        files = [f for f in files if "quarantine" not in f.parts]
        if not files:
            return
        path = files[i % len(files)]
        raw = bytearray(path.read_bytes())
        raw[-(offset % len(raw)) - 1] ^= 0x01
        path.write_bytes(bytes(raw))
        os.utime(path, (self.clock.now, self.clock.now))

    @rule()
    def restart(self) -> None:
        self.manager.close()
        self.held.clear()  # the device pool dies with the process; the host pool survives
        self.manager = self._new_manager()

    @invariant()
    def integrity(self) -> None:
        self.manager.check_integrity()
        stats = self.manager.stats()
        req = stats["requests"]
        assert isinstance(req, dict) and req["hit_tokens"] <= req["requested_tokens"]


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=50, stateful_step_count=25, deadline=None)


class PackManagerMachine(ManagerMachine):
    """The same sequences over a :class:`PackStore` (a pack per write-back batch)."""

    store_cls = PackStore


TestPackManagerMachine = PackManagerMachine.TestCase
TestPackManagerMachine.settings = settings(max_examples=30, stateful_step_count=25, deadline=None)


def test_snapshot_and_tail_keys_are_distinct() -> None:
    prefix = hashlib.sha256(b"p").digest()
    assert len({prefix, tail_store_key(prefix), snapshot_store_key(prefix)}) == 3
