"""/metrics counts what the store's start-up scan found: a damaged batch in the middle of a pack
and a pack that is missing appear as ``replaykv_cache_store_tier_corrupt_batches`` and
``..._missing_packs`` (the same path as ``cut_batches``: the store's ``stats()``)."""

from __future__ import annotations

from pathlib import Path

import replaykv.cache.pack_store as pack_mod
from replaykv.cache.pack_store import PackStore
from tests.cache.test_store import k, payload_for
from tests.engine.conftest import make_engine


def test_damage_found_at_start_up_reaches_metrics(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = PackStore(root, 1 << 30, pack_bytes=1 << 20)
    for b in range(5):
        assert store.put_many([(k(10 * b + i), payload_for(10 * b + i)) for i in range(4)]) == [True] * 4
    store.pack_bytes = 0
    assert store.put(k(99), payload_for(99))  # a pack of its own, deleted below
    where, lone = store.pack_of(k(0)), store.pack_of(k(99))
    assert where is not None and lone is not None and where[0] != lone[0]
    offsets = pack_mod._read_index(where[0][:-5] + ".idx")
    raw = bytearray(Path(where[0]).read_bytes())
    raw[offsets[2] : offsets[2] + 8] = bytes(8)
    Path(where[0]).write_bytes(bytes(raw))
    Path(lone[0]).unlink()
    engine = make_engine(tmp_path)
    try:
        lines = engine.metrics_text().splitlines()
    finally:
        engine.shutdown()
    assert "replaykv_cache_store_tier_corrupt_batches_total 1.0" in lines
    assert "replaykv_cache_store_tier_missing_packs_total 1.0" in lines
    assert "replaykv_cache_store_tier_entries 16.0" in lines
