"""Memory per session: distinct sessions through a caching engine keep only what the tiers'
budgets allow. Counts, not timings or RSS: the bytes each tier really holds, the per-session
maps and the metric series, after 20, 40 and 60 sessions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replaykv.cache.device_pool import resident_bytes
from replaykv.engine import Engine
from replaykv.engine.api import Request, SamplingParams
from tests.engine.conftest import make_engine, prompt_of

SWA_POOL_BYTES = 64 << 10


def _series(engine: Engine) -> set[str]:
    """Every metric series (name and labels) the engine exports."""
    return {line.rsplit(" ", 1)[0] for line in engine.metrics_text().splitlines() if not line.startswith("#")}


def _held(engine: Engine) -> dict[str, Any]:
    engine.flush_writeback()
    cache = engine.cache
    assert cache is not None and cache.device_pool is not None and cache.swa_pool is not None
    pool = cache.device_pool
    cache.check_integrity()
    with pool._lock:
        payloads = list(pool._payload.values())
    return {
        "device_real": sum(resident_bytes(p) for p in payloads),
        "device_charged": pool.metrics.bytes_resident.value,
        "device_pages": len(payloads),
        "swa": cache.swa_pool.metrics.bytes_resident.value,
        "pending": len(cache._pending),
        "namespaces": len(cache._namespaces),
        "decode_views": len(engine._decode_views),
        "series": len(_series(engine)),
    }


def test_distinct_sessions_stay_within_the_budgets(tmp_path: Path) -> None:
    probe = make_engine(tmp_path / "probe", chunk_size=16, kv_quant=True)
    assert probe.cache is not None and probe.cache.device_pool is not None
    page = probe.cache.device_pool.page_bytes
    probe.shutdown()
    budget = 24 * page
    engine = make_engine(
        tmp_path,
        chunk_size=16,
        kv_quant=True,  # the FP8/FP4 wire format: a page's tensors are larger than its packed bytes
        device_pool_bytes=budget,
        swa_pool_capacity_bytes=SWA_POOL_BYTES,
    )
    try:
        curve = []
        for session in range(60):
            prompt = prompt_of(1000 + session, 40)
            engine.submit(Request(tuple(prompt), SamplingParams(max_tokens=1, temperature=0))).result()
            if session % 20 == 19:
                curve.append(_held(engine))
    finally:
        engine.shutdown()
    for held in curve:
        assert held["device_real"] <= held["device_charged"] <= budget, held
        assert held["swa"] <= SWA_POOL_BYTES, held
        assert held["pending"] == 0 and held["namespaces"] == 1 and held["decode_views"] <= 3, held
    # flat: 20 sessions of 2 chunks and a tail each fill the pool's 24 pages, and it stays full
    assert curve[0]["device_pages"] == curve[1]["device_pages"] == curve[2]["device_pages"] >= 20, curve
    assert curve[0]["swa"] > SWA_POOL_BYTES // 2 and curve[0]["device_real"] > budget // 2, curve
    assert curve[1]["series"] == curve[2]["series"], curve
