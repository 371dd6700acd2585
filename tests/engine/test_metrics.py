"""/metrics text: valid Prometheus exposition (checked by a small parser written from the format
description) holding the engine's latency histograms, throughput, paths and every ledger."""

from __future__ import annotations

import math
import re
from pathlib import Path

from replaykv.engine import Request, SamplingParams
from tests.engine.conftest import make_engine, prompt_of

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
SAMPLE = re.compile(rf"^({NAME})(\{{(.*)\}})? (\S+)$")
LABEL = re.compile(rf'({NAME})="((?:[^"\\]|\\.)*)"(,|$)')


Sample = tuple[str, dict[str, str], float]  # (sample name, labels, value)


def parse(text: str) -> tuple[dict[str, str], dict[str, list[Sample]]]:
    """Family types and samples by family; AssertionError on anything the text format forbids."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    helped: set[str] = set()
    samples: dict[str, list[Sample]] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert re.fullmatch(NAME, name) and name not in helped, line
            helped.add(name)
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped") and name not in types, line
            types[name] = kind
        else:
            m = SAMPLE.match(line)
            assert m, f"bad sample line {line!r}"
            name, _, raw_labels, value = m.groups()
            labels: dict[str, str] = {}
            rest = raw_labels or ""
            while rest:
                lm = LABEL.match(rest)
                assert lm, f"bad labels in {line!r}"
                labels[lm.group(1)] = lm.group(2)
                rest = rest[lm.end() :]
            family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
            assert family in types, f"sample {name} before its TYPE line"
            samples.setdefault(family, []).append((name, labels, float(value)))
    for name, kind in types.items():
        if kind != "histogram":
            continue
        rows = samples[name]
        buckets = [(lab["le"], v) for sample, lab, v in rows if sample == f"{name}_bucket"]
        counts = [v for sample, _, v in rows if sample == f"{name}_count"]
        assert len(counts) == 1 and sum(sample == f"{name}_sum" for sample, _, _ in rows) == 1, name
        assert buckets and buckets[-1][0] == "+Inf", name
        bounds = [float(le) for le, _ in buckets]
        assert bounds == sorted(bounds), name
        values = [v for _, v in buckets]
        assert values == sorted(values), f"{name}: buckets must be cumulative"
        assert buckets[-1][1] == counts[0], f"{name}: +Inf bucket must equal _count"
    return types, samples


def test_metrics_text_is_prometheus(tmp_path: Path) -> None:
    engine = make_engine(tmp_path)
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        prompt = prompt_of(50, 20)
        first = engine.generate(Request(tuple(prompt), params, salt=b"t"))
        engine.flush_writeback()
        engine.generate(Request(tuple(prompt + first.token_ids + [1, 2]), params, salt=b"t"))
        engine.flush_writeback()
        types, samples = parse(engine.metrics_text())
    finally:
        engine.shutdown()
    assert types["replaykv_time_to_first_token_seconds"] == "histogram"
    assert types["replaykv_inter_token_latency_seconds"] == "histogram"
    assert types["replaykv_e2e_request_latency_seconds"] == "histogram"
    e2e = {sample: v for sample, _, v in samples["replaykv_e2e_request_latency_seconds"]}
    assert e2e["replaykv_e2e_request_latency_seconds_count"] == 2
    paths = {lab["path"]: v for _, lab, v in samples["replaykv_requests_by_path_total"]}
    assert paths == {"cold": 1, "hit": 1}
    assert samples["replaykv_decode_tokens_per_second"][0][2] > 0
    assert samples["replaykv_prefill_tokens_per_second"][0][2] > 0
    assert samples["replaykv_cached_tokens_total"][0][2] == 22
    assert "replaykv_queue_depth" in types and "replaykv_replayed_tokens_total" in types
    # the ledgers: requests, device pool, store, SWA pool, write-back
    for name in (
        "replaykv_cache_requests_hit_tokens",
        "replaykv_cache_device_hit_tokens",
        "replaykv_cache_device_tier_bytes_resident",
        "replaykv_cache_store_tier_puts_ok",
        "replaykv_cache_swa_pool_found",
        "replaykv_cache_swa_pool_tier_bytes_written",
        "replaykv_cache_writes_done",
    ):
        assert name in types, name
    assert samples["replaykv_cache_requests_hit_tokens"][0][2] == 22
    assert samples["replaykv_cache_swa_pool_found"][0][2] == 1
    assert types["replaykv_cache_swa_pool_age_at_hit_s"] == "histogram"
    assert all(math.isfinite(v) for rows in samples.values() for _, _, v in rows)
    info = samples["replaykv_engine_info"][0][1]
    assert info["model"] == "tiny-random-seed0" and info["decoder_replay"] == "true"
