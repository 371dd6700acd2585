"""The capacity planner: deployment figures from a model config and a :class:`Workload`.

`plan(config, workload)` answers the deployment questions of the source documents, every figure
computed from the config (through :class:`~replaykv.model.accounting.KVLedger`) and the workload:

1. **Ledgers and storage.** Bytes per token and per request of the global KV, the window state
   and the persistent cache; storage over the retention period under the V4 policy (global KV +
   `snapshots_per_turn` window snapshots per turn persisted) and the V4.1 policy (global KV only);
   the break-even turn length L* = snapshots_per_turn × window_state / global_per_token.
2. **SWA pool.** Model: sessions arrive as a Poisson stream; each turn writes
   `snapshots_per_turn` pool entries (one snapshot each, keyed by prefix) that live for the TTL;
   the next turn comes a think time T later and hits iff its snapshot is still there. With
   unlimited RAM, hit = P(T ≤ TTL). Entries held (Little's law) = entry rate × TTL; when that
   exceeds the pool's capacity C the LRU pool behaves like a TTL cache with the characteristic
   time t_C = C / entry rate (Che's approximation), so hit = P(T ≤ min(TTL, t_C)). The TTL for a
   target hit rate is the think-time quantile at that rate.
3. **Replay compute** in layer × token rows (see :class:`KVLedger`): per pool miss, bounded replay
   full_layers × W, exact replay Σ_k (W + k(W − 1)), a full re-prefill of the cached context;
   the saving of decoder replay versus prompt length; the work pool misses add per hour at the
   expected miss rate, against the hour's prefill work.
4. **Device memory.** Global KV (+ the window state) of N concurrent contexts of length L.
5. **Multimodal loading condition** ρ < (B_IO / B_GPU) · C, with its verdict and margin.

Images (V4.1): an image is a span of ordinary positions, so a workload's images
(`images_per_turn` × the span of one image, :func:`~replaykv.model.accounting.image_ledger`) are
added to every turn's input tokens (first turn included) and reach every ledger, the storage,
the pool's turn lengths, the compute and the device figures through them; section 1c shows what
one image costs in each ledger, the feature cache and the tower, and the images' share of a
session. A config without a ``vision_config`` (the ``v41-flash`` text backbone) is accounted
with the released image path's settings.

Not for: the plots (:mod:`replaykv.plan.plots`) or the command line (:mod:`replaykv.plan.cli`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replaykv.model.accounting import (
    AnyConfig,
    ImageLedger,
    KVLedger,
    image_ledger,
    parameter_count,
    released_vision,
)
from replaykv.model.config import DeepseekV4Config
from replaykv.model.config_v41 import COMPOSITE_MODEL_TYPE, FLAT_MODEL_TYPE, DeepseekV41Config
from replaykv.plan.workload import Distribution, Workload, shifted

MIB = 2**20
GIB = 2**30
# Prompt lengths at which the decoder-replay saving is tabulated (a grid, not a result).
SAVING_PROMPTS = (512, 2048, 8192, 32768, 131072, 1048576)


def load_model_config(spec: str, *, backbone_only: bool = False) -> AnyConfig:
    """A preset name (``v41-flash``, ``v4-flash``, ...) or a ``config.json`` path (or its directory)."""
    from replaykv.model.presets import all_presets

    presets = all_presets()
    if spec in presets:
        return presets[spec]()
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ValueError(
            f"model {spec!r} is neither a preset ({sorted(presets)}) nor an existing "
            "config.json (or a directory holding one)"
        )
    raw = json.loads(path.read_text())
    model_type = raw.get("model_type")
    if model_type in (FLAT_MODEL_TYPE, COMPOSITE_MODEL_TYPE):
        return DeepseekV41Config.from_dict(raw, backbone_only=backbone_only)
    if model_type == DeepseekV4Config.model_type:
        return DeepseekV4Config.from_dict(raw)
    raise ValueError(
        f"{path}: model_type {model_type!r} is not one the planner knows "
        f"({FLAT_MODEL_TYPE!r}, {COMPOSITE_MODEL_TYPE!r}, {DeepseekV4Config.model_type!r})"
    )


# ---------------------------------------------------------------------------------------------
# Report sections
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ledgers:
    """(1) Bytes per token and per request of each ledger."""

    global_bytes_per_token: float
    global_bytes_per_token_exact: str  # as a fraction
    window_state_bytes: int  # every layer
    window_state_bytes_through_cut: int  # layers 0..decoder cut
    compressor_tail_bytes: int
    snapshot_bytes: int  # one SWA-pool entry: window state + tails
    mean_session_tokens: float
    global_bytes_per_session: float
    mean_turn_tokens: float  # tokens a turn adds (input + output)
    persistent_bytes_per_token_v4_policy: float  # at the mean turn
    persistent_bytes_per_token_v41_policy: float
    snapshots_per_turn: int
    break_even_turn_tokens: float
    share_of_turns_below_break_even: float
    decode_context_tokens: int
    decode_read_bytes: int
    decode_index_scan_bytes: int


@dataclass(frozen=True)
class Storage:
    """(1) Persistent storage over the retention period, both policies, against the fleet's SSD."""

    retention_s: float
    sessions_retained: float
    v4_policy_bytes: float
    v41_policy_bytes: float
    v4_over_v41: float
    ssd_bytes: float  # fleet
    v4_policy_fits: bool
    v41_policy_fits: bool
    v4_policy_max_retention_s: float
    v41_policy_max_retention_s: float


