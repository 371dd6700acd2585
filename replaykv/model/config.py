"""Model configuration for the DeepSeek-V4 text model, with Hugging Face field names.

`DeepseekV4Config` is a frozen dataclass whose fields are those of transformers'
`DeepseekV4Config` (5.24), so a `config.json` written by `save_pretrained` loads unchanged
(`from_dict` / `from_json`) and `to_dict` writes one transformers reads back. Derived values
are properties; validation happens in `__post_init__` with messages that say what to change.
Not for: cache sizing (see :mod:`replaykv.model.spec`) or the V4.1 schedule.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
V4_LAYER_TYPES = (SLIDING, CSA, HCA)
V4_MLP_LAYER_TYPES = ("hash_moe", "moe")
_DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}

# Keys every transformers config.json carries that say nothing about the network.
_GENERIC_HF_KEYS = frozenset(
    {
        "architectures", "dtype", "torch_dtype", "transformers_version", "_name_or_path", "use_cache",
        "output_attentions", "output_hidden_states", "return_dict", "output_router_logits",
        "router_aux_loss_coef", "router_jitter_noise", "attention_dropout", "initializer_range",
        "num_nextn_predict_layers", "auto_map", "quantization_config", "chunk_size_feed_forward",
        "is_encoder_decoder", "id2label", "label2id", "problem_type", "tokenizer_class",
        "task_specific_params", "expert_dtype", "model_type",
    }
)  # fmt: skip


@dataclass(frozen=True)
class RopeConfig:
    """One RoPE flavour: `default` (plain) or `yarn` (frequency-only YaRN, no mscale)."""

    rope_type: str = "default"
    rope_theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "yarn"):
            raise ValueError(f"rope_type {self.rope_type!r} is not supported; use 'default' or 'yarn'")
        if self.rope_type == "yarn" and (
            self.factor is None or self.original_max_position_embeddings is None
        ):
            raise ValueError("a yarn rope needs both 'factor' and 'original_max_position_embeddings'")

    @classmethod
    def from_dict(cls, d: dict[str, Any], theta: float) -> RopeConfig:
        rope_type = d.get("rope_type", d.get("type", "default"))
        return cls(
            rope_type=rope_type,
            rope_theta=float(d.get("rope_theta", theta)),
            factor=None if d.get("factor") is None else float(d["factor"]),
            original_max_position_embeddings=d.get("original_max_position_embeddings"),
            beta_fast=float(d.get("beta_fast") or 32.0),
            beta_slow=float(d.get("beta_slow") or 1.0),
        )

    def to_dict(self, partial_rotary_factor: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rope_type": self.rope_type,
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": partial_rotary_factor,
        }
        if self.rope_type == "yarn":
            out.update(
                factor=self.factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
                beta_fast=self.beta_fast,
                beta_slow=self.beta_slow,
                attention_factor=1.0,
            )
        return out


@dataclass(frozen=True)
class DeepseekV4Config:
    """The DeepSeek-V4 text model. Field names and defaults follow transformers' `DeepseekV4Config`."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    layer_types: tuple[str, ...] = ()
    compress_rates: dict[str, int] = field(default_factory=lambda: dict(_DEFAULT_COMPRESS_RATES))
    mlp_layer_types: tuple[str, ...] = ()
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1.0e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hidden_act: str = "silu"
    rms_norm_eps: float = 1.0e-6
    partial_rotary_factor: float = 64 / 512
    rope_main: RopeConfig = field(default_factory=RopeConfig)
    rope_compress: RopeConfig = field(default_factory=lambda: RopeConfig(rope_theta=160000.0))
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # Not a transformers field: the FP8/FP4 KV fake-quantisers. transformers' V4 runs without them.
    kv_quant: bool = False

    model_type = "deepseek_v4"

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if not self.layer_types:
            interleave = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            object.__setattr__(self, "layer_types", tuple([HCA] * min(n, 2) + interleave))
        if not self.mlp_layer_types:
            object.__setattr__(
                self, "mlp_layer_types", tuple(["hash_moe"] * min(n, 3) + ["moe"] * max(0, n - 3))
            )
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        for name, types, allowed in (
            ("layer_types", self.layer_types, V4_LAYER_TYPES),
            ("mlp_layer_types", self.mlp_layer_types, V4_MLP_LAYER_TYPES),
        ):
            if len(types) != n:
                raise ValueError(
                    f"{name} has {len(types)} entries but num_hidden_layers is {n}; give one per layer"
                )
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise ValueError(f"{name} entries must be one of {allowed}; got {bad}")
        if self.num_key_value_heads != 1:
            raise ValueError("DeepSeek-V4 uses one shared KV head: set num_key_value_heads to 1")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of o_groups ({self.o_groups})"
            )
        rope_dim = self.qk_rope_head_dim
        if rope_dim % 2 or rope_dim <= 0 or rope_dim > self.head_dim or rope_dim > self.index_head_dim:
            raise ValueError(
                f"qk_rope_head_dim = head_dim * partial_rotary_factor = {rope_dim} must be even, positive and "
                f"no larger than head_dim ({self.head_dim}) and index_head_dim ({self.index_head_dim})"
            )
        for lt in (CSA, HCA):
            if lt in self.layer_types and self.compress_rates.get(lt, 0) < 2:
                raise ValueError(f"compress_rates[{lt!r}] must be an integer >= 2")
        if self.sliding_window < 1:
            raise ValueError("sliding_window must be >= 1")
        if self.scoring_func != "sqrtsoftplus":
            raise NotImplementedError(
                f"scoring_func {self.scoring_func!r} is not implemented; only 'sqrtsoftplus'"
            )
        if self.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {self.hidden_act!r} is not implemented; only 'silu'")

    # ------------------------------------------------------------------ derived values
    @property
    def qk_rope_head_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def intermediate_size(self) -> int:
        """Width of the shared expert (transformers maps `intermediate_size` to `moe_intermediate_size`)."""
        return self.moe_intermediate_size

    def compress_ratio(self, layer: int) -> int:
        """Compression ratio of a layer's compressed branch; 0 for sliding-only layers."""
        lt = self.layer_types[layer]
        return 0 if lt == SLIDING else int(self.compress_rates[lt])

    def has_indexer(self, layer: int) -> bool:
        return self.layer_types[layer] == CSA

    def rope_for_layer(self, layer: int) -> RopeConfig:
        return self.rope_main if self.layer_types[layer] == SLIDING else self.rope_compress

    def replace(self, **changes: Any) -> DeepseekV4Config:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DeepseekV4Config:
        d = dict(raw)
        model_type = d.get("model_type", cls.model_type)
        if model_type != cls.model_type:
            raise ValueError(f"config model_type is {model_type!r}; this loader reads {cls.model_type!r}")
        # Legacy fields transformers folds in.
        ratios = d.pop("compress_ratios", None)
        rates = dict(d.pop("compress_rates", None) or _DEFAULT_COMPRESS_RATES)
        if "compress_rate_csa" in d:
            rates[CSA] = d.pop("compress_rate_csa")
        if "compress_rate_hca" in d:
            rates[HCA] = d.pop("compress_rate_hca")
        if d.get("layer_types") is None and ratios is not None:
            try:
                d["layer_types"] = [_RATIO_TO_LAYER_TYPE[int(r)] for r in ratios]
            except KeyError as e:
                raise ValueError(
                    f"compress_ratios entry {e.args[0]} is not one of 0, 4, 128 for DeepSeek-V4"
                ) from e
        num_hash = d.pop("num_hash_layers", None)
        if d.get("mlp_layer_types") is None and num_hash is not None:
            n = int(d.get("num_hidden_layers", cls.num_hidden_layers))
            d["mlp_layer_types"] = ["hash_moe"] * min(n, num_hash) + ["moe"] * max(0, n - num_hash)
        rope_dim = d.pop("qk_rope_head_dim", None)
        head_dim = int(d.get("head_dim", cls.head_dim))
        if d.get("partial_rotary_factor") is None:
            d["partial_rotary_factor"] = (rope_dim / head_dim) if rope_dim is not None else 64 / 512
        rp = d.pop("rope_parameters", None) or d.pop("rope_scaling", None) or {}
        theta = float(d.get("rope_theta", cls.rope_theta))
        ctheta = float(d.get("compress_rope_theta", cls.compress_rope_theta))
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            main = RopeConfig.from_dict(rp["main"], theta)
            compress = RopeConfig.from_dict(rp["compress"], ctheta)
        else:
            main = RopeConfig(rope_theta=theta)
            flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
            compress = RopeConfig.from_dict({**flat, "rope_theta": ctheta}, ctheta)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if k not in known and k not in _GENERIC_HF_KEYS)
        if unknown:
            raise ValueError(f"unknown DeepSeek-V4 config fields: {unknown}")
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs["compress_rates"] = {str(k): int(v) for k, v in rates.items()}
        kwargs["rope_main"], kwargs["rope_compress"] = main, compress
        for key in ("layer_types", "mlp_layer_types"):
            if kwargs.get(key) is not None:
                kwargs[key] = tuple(kwargs[key])
            else:
                kwargs.pop(key, None)
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | Path) -> DeepseekV4Config:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model_type": self.model_type, "architectures": ["DeepseekV4ForCausalLM"]}
        for f in dataclasses.fields(self):
            if f.name in ("rope_main", "rope_compress", "kv_quant"):
                continue
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        out["qk_rope_head_dim"] = self.qk_rope_head_dim
        out["rope_parameters"] = {
            "main": self.rope_main.to_dict(self.partial_rotary_factor),
            "compress": self.rope_compress.to_dict(self.partial_rotary_factor),
        }
        return out

    def digest(self) -> str:
        """SHA-256 of the canonical JSON of every field that changes the network's numbers."""
        blob = json.dumps(
            {**self.to_dict(), "kv_quant": self.kv_quant}, sort_keys=True, separators=(",", ":")
        )
        return hashlib.sha256(blob.encode()).hexdigest()


def yarn_low_high(rope: RopeConfig, rope_dim: int) -> tuple[float, float]:
    """YaRN's correction range (pair indices), truncated to integers as transformers does."""
    assert rope.original_max_position_embeddings is not None

    def dim_for(rotations: float) -> float:
        num = rope_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))  # type: ignore[operator]
        return num / (2 * math.log(rope.rope_theta))

    low = math.floor(dim_for(rope.beta_fast))
    high = math.ceil(dim_for(rope.beta_slow))
    return float(max(low, 0)), float(min(high, rope_dim - 1))
