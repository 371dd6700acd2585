"""Byte and work accounting derived from a model config, for DeepSeek-V4 and DeepSeek-V4.1.

Three ledgers (architecture §5, the second source document's "three books"):

* **global KV**: compressed entries + index keys of every KV source, one per complete group;
  persistent and prefix-shareable. Per token Σ_sources (entry + index key) / r (exact as a
  :class:`~fractions.Fraction`); for L tokens Σ_sources floor(L / r) · (entry + index key).
* **window state** (the SWA snapshot): layers × sliding_window × window entry bytes, plus the
  compressor tails (the fp32 rows of a pending group) — per request, short-lived.
* **persistent**: what a prefix cache keeps per token. The V4 policy persists the global KV and
  `snapshots_per_turn` window snapshots per turn; the V4.1 policy persists the global KV only.

Images (V4.1): an image is a span of ordinary prompt positions (:func:`replaykv.images.image_span_length`),
so it costs what that many tokens cost in each ledger; :func:`image_ledger` adds what only images
have: the feature cache's span vectors and the vision tower's patches.

Every byte size comes from the layouts in :mod:`replaykv.model.quant` at the config's dims, or
from :data:`V4_PACKED_ENTRY` (DeepSeek-V4's window and compressed entry, defined here by formula)
for V4 configs. Work is counted in layer × token rows: one layer processing one token.

Not for: allocating or storing anything (see :mod:`replaykv.cache`), or latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

from replaykv.images import image_span_length, plan_resize
from replaykv.model.config import CSA, HCA, DeepseekV4Config
from replaykv.model.config_v41 import DeepseekV41Config
from replaykv.model.quant import FP4_COMPRESSED_ENTRY, FP8_WINDOW_ENTRY, MXFP4_INDEX_KEY
from replaykv.model.spec import ModelSpec
from replaykv.model.vision import DeepseekV41VisionConfig

AnyConfig = DeepseekV4Config | DeepseekV41Config

V4_FAMILY = "deepseek_v4"
V41_FAMILY = "deepseek_v41"
FP32_BYTES = 4
BF16_BYTES = 2

# Where decoder replay starts counting a layer as "tail only" (architecture §4, §9.2):
# ENGINE: layers after the decoder cut (vLLM, SGLang and replaykv run layers 0..cut on every row);
# REPORT: the tech report's accounting, which counts the last KV source (layer 20) as a decoder
#         layer whose compressor projection on the other rows is free (calc-B: 20·N + 20·128).
ENGINE = "engine"
REPORT = "report"
CONVENTIONS = (ENGINE, REPORT)


@dataclass(frozen=True)
class V4PackedEntry:
    """DeepSeek-V4 KV entry (window and compressed): ``[..., head_dim]`` → one record of
    ``nope`` e4m3 bytes + ``rope`` BF16 dims (2 B each) + one ue8m0 scale per ``scale_block`` NoPE
    channels, padded to ``align`` bytes; Flash 448 NoPE + 64 RoPE → 448 + 128 + 7 + 1 pad = 584 B
    (architecture §5.3, §2.9 f). Not a :class:`~replaykv.model.quant.KVEntryLayout`: replaykv only
    accounts for it, never packs it.
    """

    scale_block: ClassVar[int] = 64
    align: ClassVar[int] = 8

    def bytes_per_entry(self, head_dim: int, rope_dim: int) -> int:
        nope = head_dim - rope_dim
        if nope <= 0 or rope_dim <= 0:
            raise ValueError(
                f"V4 entry needs 0 < rope_dim < head_dim, got head_dim {head_dim}, rope {rope_dim}"
            )
        raw = nope + 2 * rope_dim + math.ceil(nope / self.scale_block)
        return -(-raw // self.align) * self.align


V4_PACKED_ENTRY = V4PackedEntry()
"""DeepSeek-V4's packed KV entry (584 B at head_dim 512, rope 64)."""


@dataclass(frozen=True)
class SourceLedger:
    """One layer that publishes compressed entries (a KV source, or a V4 compressed layer)."""

    layer: int
    ratio: int
    entry_bytes: int  # one compressed main-KV entry
    index_key_bytes: int  # one index key; 0 without an indexer
    tail_bytes: int  # compressor state carried between calls, per request (fp32)

    @property
    def bytes_per_group(self) -> int:
        return self.entry_bytes + self.index_key_bytes