@dataclass(frozen=True)
class Images:
    """(1c) What the workload's images cost: one image per ledger, and their share of a session."""

    vision: str  # where the image path's settings came from
    size: list[int] | None  # (width, height) asked for; None when given by span length
    per_image: dict[str, Any]  # ImageLedger.as_dict()
    images_per_turn: float
    positions_per_turn: float  # added to every turn's input tokens
    images_per_session: float
    positions_per_session: float
    share_of_session_tokens: float
    global_bytes_per_session: float  # of the image positions (= their persistent bytes, V4.1 policy)
    storage_bytes: float  # over the retention period (part of both policies' storage)
    feature_bytes_per_session: float  # span vectors, if every image of a session is distinct
    images_per_hour: float  # whole fleet
    # every image encoded once (a repeated one hits the feature cache); None without a grid
    tower_patch_rows_per_hour: float | None


@dataclass(frozen=True)
class Pool:
    """(2) SWA host pool sizing and hit rate."""

    pool_bytes_per_machine: float
    pool_bytes: float  # fleet
    entry_bytes: int
    capacity_entries: int
    capacity_sessions: int  # sessions whose latest turn's snapshots fit
    active_sessions: float  # sessions between turns at any moment (arrivals × mean session length)
    entries_per_second: float
    entries_demanded_at_ttl: float
    ttl_s: float
    characteristic_time_s: float  # t_C = capacity / entry rate
    effective_ttl_s: float
    hit_rate_unlimited: float  # P(T <= TTL)
    hit_rate: float  # P(T <= min(TTL, t_C))
    capacity_limited: bool
    target_hit_rate: float
    ttl_for_target_s: float
    pool_bytes_per_machine_for_target: float
    pool_fraction_for_target: float
    target_reachable: bool


@dataclass(frozen=True)
class Compute:
    """(3) Replay compute in layer × token rows."""

    window: int
    convention: str
    decoder_replay: bool
    full_layers: int
    tail_layers: int
    bounded_replay_per_miss: int
    exact_replay_per_miss: int
    exact_over_bounded: float
    mean_cached_tokens: float
    full_reprefill_per_miss: float
    mean_turn_prefill: float  # a follow-up turn's own prefill (hit)
    bounded_over_turn_prefill: float
    decoder_replay_saving: list[dict[str, float]]  # per prompt length
    follow_up_turns_per_hour: float
    misses_per_hour: float
    prefill_work_per_hour: float
    miss_work_per_hour: float  # bounded replay at the expected miss rate
    miss_overhead: float  # miss work / prefill work
    exact_miss_work_per_hour: float
    full_reprefill_miss_work_per_hour: float


