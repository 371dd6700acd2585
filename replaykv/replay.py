"""How missing SWA state is rebuilt: prefill plans as data.

`plan_prefill` turns what the cache offers for a request (a global-KV hit at `cut`, a window
snapshot there or not) and the replay switches into a `PrefillPlan`: an ordered list of
segments, each "run layers [a, b) over tokens [start, end) with window floor f, global KV
read-only or not". Every path is just a different segment list, so plans are easy to print,
test and account (layer×token work is a sum over segments). The semantics are those of
architecture reference §13:

    region map of a follow-up request [0, S) after an earlier request cached [0, cut):
      [0, s)          global KV only (s = max(0, cut - W))
      [s, cut)        replayed rows (bounded): window floor s, global KV read-only
      [cut, S)        new rows: computed normally, new complete groups written

Not for: running segments (see :mod:`replaykv.engine.runner`) or finding the hit (see
:mod:`replaykv.cache`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from replaykv.model.spec import ModelSpec

MISS_STRATEGIES = ("bounded", "exact", "truncate", "full")
FAULTS = ("window_untruncated", "drop_global_kv")
"""Deliberately wrong replays an engine can be started with (EngineConfig.fault), so that an
acceptance contract can be shown to catch them; never used in a real deployment."""


@dataclass(frozen=True)
class ReplayFlags:
    """The switches, named as in SGLang.

    encoder_bounded_replay: on a snapshot miss use `miss_strategy` (default "bounded"); off
    means the exact alternative ("exact"). decoder_bounded_replay: decoder layers run only the
    last min(W, prompt) rows of every prefill. replay_span: W (default: the model's window).
    """

    enable_encoder_swa_bounded_replay: bool = True
    enable_decoder_swa_bounded_replay: bool = True
    swa_miss_strategy: str = "bounded"
    replay_span: int | None = None

    def __post_init__(self) -> None:
        if self.swa_miss_strategy not in MISS_STRATEGIES:
            raise ValueError(
                f"swa_miss_strategy must be one of {MISS_STRATEGIES}, got {self.swa_miss_strategy!r}"
            )
        if self.replay_span is not None and self.replay_span < 1:
            raise ValueError("replay_span must be a positive number of tokens")

    @property
    def miss_strategy(self) -> str:
        if not self.enable_encoder_swa_bounded_replay and self.swa_miss_strategy == "bounded":
            return "exact"
        return self.swa_miss_strategy


@dataclass(frozen=True)
class CacheState:
    """What the cache offers a request of `tokens` tokens.

    global_hit: tokens [0, global_hit) have cached global KV (entries, index keys, carry).
    snapshot_at: positions where a full window snapshot exists (sorted, each <= global_hit).
    decoder_floor: the decoder window floor the earlier request used at global_hit (None: it
    was a prefill ending there, floor = max(0, global_hit - W)).
    """

    tokens: int
    global_hit: int = 0
    snapshot_at: tuple[int, ...] = ()
    decoder_floor: int | None = None


@dataclass(frozen=True)
class Segment:
    """Run layers [layers[0], layers[1]) over tokens [tokens[0], tokens[1]).

    window_floor: the first position any window read may touch. write_global: whether KV
    sources pool, store and carry global KV for these rows (False = cached, read-only).
    """

    layers: tuple[int, int]
    tokens: tuple[int, int]
    window_floor: int
    write_global: bool
    role: str

    @property
    def work(self) -> int:
        """Layer×token work of this segment."""
        return (self.layers[1] - self.layers[0]) * (self.tokens[1] - self.tokens[0])


@dataclass(frozen=True)
class Call:
    """One model call of a plan: layers over tokens with one window floor; tokens from
    `global_from` on write global KV (tokens[1]: none do), the ones before it read it cached."""

    layers: tuple[int, int]
    tokens: tuple[int, int]
    window_floor: int
    global_from: int


def plan_calls(segments: tuple[Segment, ...]) -> tuple[Call, ...]:
    """The calls that run `segments`: one per segment, except that a read-only segment followed
    by a writing one over the same layers, the same window floor and the tokens right after it
    (bounded replay's replayed rows and the new rows on top) is one call, so a layer runs the
    replayed rows in the same matrix products as the new ones. The rows compute what the two
    segments would: the new rows read the replayed rows' window entries either way."""
    calls: list[Call] = []
    for seg in segments:
        (t0, t1), last = seg.tokens, calls[-1] if calls else None
        if t1 <= t0:
            continue
        if (
            seg.write_global
            and last is not None
            and last.global_from == last.tokens[1]  # read-only
            and (last.layers, last.tokens[1], last.window_floor) == (seg.layers, t0, seg.window_floor)
        ):
            calls[-1] = Call(seg.layers, (last.tokens[0], t1), seg.window_floor, t0)
        else:
            calls.append(Call(seg.layers, seg.tokens, seg.window_floor, t0 if seg.write_global else t1))
    return tuple(calls)


@dataclass(frozen=True)
class PrefillPlan:
    """Segments in execution order plus what they mean.

    path: "cold", "hit", "bounded", "exact", "truncate" or "full". restore_snapshot_at: the
    position whose window snapshot must be loaded first (hit / truncate), or None.
    use_global: tokens of cached global KV the plan reads. logits_rows: the rows whose final
    hidden state the plan computes (the decoder's rows under decoder replay).
    """

    path: str
    segments: tuple[Segment, ...]
    tokens: int
    use_global: int
    restore_snapshot_at: int | None
    logits_rows: tuple[int, int]
    full_work: int
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def work(self) -> int:
        return sum(seg.work for seg in self.segments)

    @cached_property
    def calls(self) -> tuple[Call, ...]:
        """The model calls that run the plan (see `plan_calls`; worked out once per plan)."""
        return plan_calls(self.segments)

    @property
    def replayed_tokens(self) -> int:
        """Rows below the cached prefix that were recomputed (any layer)."""
        rows: set[int] = set()
        for seg in self.segments:
            if seg.role in ("replay", "rebuild"):
                rows.update(range(seg.tokens[0], min(seg.tokens[1], self.use_global)))
        return len(rows)

    @property
    def window_floors(self) -> tuple[int, ...]:
        return tuple(sorted({seg.window_floor for seg in self.segments}))

    def describe(self) -> str:
        lines = [
            f"path {self.path}: {len(self.segments)} segments, work {self.work} of {self.full_work} layer·tokens"
        ]
        for seg in self.segments:
            ro = "" if seg.write_global else ", global KV read-only"
            lines.append(
                f"  {seg.role:8s} layers [{seg.layers[0]}, {seg.layers[1]}) tokens [{seg.tokens[0]}, {seg.tokens[1]})"
                f" floor {seg.window_floor}{ro}"
            )
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _split(spec: ModelSpec) -> int:
    """First decoder layer (layers after the decoder cut); the layer count when there is none."""
    return len(spec.layers) if spec.decoder_cut is None else spec.decoder_cut + 1


def _forward(
    spec: ModelSpec,
    start: int,
    end: int,
    floor: int,
    dec_replay: bool,
    w: int,
    role: str,
    decoder_floor: int | None,
) -> list[Segment]:
    """Rows [start, end) through every layer, with decoder replay trimming the decoder."""
    n, split = len(spec.layers), _split(spec)
    if not dec_replay or split >= n:
        return [Segment((0, n), (start, end), floor, True, role)]
    tail = max(0, end - w)
    dec_start = max(start, tail)
    dec_floor = tail if decoder_floor is None else decoder_floor
    segs = [Segment((0, split), (start, end), floor, True, role)]
    if dec_start < end:
        segs.append(Segment((split, n), (dec_start, end), max(dec_floor, 0), True, "decoder"))
    return segs


def plan_prefill(state: CacheState, spec: ModelSpec, flags: ReplayFlags) -> PrefillPlan:
    """Choose the path for a request and describe it as segments (architecture §13)."""
    n_layers, s_len = len(spec.layers), state.tokens
    w = spec.sliding_window  # windows, decoder replay and exact rebuilds use the model's window
    span = flags.replay_span or w  # bounded replay's span (configurable for experiments)
    dec = flags.enable_decoder_swa_bounded_replay and spec.decoder_cut is not None
    split = _split(spec)
    cut = min(state.global_hit, s_len)
    if s_len <= 0:
        raise ValueError("a prefill needs at least one token")
    if cut >= s_len:
        cut = s_len - 1  # the last prompt token is always computed (its logits start decoding)
    full_work = n_layers * s_len

    def plan(path: str, segs: list[Segment], use: int, snap: int | None, *notes: str) -> PrefillPlan:
        # The final hidden states exist for the rows of the last segment (the decoder's rows).
        rows = (segs[-1].tokens[0], s_len)
        return PrefillPlan(path, tuple(segs), s_len, use, snap, rows, full_work, tuple(notes))

    if cut <= 0:
        return plan("cold", _forward(spec, 0, s_len, 0, dec, w, "new", None), 0, None)

    # Decoder floor of the continuation: the rows before `cut` hold the snapshot's entries.
    if cut in state.snapshot_at:
        segs = _forward(spec, cut, s_len, 0, dec, w, "new", None)
        return plan("hit", segs, cut, cut)

    strategy = flags.miss_strategy
    if strategy == "full":
        return plan(
            "full", _forward(spec, 0, s_len, 0, dec, w, "new", None), 0, None, "snapshot missing: recompute"
        )
    if strategy == "truncate":
        earlier = [p for p in state.snapshot_at if 0 < p < cut]
        if not earlier:
            segs = _forward(spec, 0, s_len, 0, dec, w, "new", None)
            return plan("truncate", segs, 0, None, "no snapshot below the hit: recompute everything")
        at = earlier[-1]
        return plan("truncate", _forward(spec, at, s_len, 0, dec, w, "new", None), at, at)
    if strategy == "bounded":
        s = max(0, cut - span)
        segs = []
        if dec and split < n_layers:
            segs.append(Segment((0, split), (s, cut), s, False, "replay"))
            segs.append(Segment((0, split), (cut, s_len), s, True, "new"))
            tail = max(0, s_len - w)
            segs.append(Segment((split, n_layers), (tail, s_len), tail, True, "decoder"))
        else:
            segs.append(Segment((0, n_layers), (s, cut), s, False, "replay"))
            segs.append(Segment((0, n_layers), (cut, s_len), s, True, "new"))
        return plan("bounded", segs, cut, None)
    # exact: rebuild the window state the earlier request left at `cut`, then continue as a hit.
    segs = _exact_rebuild(spec, cut, s_len, w, dec, state.decoder_floor)
    segs += _forward(spec, cut, s_len, 0, dec, w, "new", None)
    return plan("exact", segs, cut, None)


def _exact_rebuild(
    spec: ModelSpec, cut: int, s_len: int, w: int, dec: bool, decoder_floor: int | None
) -> list[Segment]:
    """What continuing at `cut` reads of the window state the earlier request left there, rebuilt.

    Each layer's rows at i read its keys at [i-W+1, i], so the layer below must produce inputs
    from W-1 rows earlier: k_l = k_{l+1} - (W-1), from the top layer that the continuation reads
    below `cut`. With decoder replay the decoder reads its own window below `cut` only when the
    follow-up has fewer than W new rows (its rows start at s_len - W); then the decoder layers
    are rebuilt as the earlier request ran them, rows [floor, cut) with that floor, and the
    encoder must feed them from `floor`. Otherwise the decoder reads nothing below `cut` and only
    the encoder's windows are rebuilt.
    """
    n, split = len(spec.layers), _split(spec)
    decoder_reads = dec and split < n and max(0, s_len - w) < cut
    top = split if dec and split < n else n
    floor = (max(0, cut - w) if decoder_floor is None else decoder_floor) if decoder_reads else cut
    # The top rebuilt layer's outputs are read from `floor` (the decoder's floor when the decoder
    # is rebuilt; else the continuation's own rows from `cut`, reading keys from cut - W + 1).
    segs = []
    for layer in range(top):
        k = max(0, floor - (w - 1) * (top - layer))
        segs.append(Segment((layer, layer + 1), (k, cut), k, False, "rebuild"))
    if decoder_reads:
        segs.append(Segment((split, n), (floor, cut), floor, False, "rebuild"))
    return segs


class ReplayOptionError(ValueError):
    """A request or engine option that replay cannot honour; the message names the flag."""


def check_engine_options(flags: ReplayFlags, speculative_decoding: bool = False) -> None:
    """Start-up guard: combinations the replay paths cannot serve correctly."""
    if speculative_decoding and flags.enable_encoder_swa_bounded_replay:
        raise ReplayOptionError(
            "speculative decoding cannot be combined with --enable-encoder-swa-bounded-replay: draft "
            "tokens would read window state that bounded replay only approximates; turn one of them off"
        )


def check_request_options(
    flags: ReplayFlags,
    prompt_logprobs: bool = False,
    prompt_hidden_states: bool = False,
    fallback: bool = False,
) -> ReplayFlags:
    """Per-request guard. Decoder replay computes the decoder only for the last W prompt rows,
    so prompt logprobs / prompt hidden states need the full path: refused with an error naming
    the flag, or, when the request asks for it (`fallback`), served with decoder replay off."""
    wanted = [
        name
        for name, on in (("prompt logprobs", prompt_logprobs), ("prompt hidden states", prompt_hidden_states))
        if on
    ]
    if not wanted or not flags.enable_decoder_swa_bounded_replay:
        return flags
    if fallback:
        return ReplayFlags(
            enable_encoder_swa_bounded_replay=flags.enable_encoder_swa_bounded_replay,
            enable_decoder_swa_bounded_replay=False,
            swa_miss_strategy=flags.swa_miss_strategy,
            replay_span=flags.replay_span,
        )
    raise ReplayOptionError(
        f"{' and '.join(wanted)} cannot be returned with --enable-decoder-swa-bounded-replay (the decoder "
        "runs only the last window of the prompt); disable it or ask for the full-path fallback"
    )
