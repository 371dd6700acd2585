"""A session moves between replicas: turn 1 on engine A, turn 2 on engine B, with one shared
store directory and one Redis Cluster pool. Turn 2 finds its prefix in the store (written by
A), its window snapshot in the cluster, and answers exactly as both turns on one engine do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from replaykv.engine import Engine, Request, Result, SamplingParams
from tests.cache.conftest import RedisClusterNodes, redis_cluster  # noqa: F401  (fixture)
from tests.engine.conftest import make_engine, prompt_of

pytestmark = pytest.mark.redis

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3)


def _turns(first: Engine, second: Engine) -> list[Result]:
    prompt = prompt_of(70, 23)
    one = first.generate(Request(tuple(prompt), PARAMS, salt=b"session"))
    first.flush_writeback()
    follow = tuple(prompt + one.token_ids + prompt_of(71, 6))
    return [one, second.generate(Request(follow, PARAMS, salt=b"session"))]


def test_turn_two_on_another_replica_is_exact(
    tmp_path: Path,
    redis_cluster: RedisClusterNodes,  # noqa: F811
) -> None:
    shared: dict[str, Any] = dict(
        store_dir=str(tmp_path / "shared-store"), store_format="file", store_shared=True,
        swa_pool="redis", redis_url=redis_cluster.url, redis_cluster=True,
        enable_decoder_swa_bounded_replay=False,
    )  # fmt: skip
    a, b = make_engine(tmp_path / "a", **shared), make_engine(tmp_path / "b", **shared)
    single = make_engine(tmp_path / "single", enable_decoder_swa_bounded_replay=False)
    try:
        moved = _turns(a, b)
        stayed = _turns(single, single)
        assert b.cache is not None and b.cache.store is not None and b.cache.swa_pool is not None
        store, pool = b.cache.store.stats(), b.cache.swa_pool.stats()
    finally:
        for engine in (a, b, single):
            engine.shutdown()
    assert [r.token_ids for r in moved] == [r.token_ids for r in stayed]
    for m, s in zip(moved, stayed, strict=True):
        assert len(m.logprobs) == len(s.logprobs) == PARAMS.max_tokens
        for x, y in zip(m.logprobs, s.logprobs, strict=True):
            assert abs(x.logprob - y.logprob) <= 1e-5
    acc, ref = moved[1].accounting, stayed[1].accounting
    assert acc is not None and ref is not None
    assert acc.path == ref.path == "hit" and acc.snapshot_hit
    assert acc.cached_tokens == ref.cached_tokens == 23 + PARAMS.max_tokens - 1
    assert int(store["adopted"]) > 0 and int(store["hits"]) > 0  # the prefix came from A's files
    assert int(pool["hits"]) == 1 and pool["backend"] == "redis_cluster"  # the snapshot from the cluster