@dataclass(frozen=True)
class Device:
    """(4) Device memory for N concurrent contexts of length L (per machine)."""

    contexts: int
    context_tokens: int
    global_bytes_per_context: int
    window_bytes_per_context: int
    total_bytes: int
    device_memory: float
    fits: bool
    max_contexts: int
    global_bytes_per_million_tokens: int


@dataclass(frozen=True)
class Multimodal:
    """(5) ρ < (B_IO / B_GPU) · C."""

    raw_bytes_per_token: float
    compute_per_token: float
    compute_derived: bool  # C = 6 × active matmul parameters
    io_bandwidth: float
    gpu_flops: float
    threshold_bytes_per_token: float  # (B_IO / B_GPU) · C
    loading_is_bottleneck: bool
    margin: float  # threshold / ρ (> 1: headroom)


@dataclass(frozen=True)
class Plan:
    model: str
    family: str
    num_layers: int
    decoder_cut: int
    workload: dict[str, Any]
    ledgers: Ledgers
    storage: Storage
    images: Images | None
    pool: Pool
    compute: Compute
    device: Device
    multimodal: Multimodal | None
    # Inputs, for the plots; not serialised.
    ledger: KVLedger = field(repr=False, compare=False)
    inputs: Workload = field(repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("ledger", "inputs"):
                continue
            v = getattr(self, f.name)
            out[f.name] = (
                dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v
            )
        return _finite(out)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _finite(obj: Any) -> Any:
    """JSON has no infinity: write it as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------------
# The arithmetic
# ---------------------------------------------------------------------------------------------


def _prob_sum_below(a: Distribution, b: Distribution, limit: float, points: int = 400) -> float:
    """P(A + B < limit) for independent A, B: the mean over A's quantiles of F_B(limit − a)."""
    total = 0.0
    for i in range(points):
        x = a.quantile((i + 0.5) / points)
        total += b.cdf(math.nextafter(limit - x, -math.inf)) if limit - x > 0 else 0.0
    return total / points


def expected_prefill_work(ledger: KVLedger, tokens: Distribution, w: Workload, window: int) -> float:
    """E[prefill rows] of a prefill whose new-token count follows `tokens` (linear but for min(W, ·))."""
    full = ledger.full_layers(decoder_replay=w.decoder_replay, convention=w.convention)
    return full * tokens.mean() + (ledger.num_layers - full) * tokens.mean_min(window)


def hit_rate(workload: Workload, ttl: float, capacity_entries: float, entries_per_second: float) -> float:
    """P(think time <= min(TTL, t_C)), t_C = capacity / entry rate (module docstring, point 2)."""
    t_c = capacity_entries / entries_per_second if entries_per_second > 0 else math.inf
    return workload.think_time.cdf(min(ttl, t_c))


def workload_image(config: AnyConfig, workload: Workload) -> tuple[ImageLedger, str] | None:
    """One of the workload's images under `config` and where the image path's settings came
    from; None when the workload names no image size."""
    w = workload
    if w.image_size is None and w.image_tokens is None:
        return None
    vision = getattr(config, "vision_config", None)
    source = "the config's vision_config"
    if vision is None and isinstance(config, DeepseekV41Config):
        vision, source = released_vision(), "released defaults (the config has no vision_config)"
    image = image_ledger(config, size=w.image_size, positions=w.image_tokens, vision=vision)
    return image, source


def plan(config: AnyConfig, workload: Workload, *, model_name: str | None = None) -> Plan:
    """All planner figures for `config` under `workload`."""
    w = workload
    ledger = KVLedger.from_config(config)
    window = w.replay_window or ledger.window
    n = w.turns_per_session
    k = w.snapshots_per_turn
    g = ledger.global_bytes_per_token()
    g_f = float(g)

    # Images are input positions of every turn (the first included).
    image = workload_image(config, w)
    image_positions = w.images_per_turn * image[0].positions if image is not None else 0.0
    first_turn = shifted(w.first_turn, image_positions)
    turn_in = shifted(w.turn_tokens, image_positions)

    t_first, t_in, t_out = first_turn.mean(), turn_in.mean(), w.output_tokens.mean()
    session_tokens = t_first + (n - 1) * t_in + n * t_out
    turn_tokens = t_in + t_out
    window_state = ledger.window_state_bytes()
    break_even = float(ledger.break_even_turn_tokens(k)) if g else math.inf
    ledgers = Ledgers(
        global_bytes_per_token=g_f,
        global_bytes_per_token_exact=str(g),
        window_state_bytes=window_state,
        window_state_bytes_through_cut=ledger.window_state_bytes_through_cut(),
        compressor_tail_bytes=ledger.compressor_tail_bytes(),
        snapshot_bytes=ledger.snapshot_bytes(),
        mean_session_tokens=session_tokens,
        global_bytes_per_session=g_f * session_tokens,
        mean_turn_tokens=turn_tokens,
        persistent_bytes_per_token_v4_policy=g_f + k * window_state / turn_tokens,
        persistent_bytes_per_token_v41_policy=g_f,
        snapshots_per_turn=k,
        break_even_turn_tokens=break_even,
        share_of_turns_below_break_even=_prob_sum_below(turn_in, w.output_tokens, break_even),
        decode_context_tokens=round(session_tokens),
        decode_read_bytes=ledger.decode_read_bytes(round(session_tokens)),
        decode_index_scan_bytes=ledger.decode_index_scan_bytes(round(session_tokens)),
    )

    sessions_per_s = w.sessions_per_hour / 3600.0
    sessions_retained = sessions_per_s * w.retention
    v41_session = g_f * session_tokens
    v4_session = v41_session + n * k * window_state
    ssd = w.machines * w.ssd
    storage = Storage(
        retention_s=w.retention,
        sessions_retained=sessions_retained,
        v4_policy_bytes=sessions_retained * v4_session,
        v41_policy_bytes=sessions_retained * v41_session,
        v4_over_v41=v4_session / v41_session if v41_session else math.inf,
        ssd_bytes=ssd,
        v4_policy_fits=sessions_retained * v4_session <= ssd,
        v41_policy_fits=sessions_retained * v41_session <= ssd,
        v4_policy_max_retention_s=ssd / (sessions_per_s * v4_session),
        v41_policy_max_retention_s=ssd / (sessions_per_s * v41_session) if v41_session else math.inf,
    )

    images = None
    if image is not None:
        im, source = image
        per_session = n * w.images_per_turn
        patch_rows = im.patch_rows
        images = Images(
            vision=source,
            size=list(w.image_size) if w.image_size is not None else None,
            per_image=im.as_dict(),
            images_per_turn=w.images_per_turn,
            positions_per_turn=image_positions,
            images_per_session=per_session,
            positions_per_session=n * image_positions,
            share_of_session_tokens=n * image_positions / session_tokens,
            global_bytes_per_session=g_f * n * image_positions,
            storage_bytes=sessions_retained * g_f * n * image_positions,
            feature_bytes_per_session=per_session * im.feature_bytes,
            images_per_hour=w.sessions_per_hour * per_session,
            tower_patch_rows_per_hour=None
            if patch_rows is None
            else w.sessions_per_hour * per_session * patch_rows,
        )

    entry = ledger.snapshot_bytes()
    pool_per_machine = w.host_ram * w.pool_fraction
    pool_bytes = w.machines * pool_per_machine
    capacity = int(pool_bytes // entry)
    entries_per_s = sessions_per_s * n * k
    t_c = capacity / entries_per_s
    ttl_target = w.think_time.quantile(w.target_hit_rate)
    bytes_for_target = entries_per_s * ttl_target * entry / w.machines
    pool = Pool(
        pool_bytes_per_machine=pool_per_machine,
        pool_bytes=pool_bytes,
        entry_bytes=entry,
        capacity_entries=capacity,
        capacity_sessions=capacity // k,
        active_sessions=sessions_per_s * (n - 1) * w.think_time.mean(),
        entries_per_second=entries_per_s,
        entries_demanded_at_ttl=entries_per_s * w.swa_ttl,
        ttl_s=w.swa_ttl,
        characteristic_time_s=t_c,
        effective_ttl_s=min(w.swa_ttl, t_c),
        hit_rate_unlimited=w.think_time.cdf(w.swa_ttl),
        hit_rate=hit_rate(w, w.swa_ttl, capacity, entries_per_s),
        capacity_limited=t_c < w.swa_ttl,
        target_hit_rate=w.target_hit_rate,
        ttl_for_target_s=ttl_target,
        pool_bytes_per_machine_for_target=bytes_for_target,
        pool_fraction_for_target=bytes_for_target / w.host_ram,
        target_reachable=bytes_for_target <= pool_per_machine,
    )

    full = ledger.full_layers(decoder_replay=w.decoder_replay, convention=w.convention)
    bounded = ledger.bounded_replay_work(
        window=window, decoder_replay=w.decoder_replay, convention=w.convention
    )
    exact = ledger.exact_replay_work(window=window, decoder_replay=w.decoder_replay, convention=w.convention)
    mean_cached = t_first + t_out + (n - 2) / 2 * turn_tokens if n > 1 else 0.0
    reprefill = full * mean_cached + (ledger.num_layers - full) * min(window, mean_cached)
    turn_prefill = expected_prefill_work(ledger, turn_in, w, window)
    savings = []
    for p in SAVING_PROMPTS:
        off = ledger.prefill_work(p, window=window, decoder_replay=False)
        on = ledger.prefill_work(p, window=window, decoder_replay=True, convention=w.convention)
        savings.append({"prompt_tokens": p, "work_off": off, "work_on": on, "saving": 1 - on / off})
    follow_ups = w.sessions_per_hour * (n - 1)
    misses = follow_ups * (1 - pool.hit_rate)
    prefill_hour = w.sessions_per_hour * expected_prefill_work(ledger, first_turn, w, window)
    prefill_hour += follow_ups * turn_prefill
    compute = Compute(
        window=window,
        convention=w.convention,
        decoder_replay=w.decoder_replay,
        full_layers=full,
        tail_layers=ledger.num_layers - full,
        bounded_replay_per_miss=bounded,
        exact_replay_per_miss=exact,
        exact_over_bounded=exact / bounded,
        mean_cached_tokens=mean_cached,
        full_reprefill_per_miss=reprefill,
        mean_turn_prefill=turn_prefill,
        bounded_over_turn_prefill=bounded / turn_prefill if turn_prefill else math.inf,
        decoder_replay_saving=savings,
        follow_up_turns_per_hour=follow_ups,
        misses_per_hour=misses,
        prefill_work_per_hour=prefill_hour,
        miss_work_per_hour=misses * bounded,
        miss_overhead=misses * bounded / prefill_hour if prefill_hour else math.inf,
        exact_miss_work_per_hour=misses * exact,
        full_reprefill_miss_work_per_hour=misses * reprefill,
    )

    ctx = w.device_context_tokens or max(1, round(session_tokens))
    per_context_global = ledger.global_bytes(ctx)
    per_context_window = ledger.snapshot_bytes()
    total = w.concurrency * (per_context_global + per_context_window)
    device = Device(
        contexts=w.concurrency,
        context_tokens=ctx,
        global_bytes_per_context=per_context_global,
        window_bytes_per_context=per_context_window,
        total_bytes=total,
        device_memory=w.device_memory,
        fits=total <= w.device_memory,
        max_contexts=int(w.device_memory // (per_context_global + per_context_window)),
        global_bytes_per_million_tokens=ledger.global_bytes(10**6),
    )

    multimodal = None
    if w.multimodal is not None:
        mm = w.multimodal
        derived = mm.compute_per_token is None
        from replaykv.plan.loading import Hardware, loading_condition

        c = 6.0 * parameter_count(config).active_matmul if derived else float(mm.compute_per_token or 0)
        verdict = loading_condition(mm.raw_bytes_per_token, c, Hardware(mm.io_bandwidth, mm.gpu_flops))
        multimodal = Multimodal(
            raw_bytes_per_token=mm.raw_bytes_per_token,
            compute_per_token=c,
            compute_derived=derived,
            io_bandwidth=mm.io_bandwidth,
            gpu_flops=mm.gpu_flops,
            threshold_bytes_per_token=verdict.threshold_bytes_per_token,
            loading_is_bottleneck=not verdict.holds,
            margin=verdict.margin,
        )

    return Plan(
        model=model_name or type(config).__name__,
        family=ledger.family,
        num_layers=ledger.num_layers,
        decoder_cut=ledger.decoder_cut,
        workload=w.to_dict(),
        ledgers=ledgers,
        storage=storage,
        images=images,
        pool=pool,
        compute=compute,
        device=device,
        multimodal=multimodal,
        ledger=ledger,
        inputs=w,
    )


# ---------------------------------------------------------------------------------------------
# Terminal table
# ---------------------------------------------------------------------------------------------


def fmt_bytes(b: float) -> str:
    """``2,703,360 B (2.70 MB, 2.58 MiB)``; large values in GB/GiB or TB/TiB."""
    if not math.isfinite(b):
        return "unbounded"
    if abs(b) < 10_000:
        return f"{b:,.2f} B".replace(".00 B", " B")
    for dec, bin_, name_d, name_b in ((1e15, 2**50, "PB", "PiB"), (1e12, 2**40, "TB", "TiB"),
                                      (1e9, 2**30, "GB", "GiB"), (1e6, 2**20, "MB", "MiB")):  # fmt: skip
        if abs(b) >= dec:
            return f"{b:,.0f} B ({b / dec:.2f} {name_d}, {b / bin_:.2f} {name_b})"
    return f"{b:,.0f} B ({b / 1e3:.2f} kB, {b / 2**10:.2f} KiB)"


def fmt_time(s: float) -> str:
    if not math.isfinite(s):
        return "unbounded"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min ({s:,.0f} s)"
    return f"{s / 3600:.1f} h"


def _rows(plan: Plan) -> list[tuple[str, list[tuple[str, str]]]]:
    L, S, P, C, D, M = plan.ledgers, plan.storage, plan.pool, plan.compute, plan.device, plan.multimodal
    k = L.snapshots_per_turn
    sections: list[tuple[str, list[tuple[str, str]]]] = []
    sections.append((
        "1. Ledgers",
        [
            ("global KV per token", f"{L.global_bytes_per_token:,.2f} B  (exact {L.global_bytes_per_token_exact})"),
            ("window state per request, all layers", fmt_bytes(L.window_state_bytes)),
            (f"window state, layers 0..{plan.decoder_cut} (decoder cut)", fmt_bytes(L.window_state_bytes_through_cut)),
            ("compressor tails per request", fmt_bytes(L.compressor_tail_bytes)),
            ("SWA pool entry (window state + tails)", fmt_bytes(L.snapshot_bytes)),
            ("mean session length", f"{L.mean_session_tokens:,.0f} tokens"),
            ("global KV per session", fmt_bytes(L.global_bytes_per_session)),
            (f"persistent per token, V4 policy (turn {L.mean_turn_tokens:,.0f} tok)",
             f"{L.persistent_bytes_per_token_v4_policy:,.1f} B"),
            ("persistent per token, V4.1 policy", f"{L.persistent_bytes_per_token_v41_policy:,.1f} B"),
            (f"break-even turn length ({k} snapshots/turn)", f"{L.break_even_turn_tokens:,.0f} tokens"),
            ("turns below break-even", f"{100 * L.share_of_turns_below_break_even:.1f} %"),
            (f"decode reads per token at {L.decode_context_tokens:,} tokens",
             f"{fmt_bytes(L.decode_read_bytes)} + index scan {fmt_bytes(L.decode_index_scan_bytes)}"),
        ],
    ))  # fmt: skip
    sections.append((
        f"1b. Storage over {fmt_time(S.retention_s)} retention ({S.sessions_retained:,.0f} sessions)",
        [
            ("V4 policy (global KV + window snapshots)", fmt_bytes(S.v4_policy_bytes)),
            ("V4.1 policy (global KV only)", fmt_bytes(S.v41_policy_bytes)),
            ("V4 / V4.1", f"{S.v4_over_v41:.2f}x"),
            ("fleet SSD", fmt_bytes(S.ssd_bytes)),
            ("fits: V4 policy / V4.1 policy", f"{'yes' if S.v4_policy_fits else 'NO'} / "
             f"{'yes' if S.v41_policy_fits else 'NO'}"),
            ("longest retention that fits: V4 / V4.1",
             f"{fmt_time(S.v4_policy_max_retention_s)} / {fmt_time(S.v41_policy_max_retention_s)}"),
        ],
    ))  # fmt: skip
    if plan.images is not None:
        sections.append(_image_rows(plan.images, plan.num_layers))
    sections.append((
        "2. SWA pool",
        [
            ("pool per machine / fleet", f"{fmt_bytes(P.pool_bytes_per_machine)} / {fmt_bytes(P.pool_bytes)}"),
            ("capacity", f"{P.capacity_entries:,} entries = {P.capacity_sessions:,} sessions ({k} per turn)"),
            ("active sessions (between turns)", f"{P.active_sessions:,.0f}"),
            ("entries demanded at TTL", f"{P.entries_demanded_at_ttl:,.0f} ({P.entries_per_second:,.1f}/s)"),
            ("TTL / characteristic time t_C", f"{fmt_time(P.ttl_s)} / {fmt_time(P.characteristic_time_s)}"),
            ("hit rate (RAM unlimited)", f"{100 * P.hit_rate_unlimited:.1f} %"),
            ("hit rate (this pool)", f"{100 * P.hit_rate:.1f} %" + ("  [capacity-limited]" if P.capacity_limited else "")),
            (f"TTL for {100 * P.target_hit_rate:.0f} % hits", fmt_time(P.ttl_for_target_s)),
            ("pool per machine for that TTL",
             f"{fmt_bytes(P.pool_bytes_per_machine_for_target)} = {100 * P.pool_fraction_for_target:.1f} % of RAM"
             + ("" if P.target_reachable else "  [exceeds the pool]")),
        ],
    ))  # fmt: skip
    rows = [
        (f"layers that run every row ({C.convention} accounting)", f"{C.full_layers} of {plan.num_layers}"),
        (f"bounded replay per miss (W = {C.window})", f"{C.bounded_replay_per_miss:,} layer x tokens"),
        ("exact replay per miss", f"{C.exact_replay_per_miss:,} ({C.exact_over_bounded:.2f}x bounded)"),
        (
            f"full re-prefill per miss ({C.mean_cached_tokens:,.0f} cached)",
            f"{C.full_reprefill_per_miss:,.0f}",
        ),
        ("bounded replay / a follow-up turn's prefill", f"{100 * C.bounded_over_turn_prefill:.1f} %"),
        ("misses per hour", f"{C.misses_per_hour:,.0f} of {C.follow_up_turns_per_hour:,.0f} follow-up turns"),
        (
            "miss work per hour (bounded)",
            f"{C.miss_work_per_hour:,.3g} = {100 * C.miss_overhead:.2f} % of prefill",
        ),
        (
            "  if exact / if full re-prefill",
            f"{C.exact_miss_work_per_hour:,.3g} / {C.full_reprefill_miss_work_per_hour:,.3g}",
        ),
    ]
    for s in C.decoder_replay_saving:
        rows.append(
            (f"decoder replay saving at {s['prompt_tokens']:,.0f} tokens", f"{100 * s['saving']:.1f} %")
        )
    sections.append(("3. Replay compute", rows))
    sections.append((
        "4. Device memory (per machine)",
        [
            (f"{D.contexts} contexts x {D.context_tokens:,} tokens, global KV",
             fmt_bytes(D.contexts * D.global_bytes_per_context)),
            ("  + window state", fmt_bytes(D.contexts * D.window_bytes_per_context)),
            ("total / available", f"{fmt_bytes(D.total_bytes)} / {fmt_bytes(D.device_memory)}"
             + ("" if D.fits else "  [does not fit]")),
            ("max such contexts", f"{D.max_contexts:,}"),
            ("global KV of one million tokens", fmt_bytes(D.global_bytes_per_million_tokens)),
        ],
    ))  # fmt: skip
    if M is not None:
        sections.append((
            "5. Multimodal loading  rho < (B_IO / B_GPU) * C",
            [
                ("rho (raw bytes per token)", f"{M.raw_bytes_per_token:,.0f} B"),
                ("C (compute per token)", f"{M.compute_per_token:.3g} FLOP" + (" (6 x active params)" if M.compute_derived else "")),
                ("B_IO / B_GPU", f"{M.io_bandwidth:.3g} B/s / {M.gpu_flops:.3g} FLOP/s"),
                ("threshold (B_IO / B_GPU) * C", f"{M.threshold_bytes_per_token:,.0f} B per token"),
                ("verdict", ("loading IS the bottleneck" if M.loading_is_bottleneck else "loading is not the bottleneck")
                 + f" (margin {M.margin:.2f}x)"),
            ],
        ))  # fmt: skip
    return sections


def _image_rows(section: Images, layers: int) -> tuple[str, list[tuple[str, str]]]:
    im = section.per_image
    what = "given by its span length"
    if section.size is not None:
        (width, height), (canvas_h, canvas_w), (rows, cols) = section.size, im["canvas"], im["grid"]
        what = f"{width}x{height} px -> canvas {canvas_w}x{canvas_h}, grid {rows}x{cols}"
    rows = [
        ("one image", what),
        ("  positions (span)", f"{im['positions']:,}"),
        ("  global KV (device)", fmt_bytes(im["global_kv_bytes"])),
        (f"  window state it occupies (<= {im['window']} positions x {layers} layers)", fmt_bytes(im["window_bytes"])),
        ("  persistent (V4.1 policy)", fmt_bytes(im["persistent_bytes"])),
        ("  feature cache (span vectors, bf16)", fmt_bytes(im["feature_bytes"])),
        ("  tower work", "unknown (no grid)" if im["patches"] is None
         else f"{im['patches']:,} patches = {im['patch_rows']:,} layer x patch rows"),
        ("image settings", section.vision),
    ]  # fmt: skip
    if section.images_per_turn > 0:
        rows += [
            ("images per turn / per session", f"{section.images_per_turn:g} / {section.images_per_session:,.1f}"),
            ("image positions per session", f"{section.positions_per_session:,.0f} ({100 * section.share_of_session_tokens:.1f} % of the session)"),
            ("global KV of a session's images", fmt_bytes(section.global_bytes_per_session)),
            ("storage of images over the retention", fmt_bytes(section.storage_bytes)),
            ("feature cache of a session's images", fmt_bytes(section.feature_bytes_per_session)),
            ("images per hour, tower work", f"{section.images_per_hour:,.0f}" + (
                "" if section.tower_patch_rows_per_hour is None
                else f", {section.tower_patch_rows_per_hour:.3g} layer x patch rows (each encoded once)")),
        ]  # fmt: skip
    return "1c. Images (counted into every turn's input tokens)", rows


def format_table(plan: Plan) -> str:
    """The plan as a readable terminal table."""
    lines = [
        f"replaykv plan: {plan.model} ({plan.family}, {plan.num_layers} layers, decoder cut {plan.decoder_cut})"
    ]
    for title, rows in _rows(plan):
        lines.append("")
        lines.append(title)
        width = max(len(label) for label, _ in rows)
        lines.extend(f"  {label.ljust(width)}  {value}" for label, value in rows)
    return "\n".join(lines)
