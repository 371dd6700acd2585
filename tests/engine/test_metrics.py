"""The engine's metrics: read back with prometheus_client's own parser, typed as counters and
gauges by what they are, named in base units, one token-weighted hit rate per ledger, and the
same list in docs/metrics.md as in the catalogue."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.openmetrics import parser as openmetrics_parser
from prometheus_client.parser import text_string_to_metric_families

from replaykv.engine import Request, SamplingParams
from replaykv.engine.cache_metrics import CACHE_METRICS, NOT_EXPORTED
from replaykv.engine.metrics import catalogue
from replaykv.server.metrics import HTTP_METRICS
from tests.engine.conftest import make_engine, prompt_of

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
NAME = re.compile(r"^replaykv_[a-z0-9_]+$")


def families(text: str) -> dict[str, Any]:
    """Exposed family name (counters with ``_total``) -> the parsed family."""
    out: dict[str, Any] = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        assert name not in out, f"{name} exposed twice"
        out[name] = fam
    return out


def value(fams: dict[str, Any], name: str, **labels: str) -> float:
    rows = [s.value for s in fams[name].samples if s.labels == labels and not s.name.endswith("_created")]
    assert len(rows) == 1, (name, labels, fams[name].samples)
    return float(rows[0])


def _two_turns(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """Metrics text and stats after two turns of one conversation (the second hits 22 tokens)."""
    engine = make_engine(tmp_path)
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        prompt = prompt_of(50, 20)
        first = engine.generate(Request(tuple(prompt), params, salt=b"t"))
        engine.flush_writeback()
        engine.generate(Request(tuple(prompt + first.token_ids + [1, 2]), params, salt=b"t"))
        engine.flush_writeback()
        assert engine.cache is not None
        window = engine.cache.layout.spec.sliding_window
        return engine.metrics_text(), {**engine.cache_stats(), "window": window}
    finally:
        engine.shutdown()


def test_metrics_parse_with_prometheus_client(tmp_path: Path) -> None:
    text, stats = _two_turns(tmp_path)
    fams = families(text)
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency", "queue_wait"):
        assert fams[f"replaykv_{name}_seconds"].type == "histogram"
    e2e = {s.name: s.value for s in fams["replaykv_e2e_request_latency_seconds"].samples if "le" not in s.labels}
    assert e2e["replaykv_e2e_request_latency_seconds_count"] == 2
    for fam in fams.values():
        if fam.type != "histogram":
            continue
        buckets = [(float(s.labels["le"]), s.value) for s in fam.samples if s.name.endswith("_bucket")]
        count = [s.value for s in fam.samples if s.name.endswith("_count")]
        assert buckets and buckets[-1][0] == math.inf, fam.name
        assert [b for b, _ in buckets] == sorted(b for b, _ in buckets), fam.name
        assert [v for _, v in buckets] == sorted(v for _, v in buckets), f"{fam.name}: buckets are cumulative"
        assert count == [buckets[-1][1]], f"{fam.name}: the +Inf bucket equals _count"
    paths = {s.labels["path"]: s.value for s in fams["replaykv_requests_by_path_total"].samples}
    assert paths == {"cold": 1, "hit": 1}
    assert value(fams, "replaykv_decode_tokens_per_second") > 0
    assert value(fams, "replaykv_prefill_tokens_per_second") > 0
    assert value(fams, "replaykv_cached_tokens_total") == 22
    assert fams["replaykv_queue_depth"].type == "gauge"
    # the ledgers, typed by what they are
    assert fams["replaykv_cache_requests_hit_tokens_total"].type == "counter"
    assert value(fams, "replaykv_cache_requests_hit_tokens_total") == 22
    assert fams["replaykv_cache_device_tier_resident_bytes"].type == "gauge"
    assert fams["replaykv_cache_store_tier_puts_ok_total"].type == "counter"
    assert value(fams, "replaykv_cache_swa_pool_found_total") == 1
    assert fams["replaykv_cache_swa_pool_age_at_hit_seconds"].type == "histogram"
    assert value(fams, "replaykv_cache_writes_done_total") == stats["writes"]["done"]
    assert all(math.isfinite(s.value) for fam in fams.values() for s in fam.samples)
    info = fams["replaykv_engine_info"].samples[0].labels
    assert info["model"] == "tiny-random-seed0" and info["decoder_replay"] == "true"
    assert fams["replaykv_cache_info"].samples[0].labels["write_policy"] == "v41"


def test_one_token_weighted_hit_rate_per_ledger(tmp_path: Path) -> None:
    text, stats = _two_turns(tmp_path)
    fams = families(text)
    for ledger in ("requests", "device", "store", "swa_pool"):
        p = f"replaykv_cache_{ledger}_"
        hit, asked = value(fams, p + "hit_tokens_total"), value(fams, p + "requested_tokens_total")
        assert asked > 0 and value(fams, p + "hit_rate") == hit / asked, ledger
        assert value(fams, p + "miss_tokens_total") == asked - hit
        assert (hit, asked) == (stats[ledger]["hit_tokens"], stats[ledger]["requested_tokens"])
    rates = [n for n in fams if n.endswith(("_rate", "_ratio"))]
    assert sorted(rates) == sorted(
        ["replaykv_cache_requests_hit_rate", "replaykv_cache_device_hit_rate", "replaykv_cache_store_hit_rate",
         "replaykv_cache_swa_pool_hit_rate", "replaykv_cache_store_tier_fill_ratio"]
    )  # fmt: skip
    # the SWA ledger counts window rows: a hit at H wants min(W, H) of them
    assert value(fams, "replaykv_cache_swa_pool_requested_tokens_total") == min(22, stats["window"])


def test_catalogue_follows_the_naming_rules() -> None:
    docs = [*catalogue(), *HTTP_METRICS]
    names = [d.name for d in docs]
    assert len(names) == len(set(names))
    for d in docs:
        assert NAME.match(d.name), d.name
        assert d.name.endswith("_total") == (d.kind == "counter"), f"{d.name}: counters and only counters end in _total"
        assert not re.search(r"_s(_|$)", d.name), f"{d.name}: seconds are spelled _seconds"
        assert d.help[0].isupper() and d.help.endswith((".", ")")), f"{d.name}: {d.help!r}"
        assert "statistic" not in d.help and "ledger histogram" not in d.help, d.name


def test_every_number_in_the_stats_is_exported_or_named(tmp_path: Path) -> None:
    _, stats = _two_turns(tmp_path)
    exported = {m.path for m in CACHE_METRICS}

    def leaves(node: dict[str, Any], path: tuple[str, ...]) -> list[tuple[str, ...]]:
        out = []
        for key, v in node.items():
            here = (*path, key)
            if isinstance(v, dict) and here not in exported:
                out += leaves(v, here)
            elif here not in (("caching",), ("window",)):
                out.append(here)
        return out

    missing = [p for p in leaves(stats, ()) if p not in exported and p not in NOT_EXPORTED]
    assert not missing, f"stats with no metric and no reason: {missing}"


def test_openmetrics_encoding_of_a_real_engine(tmp_path: Path) -> None:
    engine = make_engine(tmp_path)
    try:
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        engine.generate(Request(tuple(prompt_of(51, 20)), params, salt=b"t"))
        engine.flush_writeback()
        text = openmetrics.generate_latest(engine).decode()  # type: ignore[arg-type]
    finally:
        engine.shutdown()
    parsed = {f.name: f.type for f in openmetrics_parser.text_string_to_metric_families(text)}
    assert parsed["replaykv_cache_requests_lookups"] == "counter"
    assert parsed["replaykv_engine"] == "info" and parsed["replaykv_time_to_first_token_seconds"] == "histogram"


def test_exported_families_are_the_documented_ones(tmp_path: Path) -> None:
    text, _ = _two_turns(tmp_path)
    documented = {d.name: d.kind for d in catalogue()}
    for name, fam in families(text).items():
        kind = "info" if name.endswith("_info") else fam.type
        assert documented.get(name) == kind, f"{name} ({kind}) is not in the catalogue as such"


def test_docs_list_every_metric() -> None:
    rows = re.findall(r"^\| `(replaykv_[a-z0-9_]+)` \| (\w+) \|", DOCS.read_text(), re.M)
    assert rows, "docs/metrics.md has no metric table"
    assert dict(rows) == {d.name: d.kind for d in (*catalogue(), *HTTP_METRICS)}
    assert len(rows) == len(dict(rows))
