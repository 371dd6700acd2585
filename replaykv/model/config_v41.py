"""Model configuration for the DeepSeek-V4.1 text backbone, with Hugging Face field names.

`DeepseekV41Config` is a frozen dataclass whose fields are those of transformers'
`DeepseekV41TextConfig` (`deepseek_v41`, main branch), so a `config.json` loads unchanged, in
either form (architecture notes §12):

* flat: ``model_type: deepseek_v41_text`` with the text fields at the top level;
* composite: ``model_type: deepseek_v41`` with the text fields under ``text_config`` plus
  ``image_token_id``, ``tie_word_embeddings`` and an optional ``vision_config`` (the image
  path, :mod:`replaykv.model.vision`; a config with one saves as the composite form).

Derived values are properties: the per-layer role (window-only / Full / Reindex / Reuse), the
KV source and selection owner of each compressed layer, the decoder cut. `__post_init__` applies
transformers' defaults (§1.1 scaling rule for `compress_ratios`) and then the stricter NeMo
schedule rules (§9.1); every message names the rule and the offending layer ids.

Engram and DSpark fields are accepted with their transformers names (and NeMo's
``engram_pad_token_id``) so real configs parse, but enabling either raises
:class:`NotImplementedError`. ``from_dict(..., backbone_only=True)`` switches both off, which is
enough for byte accounting of the released checkpoint's backbone (Engram adds no KV entries).

The KV fake-quantisers (``kv_quant``) need ``head_dim`` and ``index_head_dim`` in whole
quantiser blocks. Loading a config.json (`from_dict`) applies the caller's overrides (a
``--kv-quant`` flag) before any validation; a config that asks for no quantisation
(``"kv_quant": false``), or whose shape cannot be quantised while nothing asked for the
quantisers, loads unquantised with a warning naming the reason, as transformers runs it.
Asking for them explicitly on such a shape is an error.

Not for: cache sizing (see :mod:`replaykv.model.accounting`) or the V4 model
(:mod:`replaykv.model.config`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replaykv.model.config import _GENERIC_HF_KEYS, RopeConfig
from replaykv.model.quant import FP4_COMPRESSED_ENTRY, FP8_WINDOW_ENTRY, MXFP4_INDEX_KEY
from replaykv.model.vision import DeepseekV41VisionConfig

FLAT_MODEL_TYPE = "deepseek_v41_text"
COMPOSITE_MODEL_TYPE = "deepseek_v41"

# transformers' `layer_types`: only KV sources get a compressor cache layer.
SLIDING = "sliding_attention"
SHARED_COMPRESSED = "shared_compressed_attention"

# Layer roles (architecture §1.3). Under the NeMo rules enforced here every KV source is also an
# index source, so "KV source" and "Full" name the same layers.
WINDOW_ONLY = "window_only"
FULL = "full"
REINDEX = "reindex"
REUSE = "reuse"
LAYER_ROLES = (WINDOW_ONLY, FULL, REINDEX, REUSE)

# The released 40-layer schedule [HF-cfg]; transformers uses it verbatim at 40 layers.
RELEASED_COMPRESS_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20
RELEASED_KV_SOURCES = (2, 8, 14, 20)
RELEASED_INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)

# Keys of a composite config.json besides `text_config`.
_COMPOSITE_KEYS = frozenset(
    {"text_config", "vision_config", "image_token_id", "tie_word_embeddings", "bos_token_id",
     "eos_token_id", "pad_token_id"}
)  # fmt: skip
# transformers' V4 folds `num_nextn_predict_layers` away; V4.1 uses it (DSpark draft layers).
_GENERIC_KEYS = _GENERIC_HF_KEYS - {"num_nextn_predict_layers"}
# Not transformers fields: stored here, written by to_dict only where transformers has them.
_NOT_HF_FIELDS = frozenset({"rope_main", "rope_compress", "kv_quant", "image_token_id", "vision_config"})
_FLOAT_FIELDS = (
    "rope_theta", "compress_rope_theta", "gate_temp", "routed_scaling_factor", "swiglu_limit",
    "hc_eps", "rms_norm_eps",
)  # fmt: skip
_TUPLE_FIELDS = (
    "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
    "engram_num_embeddings", "dspark_target_layer_ids",
)  # fmt: skip
_POSITIVE_INT_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim",
    "index_topk", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "hc_mult",
    "hc_sinkhorn_iters", "max_position_embeddings",
)  # fmt: skip


log = logging.getLogger(__name__)


def unquantisable(head_dim: int, index_head_dim: int) -> str | None:
    """Why the KV quantisers cannot run on these widths, or None when they can."""
    head_block = math.lcm(FP8_WINDOW_ENTRY.block, FP4_COMPRESSED_ENTRY.block)
    if head_dim % head_block:
        return (
            f"head_dim ({head_dim}) is not a multiple of {head_block} (FP8 window blocks of "
            f"{FP8_WINDOW_ENTRY.block}, FP4 entry blocks of {FP4_COMPRESSED_ENTRY.block} channels)"
        )
    if index_head_dim % MXFP4_INDEX_KEY.block:
        return (
            f"index_head_dim ({index_head_dim}) is not a multiple of {MXFP4_INDEX_KEY.block} "
            "(MXFP4 index-key blocks)"
        )
    return None


def hf_default_compress_ratios(num_hidden_layers: int) -> tuple[int, ...]:
    """transformers' schedule when `compress_ratios` is not given (architecture §1.1).

    40 layers: the released schedule. Otherwise 2 sliding-only layers, then ceil((n-2)/2) ratio-2
    layers, then ratio 1 for the rest (so 40 layers by the rule would differ from the release).
    """
    n = num_hidden_layers
    if n == len(RELEASED_COMPRESS_RATIOS):
        return RELEASED_COMPRESS_RATIOS
    n_slide = min(2, n)
    n_enc = max(0, (n - n_slide + 1) // 2)
    return (0,) * n_slide + (2,) * n_enc + (1,) * max(0, n - n_slide - n_enc)


def _default_sources(ratios: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Default (kv_source_layer_ids, index_source_layer_ids) for a ratio schedule.

    The released ids when the schedule is (a prefix of) the released one, keeping only ids below
    the layer count as NeMo does for truncated models (transformers would reject a truncated
    released prefix as out of range); otherwise the first layer of every run of equal non-zero
    ratios, and the KV sources double as the index sources [HF-cfg].
    """
    n = len(ratios)
    if n and ratios == RELEASED_COMPRESS_RATIOS[:n]:
        return (
            tuple(i for i in RELEASED_KV_SOURCES if i < n),
            tuple(i for i in RELEASED_INDEX_SOURCES if i < n),
        )
    kv = tuple(i for i in range(n) if ratios[i] > 0 and (i == 0 or ratios[i - 1] != ratios[i]))
    return kv, kv