@dataclass(frozen=True)
class LayerLedger:
    """What one layer reads at decode: its window, and the entries of its source (if any)."""

    layer: int
    ratio: int  # 0 = window only
    source: int | None  # layer whose compressed entries it attends
    sparse: bool  # attends a top-k selection (True) or every entry (V4 HCA)
    scans_index: bool  # scores the source's index keys (Full / Reindex / V4 CSA)


@dataclass(frozen=True)
class KVLedger:
    """The cache bytes of a model, derived once from its config (V4 or V4.1)."""

    family: str
    num_layers: int
    window: int
    window_entry_bytes: int
    index_topk: int
    layers: tuple[LayerLedger, ...]
    sources: tuple[SourceLedger, ...]
    decoder_cut: int  # last layer that runs every prefill row; num_layers - 1 when there is no decoder
    candidate_source: int = -1  # V4.1 two-level top-k: later indexers score only the candidates
    candidate_positions: int = 0  # candidate_topk_blocks × candidate_block_size

    @classmethod
    def from_config(cls, config: AnyConfig) -> KVLedger:
        if isinstance(config, DeepseekV41Config):
            return cls._from_v41(config)
        if isinstance(config, DeepseekV4Config):
            return cls._from_v4(config)
        raise TypeError(f"no KV accounting for {type(config).__name__}")

    @classmethod
    def _from_v41(cls, c: DeepseekV41Config) -> KVLedger:
        entry = FP4_COMPRESSED_ENTRY.bytes_per_entry(c.head_dim)
        index_key = MXFP4_INDEX_KEY.bytes_per_entry(c.index_head_dim)
        sources = tuple(
            SourceLedger(
                layer=s,
                ratio=c.compress_ratio(s),
                entry_bytes=entry,
                index_key_bytes=index_key if c.has_indexer(s) else 0,
                # At most r-1 pending rows of fp32 (kv, gate), architecture §3.3.
                tail_bytes=(c.compress_ratio(s) - 1) * 2 * c.head_dim * FP32_BYTES,
            )
            for s in c.kv_sources
        )
        layers = tuple(
            LayerLedger(i, c.compress_ratio(i), c.kv_source_of(i), True, c.has_indexer(i))
            for i in range(c.num_hidden_layers)
        )
        return cls(
            family=V41_FAMILY,
            num_layers=c.num_hidden_layers,
            window=c.sliding_window,
            window_entry_bytes=FP8_WINDOW_ENTRY.bytes_per_entry(c.head_dim),
            index_topk=c.index_topk,
            layers=layers,
            sources=sources,
            decoder_cut=c.decoder_cut,
            candidate_source=c.candidate_source,
            candidate_positions=c.candidate_topk_blocks * c.candidate_block_size
            if c.candidate_enabled
            else 0,
        )

    @classmethod
    def _from_v4(cls, c: DeepseekV4Config) -> KVLedger:
        entry = V4_PACKED_ENTRY.bytes_per_entry(c.head_dim, c.qk_rope_head_dim)
        index_key = MXFP4_INDEX_KEY.bytes_per_entry(c.index_head_dim)
        spec = ModelSpec.from_config(c)
        sources, layers = [], []
        for i, ls in enumerate(spec.layers):
            r = c.compress_ratio(i)
            csa = c.layer_types[i] == CSA
            if r:
                # The carry rings replaykv's V4 compressor keeps: kv and gate rows, fp32.
                tail = (
                    2
                    * FP32_BYTES
                    * (ls.carry_ring * ls.carry_width + ls.index_carry_ring * ls.index_carry_width)
                )
                sources.append(SourceLedger(i, r, entry, index_key if csa else 0, tail))
            layers.append(LayerLedger(i, r, i if r else None, c.layer_types[i] != HCA, csa))
        return cls(
            family=V4_FAMILY,
            num_layers=c.num_hidden_layers,
            window=c.sliding_window,
            window_entry_bytes=entry,
            index_topk=c.index_topk,
            layers=tuple(layers),
            sources=tuple(sources),
            decoder_cut=c.num_hidden_layers - 1,
        )

    # ------------------------------------------------------------------ global KV
    def global_bytes_per_token(self) -> Fraction:
        """Σ over sources of (entry + index key) / r: the long-run growth per token."""
        return sum((Fraction(s.bytes_per_group, s.ratio) for s in self.sources), Fraction(0))

    def global_bytes(self, tokens: int) -> int:
        """Global KV bytes of a `tokens`-long context: floor(tokens / r) complete groups per source."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        return sum((tokens // s.ratio) * s.bytes_per_group for s in self.sources)

    # ------------------------------------------------------------------ window state
    def window_state_bytes(self, *, through_layer: int | None = None) -> int:
        """layers × sliding_window × window entry bytes, for layers 0..through_layer (default all)."""
        n = self.num_layers if through_layer is None else through_layer + 1
        if not 0 <= n <= self.num_layers:
            raise ValueError(f"through_layer {through_layer} is out of range [0, {self.num_layers})")
        return n * self.window * self.window_entry_bytes

    def window_state_bytes_through_cut(self) -> int:
        """Window state of the layers up to and including the decoder cut (the encoder side)."""
        return self.window_state_bytes(through_layer=self.decoder_cut)

    def compressor_tail_bytes(self) -> int:
        """Per-request compressor state between calls, summed over sources."""
        return sum(s.tail_bytes for s in self.sources)

    def snapshot_bytes(self) -> int:
        """One SWA-pool entry: the window state of every layer plus the compressor tails."""
        return self.window_state_bytes() + self.compressor_tail_bytes()

    # ------------------------------------------------------------------ persistent (prefix cache)
    def persistent_bytes_per_token(
        self, policy: str, turn_tokens: int, snapshots_per_turn: int = 2
    ) -> Fraction:
        """Persistent bytes per token of a turn that adds `turn_tokens` tokens.

        ``policy="v4"``: global KV + `snapshots_per_turn` window snapshots (window state only) per
        turn. ``policy="v41"``: global KV only.
        """
        if turn_tokens <= 0:
            raise ValueError(f"turn_tokens must be positive, got {turn_tokens}")
        g = self.global_bytes_per_token()
        if policy == "v41":
            return g
        if policy == "v4":
            return g + Fraction(snapshots_per_turn * self.window_state_bytes(), turn_tokens)
        raise ValueError(f"policy must be 'v4' or 'v41', got {policy!r}")

    def break_even_turn_tokens(self, snapshots_per_turn: int = 2) -> Fraction:
        """Turn length at which a turn's window snapshots weigh as much as its global KV.

        snapshots_per_turn × window_state_bytes / global_bytes_per_token. Shorter turns spend more
        persistent bytes on snapshots than on global KV under the V4 policy.
        """
        g = self.global_bytes_per_token()
        if g == 0:
            raise ValueError("the model has no global KV, so there is no break-even turn length")
        return Fraction(snapshots_per_turn * self.window_state_bytes()) / g

    # ------------------------------------------------------------------ decode reads (§5.5)
    def decode_read_bytes(self, context: int) -> int:
        """Main-attention operand bytes one decode token reads at `context` tokens.

        Per layer: min(window, context) window entries, plus the compressed entries it attends:
        min(index_topk, floor(context / r)) selected (sparse layers) or all of them (V4 HCA).
        Index-key scans are separate (:meth:`decode_index_scan_bytes`).
        """
        total = 0
        by_layer = {s.layer: s for s in self.sources}
        for lay in self.layers:
            total += min(self.window, context) * self.window_entry_bytes
            if lay.source is not None:
                src = by_layer[lay.source]
                entries = context // src.ratio
                total += (min(self.index_topk, entries) if lay.sparse else entries) * src.entry_bytes
        return total

    def decode_index_scan_bytes(self, context: int) -> int:
        """Index-key bytes the indexers of one decode token score.

        Each indexer scores every reachable key of its source, except the V4.1 index sources after
        the candidate source, which score only the candidate positions (at most
        candidate_topk_blocks × candidate_block_size; the point of the two-level top-k, §1.4 —
        transformers' reference scores every key and masks, an engine need not).
        """
        by_layer = {s.layer: s for s in self.sources}
        total = 0
        for lay in self.layers:
            if lay.scans_index and lay.source is not None:
                src = by_layer[lay.source]
                keys = context // src.ratio
                if 0 <= self.candidate_source < lay.layer:
                    keys = min(keys, self.candidate_positions)
                total += keys * src.index_key_bytes
        return total

    # ------------------------------------------------------------------ layer × token work
    def full_layers(self, *, decoder_replay: bool = True, convention: str = ENGINE) -> int:
        """Layers that run every prefill row (0 .. full_layers-1); the rest run only the tail.

        Without decoder replay, or for a model without a decoder (V4), that is every layer.
        """
        if convention not in CONVENTIONS:
            raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
        if not decoder_replay or self.family == V4_FAMILY or self.decoder_cut >= self.num_layers - 1:
            return self.num_layers
        return self.decoder_cut + 1 if convention == ENGINE else self.decoder_cut

    def prefill_work(
        self,
        new_tokens: int,
        *,
        window: int | None = None,
        decoder_replay: bool = True,
        convention: str = ENGINE,
    ) -> int:
        """Layer × token rows of a prefill of `new_tokens` rows (cold, or after a full hit).

        full_layers × new + tail_layers × min(W, new) with decoder replay; layers × new without.
        """
        w = self.window if window is None else window
        full = self.full_layers(decoder_replay=decoder_replay, convention=convention)
        return full * new_tokens + (self.num_layers - full) * min(w, new_tokens)

    def bounded_replay_work(
        self,
        *,
        cached_tokens: int | None = None,
        window: int | None = None,
        decoder_replay: bool = True,
        convention: str = ENGINE,
    ) -> int:
        """Extra rows of one SWA-pool miss under bounded replay: full_layers × min(W, cached).

        The replayed rows [cut − W, cut) run through every layer that keeps its window across
        requests; decoder layers (with decoder replay) rebuild theirs from the new request's tail
        anyway. (If the new rows are fewer than W, decoder layers also re-run up to W − new old rows;
        that correction is the same for every miss path and is not counted here.)
        """
        w = self.window if window is None else window
        rows = w if cached_tokens is None else min(w, cached_tokens)
        return self.full_layers(decoder_replay=decoder_replay, convention=convention) * rows

    def exact_replay_work(
        self,
        *,
        cached_tokens: int | None = None,
        window: int | None = None,
        decoder_replay: bool = True,
        convention: str = ENGINE,
    ) -> int:
        """Rows needed to rebuild the window state of the full layers exactly.

        Layer ℓ's window entries at [cut − W, cut) are projections of layer ℓ−1's outputs there,
        and each of those outputs attends W − 1 earlier window keys of layer ℓ−1; so with m full
        layers the top one processes W rows and each layer below processes W − 1 more:
        Σ_{k=0}^{m−1} min(cached, W + k·(W − 1)) = m·W + (W − 1)·m(m − 1)/2 when the history is long.
        """
        w = self.window if window is None else window
        m = self.full_layers(decoder_replay=decoder_replay, convention=convention)
        rows = [w + k * (w - 1) for k in range(m)]
        if cached_tokens is not None:
            rows = [min(cached_tokens, r) for r in rows]
        return sum(rows)


def kv_ledger(config: AnyConfig) -> KVLedger:
    """:meth:`KVLedger.from_config`."""
    return KVLedger.from_config(config)


# ---------------------------------------------------------------------------------------------
# Images (V4.1)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageLedger:
    """What one image costs under a config, ledger by ledger.

    An image's span is `positions` ordinary prompt positions, so:

    * **global KV** (ledger 1, device): positions × :meth:`KVLedger.global_bytes_per_token`, the
      long-run figure; where the span starts moves the exact count of complete groups by less
      than one group per source (:meth:`KVLedger.global_bytes` of the prefixes gives it exactly);
    * **window state** (ledger 2, the SWA KV): a request's window state has a fixed size (layers ×
      W entries), so an image does not grow it; the image's positions *occupy* it only where they
      fall in the last W positions of a prefix: at most min(positions, W) entries per layer, i.e.
      `window_bytes` = min(positions, W) × window entry × layers (the part of a snapshot taken
      right after the image that holds image positions);
    * **persistent** (ledger 3): the V4.1 policy persists global KV only, so the same bytes as
      ledger 1 (a V4-policy snapshot per turn does not grow with the image either);
    * **feature cache** (in memory, short-lived): the span vectors the tower produced,
      positions × text hidden × `feature_dtype_bytes` (2 for bf16);
    * **tower work**: the tower runs its layers on every patch of the canvas,
      patches = (canvas_h / patch) · (canvas_w / patch); `patch_rows` = patches × tower layers
      (layer × patch rows, like the text model's layer × token rows). The prompt rows the span
      adds to the text model are counted by :meth:`KVLedger.prefill_work` as for any tokens.

    From a grid alone the canvas is the largest one of that grid (whole patch × downsample
    cells); from a position count alone (`grid` None) the tower's figures are unknown (None).
    """

    positions: int
    grid: tuple[int, int] | None  # (rows, columns) of LLM tokens
    canvas: tuple[int, int] | None  # (height, width) in pixels, whole patches
    patches: int | None
    tower_layers: int
    global_kv_bytes: Fraction
    window_bytes: int
    persistent_bytes: Fraction
    feature_bytes: int
    window: int

    @property
    def patch_rows(self) -> int | None:
        """Layer × patch rows of one tower pass (None without a grid)."""
        return None if self.patches is None else self.patches * self.tower_layers

    def as_dict(self) -> dict[str, object]:
        """JSON-friendly figures (byte counts as floats where they are fractions)."""
        return {
            "positions": self.positions,
            "grid": list(self.grid) if self.grid else None,
            "canvas": list(self.canvas) if self.canvas else None,
            "patches": self.patches,
            "patch_rows": self.patch_rows,
            "global_kv_bytes": float(self.global_kv_bytes),
            "window_bytes": self.window_bytes,
            "persistent_bytes": float(self.persistent_bytes),
            "feature_bytes": self.feature_bytes,
            "window": self.window,
        }


def released_vision() -> DeepseekV41VisionConfig:
    """The released DeepSeek-V4.1 image path's settings (:class:`DeepseekV41VisionConfig`'s
    defaults), for accounting a config that has no ``vision_config`` (the text backbone)."""
    return DeepseekV41VisionConfig()


def image_ledger(
    config: AnyConfig,
    *,
    size: tuple[int, int] | None = None,
    grid: tuple[int, int] | None = None,
    positions: int | None = None,
    vision: DeepseekV41VisionConfig | None = None,
    feature_dtype_bytes: int = BF16_BYTES,
) -> ImageLedger:
    """:class:`ImageLedger` of one image given by exactly one of: `size` (width, height) in
    pixels (the resize plan of :func:`replaykv.images.plan_resize` picks the canvas and grid),
    `grid` (LLM-token rows, columns) or `positions` (the span length).

    `vision`: the image path's settings; None takes the config's ``vision_config``. A V4.1
    config without one (a text backbone such as the ``v41-flash`` preset) needs it passed,
    e.g. :func:`released_vision`. DeepSeek-V4 has no image path.
    """
    if not isinstance(config, DeepseekV41Config):
        raise ValueError(f"images need a DeepSeek-V4.1 config; {type(config).__name__} reads text only")
    given = [name for name, v in (("size", size), ("grid", grid), ("positions", positions)) if v is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of size, grid or positions for an image; got {given or 'none'}")
    vision = vision or config.vision_config
    if vision is None:
        raise ValueError(
            "the config has no vision_config; pass vision=released_vision() to account with the "
            "released image path's settings"
        )
    if feature_dtype_bytes <= 0:
        raise ValueError(f"feature_dtype_bytes must be positive, got {feature_dtype_bytes}")
    canvas: tuple[int, int] | None = None
    if size is not None:
        gh, gw, ch, cw = plan_resize(size[0], size[1], vision)
        grid, canvas = (gh, gw), (ch, cw)
    elif grid is not None:
        if min(grid) < 1:
            raise ValueError(f"an image grid needs at least one row and one column, got {grid}")
        cell = vision.patch_size * vision.downsample_ratio
        canvas = (grid[0] * cell, grid[1] * cell)
    if grid is not None:
        positions = image_span_length(*grid)
    assert positions is not None
    if positions < 3:
        raise ValueError(f"an image span has at least 3 positions (start, one row, end); got {positions}")
    ledger = KVLedger.from_config(config)
    patches = None if canvas is None else (canvas[0] // vision.patch_size) * (canvas[1] // vision.patch_size)
    global_kv = positions * ledger.global_bytes_per_token()
    return ImageLedger(
        positions=positions,
        grid=grid,
        canvas=canvas,
        patches=patches,
        tower_layers=vision.num_hidden_layers,
        global_kv_bytes=global_kv,
        window_bytes=min(positions, ledger.window) * ledger.window_entry_bytes * ledger.num_layers,
        persistent_bytes=global_kv,
        feature_bytes=positions * config.hidden_size * feature_dtype_bytes,
        window=ledger.window,
    )


# ---------------------------------------------------------------------------------------------
# Parameters (weights), for per-token compute estimates
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParameterCount:
    """Parameter counts of a model: all of them, those a token uses, and the embedding table."""

    total: int
    active: int  # per token: all but the routed experts it is not sent to
    embedding: int  # input embedding table (a lookup, no matmul)

    @property
    def active_matmul(self) -> int:
        """Active parameters that take part in a matmul (active minus the embedding lookup)."""
        return self.active - self.embedding


def parameter_count(config: AnyConfig) -> ParameterCount:
    """Weights of the text model. V4.1 by formula (architecture §2.1, §12 transformers names);
    V4 by building the model on the meta device."""
    if isinstance(config, DeepseekV41Config):
        return _v41_parameters(config)
    return _v4_parameters(config)


def _v41_parameters(c: DeepseekV41Config) -> ParameterCount:
    h, d, heads = c.hidden_size, c.head_dim, c.num_attention_heads
    attention = (
        c.q_lora_rank * h + c.q_lora_rank  # q_a_proj, q_a_norm
        + heads * d * c.q_lora_rank  # q_b_proj
        + d * h + d  # kv_proj, kv_norm
        + c.o_groups * c.o_lora_rank * (heads * d // c.o_groups)  # o_a_proj
        + h * c.o_groups * c.o_lora_rank  # o_b_proj
        + heads  # sinks
    )  # fmt: skip
    mix = 2 * c.hc_mult + c.hc_mult**2
    per_layer = attention + 2 * h + 2 * (mix * c.hc_mult * h + mix + 3)  # norms, attn_hc, ffn_hc
    per_layer += c.n_routed_experts * h  # router
    expert = 3 * c.moe_intermediate_size * h
    per_layer += c.n_shared_experts * expert
    total = c.num_hidden_layers * per_layer
    for i in range(c.num_hidden_layers):
        if c.is_kv_source(i):
            total += d * h + d + (d * h if c.compress_ratio(i) > 1 else 0)  # compressor kv, norm, gate
        if c.has_indexer(i):
            total += c.index_n_heads * c.index_head_dim * c.q_lora_rank + c.index_n_heads * h
            if c.is_kv_source(i):
                total += c.index_head_dim * d + c.index_head_dim  # k_proj, k_norm
    embed = c.vocab_size * h
    total += embed + h + (0 if c.tie_word_embeddings else c.vocab_size * h)
    routed = c.num_hidden_layers * c.n_routed_experts * expert
    active = total + c.num_hidden_layers * c.num_experts_per_tok * expert
    return ParameterCount(total=total + routed, active=active, embedding=embed)


def _v4_parameters(c: DeepseekV4Config) -> ParameterCount:
    import torch

    from replaykv.model.v4 import DeepseekV4ForCausalLM

    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(c)
    total = sum(p.numel() for p in model.parameters())
    expert = 3 * c.moe_intermediate_size * c.hidden_size
    unused = c.num_hidden_layers * (c.n_routed_experts - c.num_experts_per_tok) * expert
    return ParameterCount(total=total, active=total - unused, embedding=c.vocab_size * c.hidden_size)
