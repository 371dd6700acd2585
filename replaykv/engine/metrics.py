"""The engine's Prometheus families: every exported number named, typed and explained once.

For: the engine's own counters (:class:`EngineCounters`) and their families, from one
declarative catalogue (:data:`ENGINE_METRICS`; the ledgers' is ``replaykv.engine.cache_metrics``)
that also feeds the metric list in docs/metrics.md (``python scripts/metrics_table.py`` prints
it; a test keeps the two equal). ``Engine.collect()`` yields these families, so an engine
registers into any ``CollectorRegistry`` as a custom collector.

Naming: ``replaykv_`` prefix, base units in names (``_seconds``, ``_bytes``, ``_tokens``,
``_pages``), cumulative counts as counters ending in ``_total``, what exists now as gauges.
One hit rate per ledger, token-weighted: ``replaykv_cache_<ledger>_hit_rate`` is
``…_hit_tokens_total / …_requested_tokens_total`` since start (for a rate over a window, divide
the two counters' ``rate()`` in PromQL). A tier's ``gets``/``hits`` count operations and carry
no ratio.

Not for: the wire format (``prometheus_client`` encodes, negotiates and adds the process
collectors: see ``replaykv.server.metrics``) or HTTP metrics (the server's own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.core import InfoMetricFamily, Metric

from replaykv.cache.metrics import Counter, Histogram, LabeledCounter
from replaykv.engine.cache_metrics import CACHE_INFO, CACHE_METRICS, Kind, MetricDoc, cache_families, family

if TYPE_CHECKING:
    from replaykv.engine.engine import Engine

__all__ = ["ENGINE_METRICS", "EngineCounters", "catalogue", "engine_families", "markdown_table"]


# ------------------------------------------------------------------------------------------------
# The engine's own metrics
# ------------------------------------------------------------------------------------------------

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class EngineCounters:
    """The engine's own counters and histograms (the manager keeps the ledgers')."""

    def __init__(self) -> None:
        self.submitted = Counter()
        self.rejected = LabeledCounter()
        self.finished = LabeledCounter()
        self.by_path = LabeledCounter()
        self.ttft = Histogram(LATENCY_BUCKETS_S)
        self.itl = Histogram(LATENCY_BUCKETS_S)
        self.e2e = Histogram(LATENCY_BUCKETS_S)
        self.queue_wait = Histogram(LATENCY_BUCKETS_S)
        self.prompt_tokens = Counter()
        self.cached_tokens = Counter()
        self.replayed_tokens = Counter()
        self.prefill_work = Counter()
        self.full_prefill_work = Counter()
        self.snapshot_hits = Counter()
        self.prefill_tokens = Counter()
        self.prefilled_prompt_tokens = Counter()
        self.decode_tokens = Counter()
        self.decode_steps = Counter()
        self.commit_errors = Counter()
        self.images_encoded = Counter()
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0




@dataclass(frozen=True)
class EngineMetric:
    """One family of the engine itself; ``read`` returns a number, a histogram dict or a
    ``{label value: count}`` dict (with ``label``)."""

    name: str
    kind: Kind
    help: str
    read: Callable[[Engine], Any]
    label: str = ""

    @property
    def doc(self) -> MetricDoc:
        labels = (self.label,) if self.label else ()
        suffix = "_total" if self.kind == "counter" else ""
        return MetricDoc(self.name + suffix, self.kind, self.help, labels)


def _per_second(count: float, seconds: float) -> float:
    return count / seconds if seconds else 0.0


_P = "replaykv_"
ENGINE_METRICS: tuple[EngineMetric, ...] = (
    EngineMetric(_P + "requests_rejected", "counter", "Requests refused at submit, by reason (invalid, queue_full).",
                 lambda e: e.metrics.rejected.as_dict(), "reason"),
    EngineMetric(_P + "requests_finished", "counter", "Requests finished, by finish reason (stop, length, cancelled, error).",
                 lambda e: e.metrics.finished.as_dict(), "reason"),
    EngineMetric(_P + "requests_by_path", "counter", "Prefills by the path they took: cold, hit (snapshot), bounded (replay), exact, truncate or full.",
                 lambda e: e.metrics.by_path.as_dict(), "path"),
    EngineMetric(_P + "time_to_first_token_seconds", "histogram", "Time from submit to a request's first token.",
                 lambda e: e.metrics.ttft.as_dict()),
    EngineMetric(_P + "inter_token_latency_seconds", "histogram", "Time between two consecutive tokens of a request.",
                 lambda e: e.metrics.itl.as_dict()),
    EngineMetric(_P + "e2e_request_latency_seconds", "histogram", "Time from submit to a request's final delta.",
                 lambda e: e.metrics.e2e.as_dict()),
    EngineMetric(_P + "queue_wait_seconds", "histogram", "Time from submit to admission into a decode slot.",
                 lambda e: e.metrics.queue_wait.as_dict()),
    EngineMetric(_P + "requests_submitted", "counter", "Requests admitted to the waiting queue.",
                 lambda e: e.metrics.submitted.value),
    EngineMetric(_P + "prompt_tokens", "counter", "Prompt tokens of admitted requests.",
                 lambda e: e.metrics.prompt_tokens.value),
    EngineMetric(_P + "cached_tokens", "counter", "Prompt tokens whose cached global KV was reused instead of computed.",
                 lambda e: e.metrics.cached_tokens.value),
    EngineMetric(_P + "replayed_tokens", "counter", "Cached prompt rows recomputed by bounded replay (the last window before the hit).",
                 lambda e: e.metrics.replayed_tokens.value),
    EngineMetric(_P + "prefill_work_layer_tokens", "counter", "Layer × token products the prefills ran (the work replay saves shows against the next family).",
                 lambda e: e.metrics.prefill_work.value),
    EngineMetric(_P + "full_prefill_work_layer_tokens", "counter", "Layer × token products the same prefills would have run cold.",
                 lambda e: e.metrics.full_prefill_work.value),
    EngineMetric(_P + "snapshot_hits", "counter", "Prefills that continued from a window snapshot (exact, no replay).",
                 lambda e: e.metrics.snapshot_hits.value),
    EngineMetric(_P + "prefill_rows", "counter", "Rows run through prefill pieces, any layer range (replay rows included).",
                 lambda e: e.metrics.prefill_tokens.value),
    EngineMetric(_P + "prefill_tokens", "counter", "Prompt tokens of finished prefills (cached tokens included).",
                 lambda e: e.metrics.prefilled_prompt_tokens.value),
    EngineMetric(_P + "prefill_seconds", "counter", "Engine time spent in prefill pieces.",
                 lambda e: e.metrics.prefill_seconds),
    EngineMetric(_P + "decode_tokens", "counter", "Tokens produced by batched decode steps.",
                 lambda e: e.metrics.decode_tokens.value),
    EngineMetric(_P + "decode_steps", "counter", "Batched decode forwards.",
                 lambda e: e.metrics.decode_steps.value),
    EngineMetric(_P + "decode_seconds", "counter", "Engine time spent in decode forwards.",
                 lambda e: e.metrics.decode_seconds),
    EngineMetric(_P + "commit_errors", "counter", "Cache write-back commits that raised (the answer was served; the entry was not kept).",
                 lambda e: e.metrics.commit_errors.value),
    EngineMetric(_P + "images_encoded", "counter", "Images the vision tower ran for (an image whose span vectors were cached, or whose rows no layer-0 call ran, is not encoded).",
                 lambda e: e.metrics.images_encoded.value),
    EngineMetric(_P + "image_feature_cache_hits", "counter", "Image span vectors served from the feature cache instead of the tower.",
                 lambda e: e.features.stats.hits),
    EngineMetric(_P + "queue_depth", "gauge", "Requests waiting for a decode slot.",
                 lambda e: e.queue_depth()),
    EngineMetric(_P + "running_requests", "gauge", "Requests holding a decode slot (prefilling or decoding).",
                 lambda e: e.running()),
    EngineMetric(_P + "max_batch", "gauge", "Decode slots (--max-batch).",
                 lambda e: e.config.max_batch),
    EngineMetric(_P + "prefill_tokens_per_second", "gauge", "Prompt tokens per prefill second since start (cached tokens included).",
                 lambda e: _per_second(e.metrics.prefilled_prompt_tokens.value, e.metrics.prefill_seconds)),
    EngineMetric(_P + "decode_tokens_per_second", "gauge", "Decode tokens per decode second since start (all rows of a step together).",
                 lambda e: _per_second(e.metrics.decode_tokens.value, e.metrics.decode_seconds)),
)  # fmt: skip

ENGINE_INFO = MetricDoc(
    _P + "engine_info", "info", "The served model and the replay switches (value 1).",
    ("model", "preset", "encoder_replay", "decoder_replay", "swa_miss_strategy"),
)  # fmt: skip

def engine_families(engine: Engine) -> Iterator[Metric]:
    """The engine's families, then the ledgers' when caching is on (``Engine.collect()``)."""
    cfg = engine.config
    info = {
        "model": engine.model_name,
        "preset": cfg.preset if cfg.model_dir is None else "",
        "encoder_replay": str(cfg.enable_encoder_swa_bounded_replay).lower(),
        "decoder_replay": str(cfg.enable_decoder_swa_bounded_replay).lower(),
        "swa_miss_strategy": cfg.swa_miss_strategy,
    }
    yield InfoMetricFamily(ENGINE_INFO.name.removesuffix("_info"), ENGINE_INFO.help, value=info)
    for m in ENGINE_METRICS:
        fam = family(m.kind, m.name, m.help, m.read(engine), m.label)
        if fam is not None:
            yield fam
    if engine.cache is not None:
        yield from cache_families(engine.cache.stats())


def catalogue() -> list[MetricDoc]:
    """Every family the engine can export, as docs/metrics.md lists them."""
    return [ENGINE_INFO, *(m.doc for m in ENGINE_METRICS), CACHE_INFO, *(m.doc for m in CACHE_METRICS)]


def markdown_table(docs: list[MetricDoc]) -> str:
    rows = ["| name | type | labels | meaning |", "|---|---|---|---|"]
    for d in docs:
        rows.append(f"| `{d.name}` | {d.kind} | {', '.join(d.labels)} | {d.help.replace('|', '/')} |")
    return "\n".join(rows) + "\n"