def _fmt_ids(ids: list[int] | tuple[int, ...]) -> str:
    return "[" + ", ".join(str(i) for i in ids) + "]"


@dataclass(frozen=True)
class DeepseekV41Config:
    """The DeepSeek-V4.1 text model. Field names and defaults follow transformers'
    `DeepseekV41TextConfig` (the released Flash shape) except where noted in a comment."""

    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1280
    qk_rope_head_dim: int = 64
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    max_position_embeddings: int = 1048576
    attention_bias: bool = False
    # --- sliding window + CSA2 schedule (None = transformers' default rule) -----------------
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] | None = None
    kv_source_layer_ids: tuple[int, ...] | None = None
    index_source_layer_ids: tuple[int, ...] | None = None
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    # --- grouped low-rank output projection ----------------------------------------------------
    o_groups: int = 8
    o_lora_rank: int = 1024
    # --- MoE -----------------------------------------------------------------------------------
    moe_intermediate_size: int = 2304
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    topk_method: str = "noaux_tc"
    swiglu_limit: float = 10.0
    # --- hyper-connections (mHC) -----------------------------------------------------------------
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1.0e-6
    # --- Engram (accepted, not supported: a non-empty engram_layer_ids is refused) -----------
    engram_layer_ids: tuple[int, ...] = ()
    engram_vocab_size: int = 16000000
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # --- DSpark (accepted, not supported). transformers defaults to 3 draft layers; the dataclass
    # defaults to 0 so a config built in code is valid; from_dict keeps transformers' default. --
    num_nextn_predict_layers: int = 0
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # --- misc ------------------------------------------------------------------------------------
    hidden_act: str = "silu"
    rms_norm_eps: float = 1.0e-20
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = 1
    # Not transformers fields. RoPE flavours (None = derived from rope_theta / compress_rope_theta,
    # no YaRN); the composite config's image token id; the FP8/FP4/MXFP4 KV fake-quantisers.
    rope_main: RopeConfig | None = None
    rope_compress: RopeConfig | None = None
    image_token_id: int = 129264
    kv_quant: bool = True
    # The composite config's vision tower (None: a text-only model).
    vision_config: DeepseekV41VisionConfig | None = None

    model_type = FLAT_MODEL_TYPE

    # ------------------------------------------------------------------ defaults and validation
    def __post_init__(self) -> None:
        self._normalise()
        self._refuse_unsupported()
        self._check_dimensions()
        self._apply_schedule_defaults()
        self._check_schedule()
        self._check_rope()

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _normalise(self) -> None:
        """Canonical types, so equal configs compare and digest equal whatever the input form."""
        for name in _TUPLE_FIELDS:
            v = getattr(self, name)
            if v is not None:
                if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
                    raise ValueError(f"{name} must be a list of integers, got {v!r}")
                if any(isinstance(x, bool) or not isinstance(x, int) for x in v):
                    raise ValueError(f"{name} must hold integers only, got {list(v)}")
                self._set(name, tuple(int(x) for x in v))
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{name} must be a number, got {v!r}")
            self._set(name, float(v))
        if isinstance(self.eos_token_id, list):
            self._set("eos_token_id", tuple(self.eos_token_id))
        if isinstance(self.vision_config, Mapping):
            self._set("vision_config", DeepseekV41VisionConfig.from_dict(self.vision_config))
        if self.vision_config is not None and not 0 <= self.image_token_id < self.vocab_size:
            raise ValueError(
                f"image_token_id {self.image_token_id} is outside the vocabulary [0, {self.vocab_size}); "
                "a model with a vision_config needs it inside"
            )

    def _refuse_unsupported(self) -> None:
        if self.engram_layer_ids:
            raise NotImplementedError(
                f"Engram is not supported yet: engram_layer_ids is {_fmt_ids(self.engram_layer_ids)}; set it "
                "to [] (or load with backbone_only=True to account for the backbone without it)"
            )
        if self.num_nextn_predict_layers:
            raise NotImplementedError(
                f"DSpark is not supported yet: num_nextn_predict_layers is {self.num_nextn_predict_layers} "
                "(transformers' default is 3 when the key is absent); set it to 0 (or load with "
                "backbone_only=True)"
            )

    def _check_dimensions(self) -> None:
        for name in _POSITIVE_INT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.num_key_value_heads != 1:
            raise ValueError("DeepSeek-V4.1 uses one shared KV latent: set num_key_value_heads to 1")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of o_groups "
                f"({self.o_groups}): the grouped output projection splits the heads evenly"
            )
        rope = self.qk_rope_head_dim
        if isinstance(rope, bool) or not isinstance(rope, int) or rope <= 0 or rope % 2:
            raise ValueError(f"qk_rope_head_dim must be a positive even integer, got {rope!r}")
        if rope > self.head_dim or rope > self.index_head_dim:
            raise ValueError(
                f"qk_rope_head_dim ({rope}) must not exceed head_dim ({self.head_dim}) or index_head_dim "
                f"({self.index_head_dim}): RoPE rotates the trailing channels of both"
            )
        if self.kv_quant:
            reason = unquantisable(self.head_dim, self.index_head_dim)
            if reason is not None:
                raise ValueError(f"kv_quant is on but {reason}; change the width or set kv_quant=False")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must not exceed n_routed_experts "
                f"({self.n_routed_experts})"
            )
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        for name in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "gate_temp",
                     "routed_scaling_factor", "swiglu_limit"):  # fmt: skip
            v = getattr(self, name)
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be finite and positive, got {v!r}")
        if self.attention_bias:
            raise NotImplementedError(
                "attention_bias is not implemented: DeepSeek-V4.1 attention has no biases"
            )
        if self.scoring_func != "sqrtsoftplus":
            raise NotImplementedError(
                f"scoring_func {self.scoring_func!r} is not implemented; only 'sqrtsoftplus'"
            )
        if self.topk_method != "noaux_tc":
            raise NotImplementedError(f"topk_method {self.topk_method!r} is not implemented; only 'noaux_tc'")
        if self.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {self.hidden_act!r} is not implemented; only 'silu'")
        eos = self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)
        for name, ids in (("bos_token_id", (self.bos_token_id,)), ("eos_token_id", eos),
                          ("pad_token_id", (self.pad_token_id,))):  # fmt: skip
            bad = [i for i in ids if i is not None and not 0 <= i < self.vocab_size]
            if bad:
                raise ValueError(f"{name} {bad} is outside the vocabulary [0, {self.vocab_size})")

    def _apply_schedule_defaults(self) -> None:
        n = self.num_hidden_layers
        if self.compress_ratios is None:
            self._set("compress_ratios", hf_default_compress_ratios(n))
        default_kv, default_index = _default_sources(self.ratios)
        if self.kv_source_layer_ids is None:
            self._set("kv_source_layer_ids", default_kv)
        if self.index_source_layer_ids is None:
            self._set(
                "index_source_layer_ids",
                default_index if self.kv_source_layer_ids == default_kv else self.kv_source_layer_ids,
            )
        if self.candidate_source_layer_id is None:
            self._set("candidate_source_layer_id", self.kv_sources[-1] if self.kv_sources else -1)

    def _check_schedule(self) -> None:
        """Shape rules, then the NeMo schedule rules of architecture §1.2-§1.4 and §9.1."""
        n, ratios = self.num_hidden_layers, self.ratios
        if len(ratios) != n:
            raise ValueError(
                f"compress_ratios has {len(ratios)} entries but num_hidden_layers is {n}; give one ratio per "
                "backbone layer (the released config appends one 0 per DSpark layer: load it with "
                "backbone_only=True)"
            )
        negative = [i for i, r in enumerate(ratios) if r < 0]
        if negative:
            raise ValueError(
                f"compress_ratios must be >= 0 (0 window-only, 1 full, r>1 pooled); layers {negative}"
            )
        for name, ids in (
            ("kv_source_layer_ids", self.kv_sources),
            ("index_source_layer_ids", self.index_sources),
        ):
            out = [i for i in ids if not 0 <= i < n]
            if out:
                raise ValueError(f"{name}: layer ids {out} are out of range [0, {n})")
            if list(ids) != sorted(set(ids)):
                raise ValueError(
                    f"{name} must be sorted and unique (strictly increasing), got {_fmt_ids(ids)}"
                )
        kv, index = self.kv_sources, self.index_sources
        bad = [i for i in kv if ratios[i] == 0]
        if bad:
            raise ValueError(
                f"rule 'a KV source must have compress ratio > 0': layers {bad} have ratio 0 (window-only "
                "layers have no compressor); drop them from kv_source_layer_ids or give them a ratio"
            )
        bad = [i for i in index if ratios[i] == 0]
        if bad:
            raise ValueError(
                f"rule 'an index source must have compress ratio > 0': layers {bad} have ratio 0 (no "
                "compressed branch to select from); drop them from index_source_layer_ids"
            )
        bad = [i for i in index if not any(s <= i for s in kv)]
        if bad:
            raise ValueError(
                f"rule 'an index source needs a KV source at or before it': layers {bad} come before the "
                f"first KV source ({kv[0] if kv else 'none'}), so no index keys exist for them to score"
            )
        bad = [i for i in range(n) if ratios[i] > 0 and not any(s <= i for s in kv)]
        if bad:
            raise ValueError(
                f"rule 'every compressed layer reads a KV source at or before it': layers {bad} have ratio "
                f"> 0 before the first KV source ({kv[0] if kv else 'none'}); make them window-only (ratio "
                "0) or add a KV source at or before them"
            )
        bad_pairs = [(i, self.kv_source_of(i)) for i in range(n) if ratios[i] > 0]
        mismatched = [(i, s) for i, s in bad_pairs if s is not None and ratios[i] != ratios[s]]
        if mismatched:
            desc = ", ".join(f"{i} (ratio {ratios[i]}, source {s} has {ratios[s]})" for i, s in mismatched)
            raise ValueError(
                f"rule 'every compressed layer shares its KV source's ratio': layers {desc}; start a new "
                "KV source where the ratio changes"
            )
        bad = [i for i in kv if i not in index]
        if bad:
            raise ValueError(
                f"rule 'every KV source is an index source': layers {bad} are in kv_source_layer_ids but not "
                "in index_source_layer_ids (a source publishes the index keys and the first selection)"
            )
        cand = self.candidate_source
        if cand >= 0:
            if cand not in kv:
                raise ValueError(
                    f"rule 'the candidate source must be a KV source (negative disables it)': "
                    f"candidate_source_layer_id {cand} is not in kv_source_layer_ids {_fmt_ids(kv)}"
                )
            if self.candidate_topk_blocks <= 0 or self.candidate_block_size <= 0:
                raise ValueError(
                    "candidate_topk_blocks and candidate_block_size must be positive while the candidate "
                    f"source is enabled (layer {cand}); got {self.candidate_topk_blocks} and "
                    f"{self.candidate_block_size}"
                )

    def _check_rope(self) -> None:
        main = self.rope_main or RopeConfig(rope_theta=self.rope_theta)
        compress = self.rope_compress or RopeConfig(rope_theta=self.compress_rope_theta)
        for name, rope, theta, theta_name in (
            ("rope_main", main, self.rope_theta, "rope_theta"),
            ("rope_compress", compress, self.compress_rope_theta, "compress_rope_theta"),
        ):
            if not math.isclose(rope.rope_theta, theta):
                raise ValueError(
                    f"{name}.rope_theta ({rope.rope_theta}) differs from {theta_name} ({theta}); set them equal"
                )
        self._set("rope_main", main)
        self._set("rope_compress", compress)

    # ------------------------------------------------------------------ typed views of the schedule
    @property
    def ratios(self) -> tuple[int, ...]:
        """`compress_ratios` after defaults (one per backbone layer)."""
        assert self.compress_ratios is not None
        return self.compress_ratios

    @property
    def kv_sources(self) -> tuple[int, ...]:
        """`kv_source_layer_ids` after defaults."""
        assert self.kv_source_layer_ids is not None
        return self.kv_source_layer_ids

    @property
    def index_sources(self) -> tuple[int, ...]:
        """`index_source_layer_ids` after defaults."""
        assert self.index_source_layer_ids is not None
        return self.index_source_layer_ids

    @property
    def candidate_source(self) -> int:
        """`candidate_source_layer_id` after defaults; negative = two-level top-k disabled."""
        assert self.candidate_source_layer_id is not None
        return self.candidate_source_layer_id

    # ------------------------------------------------------------------ derived values
    @property
    def partial_rotary_factor(self) -> float:
        """qk_rope_head_dim / head_dim (the V4 config's name for the same thing)."""
        return self.qk_rope_head_dim / self.head_dim

    @property
    def intermediate_size(self) -> int:
        """Width of the shared expert (transformers maps `intermediate_size` to `moe_intermediate_size`)."""
        return self.moe_intermediate_size

    @property
    def layer_types(self) -> tuple[str, ...]:
        """transformers' `layer_types`: `shared_compressed_attention` for KV sources, else sliding."""
        return tuple(
            SHARED_COMPRESSED if i in self.kv_sources else SLIDING for i in range(self.num_hidden_layers)
        )

    @property
    def candidate_enabled(self) -> bool:
        return self.candidate_source >= 0

    @property
    def decoder_cut(self) -> int:
        """max(kv_source_layer_ids): the last layer that runs every prefill row under decoder replay.

        The decoder layers are those after it (21-39 for V4.1-Flash). Without KV sources there is
        no decoder: the cut is the last layer.
        """
        return max(self.kv_sources) if self.kv_sources else self.num_hidden_layers - 1

    @property
    def decoder_layers(self) -> tuple[int, ...]:
        """Layers after the decoder cut: their window entries are rebuilt by decoder replay."""
        return tuple(range(self.decoder_cut + 1, self.num_hidden_layers))

    def compress_ratio(self, layer: int) -> int:
        """Compression ratio of a layer's compressed branch; 0 for window-only layers."""
        return self.ratios[layer]

    def is_kv_source(self, layer: int) -> bool:
        return layer in self.kv_sources

    def has_indexer(self, layer: int) -> bool:
        """Whether the layer runs an indexer (Full or Reindex layers)."""
        return layer in self.index_sources

    def layer_role(self, layer: int) -> str:
        """One of :data:`LAYER_ROLES` (architecture §1.3)."""
        if not 0 <= layer < self.num_hidden_layers:
            raise IndexError(f"layer {layer} is out of range [0, {self.num_hidden_layers})")
        if self.ratios[layer] == 0:
            return WINDOW_ONLY
        if layer in self.kv_sources:
            return FULL
        return REINDEX if layer in self.index_sources else REUSE

    def kv_source_of(self, layer: int) -> int | None:
        """The KV source whose compressed entries and index keys a layer reads; None if window-only."""
        if self.ratios[layer] == 0:
            return None
        earlier = [s for s in self.kv_sources if s <= layer]
        return earlier[-1] if earlier else None

    def selection_owner(self, layer: int) -> int | None:
        """The index source whose top-k selection a layer attends with; None if window-only."""
        if self.ratios[layer] == 0:
            return None
        earlier = [s for s in self.index_sources if s <= layer]
        return earlier[-1] if earlier else None

    def rope_for_layer(self, layer: int) -> RopeConfig:
        """Main RoPE for window-only layers, compress RoPE (θ = compress_rope_theta, YaRN) otherwise."""
        rope = self.rope_main if self.ratios[layer] == 0 else self.rope_compress
        assert rope is not None
        return rope

    def replace(self, **changes: Any) -> DeepseekV41Config:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        *,
        backbone_only: bool = False,
        overrides: Mapping[str, Any] | None = None,
    ) -> DeepseekV41Config:
        """Load a flat or composite transformers config (see the module docstring).

        Absent keys take transformers' defaults. ``backbone_only=True`` switches Engram and DSpark
        off and drops the DSpark layers' trailing `compress_ratios` entries, which is what byte
        accounting of the released checkpoint needs. `overrides` (field → value) replace the
        file's values before validation. With ``kv_quant`` off in the file, or unset everywhere
        on a shape the quantisers cannot take, the config loads unquantised with a warning.
        """
        d = dict(raw)
        model_type = d.pop("model_type", FLAT_MODEL_TYPE)
        top: dict[str, Any] = {}
        if model_type == COMPOSITE_MODEL_TYPE:
            text = d.pop("text_config", None)
            top = {k: d.pop(k) for k in list(d) if k in _COMPOSITE_KEYS}
            vision = top.pop("vision_config", None)
            if text is None:
                # A composite without text_config carries the text fields at the top (transformers f026c83).
                text = {k: v for k, v in d.items() if k not in _GENERIC_KEYS}
                d = {k: v for k, v in d.items() if k in _GENERIC_KEYS}
            if not isinstance(text, dict):
                raise ValueError(f"text_config must be a mapping, got {type(text).__name__}")
            unknown = sorted(k for k in d if k not in _GENERIC_KEYS)
            if unknown:
                raise ValueError(f"unknown DeepSeek-V4.1 composite config fields: {unknown}")
            text = dict(text)
            inner_type = text.pop("model_type", FLAT_MODEL_TYPE)
            if inner_type != FLAT_MODEL_TYPE:
                raise ValueError(f"text_config model_type is {inner_type!r}; expected {FLAT_MODEL_TYPE!r}")
            tie = top.pop("tie_word_embeddings", None)
            if tie is not None:
                if "tie_word_embeddings" in text and bool(text["tie_word_embeddings"]) != bool(tie):
                    raise ValueError(
                        f"tie_word_embeddings is {tie} in the composite config but "
                        f"{text['tie_word_embeddings']} in text_config; make them agree"
                    )
                text["tie_word_embeddings"] = tie
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if key in top:
                    text.setdefault(key, top.pop(key))  # text_config wins when both are given
            if "image_token_id" in top:
                text["image_token_id"] = top.pop("image_token_id")
            if vision is not None and not backbone_only:
                if not isinstance(vision, Mapping):
                    raise ValueError(f"vision_config must be a mapping, got {type(vision).__name__}")
                text["vision_config"] = DeepseekV41VisionConfig.from_dict(vision)
            d = text
        elif model_type != FLAT_MODEL_TYPE:
            raise ValueError(
                f"config model_type is {model_type!r}; this loader reads {FLAT_MODEL_TYPE!r} (flat) or "
                f"{COMPOSITE_MODEL_TYPE!r} (composite)"
            )
        return cls._from_text_dict(d, backbone_only=backbone_only, overrides=overrides or {})

    @classmethod
    def _from_text_dict(
        cls, raw: dict[str, Any], *, backbone_only: bool, overrides: Mapping[str, Any]
    ) -> DeepseekV41Config:
        d = {**raw, **overrides}
        if "engram_pad_token_id" in d:  # NeMo's name
            d.setdefault("engram_pad_id", d["engram_pad_token_id"])
            d.pop("engram_pad_token_id")
        layer_types = d.pop("layer_types", None)
        d.setdefault("num_nextn_predict_layers", 3)  # transformers' default
        if backbone_only:
            d["num_nextn_predict_layers"] = 0
            d["engram_layer_ids"], d["engram_num_embeddings"] = [], []
            d["dspark_target_layer_ids"] = []
            n = int(d.get("num_hidden_layers", cls.num_hidden_layers))
            if d.get("compress_ratios") is not None:
                d["compress_ratios"] = list(d["compress_ratios"])[:n]
        for key in ("engram_layer_ids", "engram_num_embeddings", "dspark_target_layer_ids"):
            if d.get(key) is None:
                d.pop(key, None)
        # RoPE: {"main": ..., "compress": ...} in rope_parameters, or YaRN for the compressed branch in
        # rope_scaling / a flat rope_parameters (transformers derives the pair the same way).
        rp = d.pop("rope_parameters", None) or {}
        scaling = d.pop("rope_scaling", None) or {}
        theta = float(d.get("rope_theta", cls.rope_theta))
        ctheta = float(d.get("compress_rope_theta", cls.compress_rope_theta))
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            main = RopeConfig.from_dict(rp["main"], theta)
            compress = RopeConfig.from_dict(rp["compress"], ctheta)
            partials = {p.get("partial_rotary_factor") for p in (rp["main"], rp["compress"])} - {None}
            head_dim = int(d.get("head_dim", cls.head_dim))
            rope_dim = int(d.get("qk_rope_head_dim", cls.qk_rope_head_dim))
            if any(not math.isclose(float(p), rope_dim / head_dim) for p in partials):
                raise ValueError(
                    f"rope_parameters partial_rotary_factor {sorted(partials)} disagrees with "
                    f"qk_rope_head_dim / head_dim = {rope_dim}/{head_dim}"
                )
        else:
            flat = {k: v for k, v in {**scaling, **rp}.items() if k not in ("main", "compress")}
            main = RopeConfig(rope_theta=theta)
            compress = RopeConfig.from_dict({**flat, "rope_theta": ctheta}, ctheta)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(
            k for k in d if (k not in known or k in ("rope_main", "rope_compress")) and k not in _GENERIC_KEYS
        )
        if unknown:
            raise ValueError(f"unknown DeepSeek-V4.1 config fields: {unknown}")
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs["rope_main"], kwargs["rope_compress"] = main, compress
        _choose_kv_quant(kwargs, cls, from_file="kv_quant" in raw and "kv_quant" not in overrides)
        config = cls(**kwargs)
        if layer_types is not None and tuple(layer_types) != config.layer_types:
            raise ValueError(
                f"layer_types {list(layer_types)} disagrees with kv_source_layer_ids "
                f"{_fmt_ids(config.kv_sources)} (sources are {SHARED_COMPRESSED!r}, all others {SLIDING!r})"
            )
        return config

    @classmethod
    def from_json(cls, path: str | Path, *, backbone_only: bool = False) -> DeepseekV41Config:
        return cls.from_dict(json.loads(Path(path).read_text()), backbone_only=backbone_only)

    def to_dict(self, composite: bool = False) -> dict[str, Any]:
        """A config.json transformers reads back: flat by default, composite with ``composite=True``."""
        text: dict[str, Any] = {"model_type": FLAT_MODEL_TYPE}
        for f in dataclasses.fields(self):
            if f.name in _NOT_HF_FIELDS:
                continue
            v = getattr(self, f.name)
            text[f.name] = list(v) if isinstance(v, tuple) else v
        text["layer_types"] = list(self.layer_types)
        assert self.rope_main is not None and self.rope_compress is not None
        text["rope_parameters"] = {
            "main": self.rope_main.to_dict(self.partial_rotary_factor),
            "compress": self.rope_compress.to_dict(self.partial_rotary_factor),
        }
        if not composite and self.vision_config is None:
            return {**text, "architectures": ["DeepseekV41ForCausalLM"]}
        out: dict[str, Any] = {
            "model_type": COMPOSITE_MODEL_TYPE,
            "architectures": ["DeepseekV41ForCausalLM"],
            "text_config": text,
            "image_token_id": self.image_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.vision_config is not None:
            out["vision_config"] = self.vision_config.to_dict()
        return out

    def digest(self) -> str:
        """SHA-256 of the canonical JSON of every field that changes the text network's numbers."""
        blob = json.dumps(
            {**self.to_dict(), "kv_quant": self.kv_quant}, sort_keys=True, separators=(",", ":")
        )
        return hashlib.sha256(blob.encode()).hexdigest()


def _choose_kv_quant(kwargs: dict[str, Any], cls: type[DeepseekV41Config], *, from_file: bool) -> None:
    """Set ``kv_quant`` in `kwargs` when the file asks for none or the shape forbids it, saying why."""
    head_dim = kwargs.get("head_dim", cls.head_dim)
    index_head_dim = kwargs.get("index_head_dim", cls.index_head_dim)
    if "kv_quant" in kwargs:
        if from_file and not kwargs["kv_quant"]:
            log.warning("config.json sets kv_quant false: loading the model without the KV quantisers")
        return
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (head_dim, index_head_dim)):
        return  # the field checks name the bad width
    reason = unquantisable(head_dim, index_head_dim)
    if reason is not None:
        log.warning("loading the model without the KV quantisers: %s", reason)
        kwargs["kv_quant"] = False
