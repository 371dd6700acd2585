"""Named model configurations: the released shapes (for accounting, on the meta device) and the
small ones we run here. Not for: weights (a preset with random weights is announced as such)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from replaykv.model.config import CSA, HCA, SLIDING, DeepseekV4Config, RopeConfig

if TYPE_CHECKING:
    from replaykv.model.config_v41 import DeepseekV41Config

_V4_FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4]
_TYPES = {0: SLIDING, 4: CSA, 128: HCA}


def v4_flash() -> DeepseekV4Config:
    """DeepSeek-V4-Flash's released text shape (43 layers: 2 sliding, 21 CSA, 20 HCA)."""
    return DeepseekV4Config(
        hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, head_dim=512, q_lora_rank=1024,
        n_routed_experts=256, moe_intermediate_size=2048, num_experts_per_tok=6,
        layer_types=tuple(_TYPES[r] for r in _V4_FLASH_RATIOS), index_n_heads=64, index_head_dim=128,
        index_topk=512, o_groups=8, o_lora_rank=1024, sliding_window=128,
        rope_compress=RopeConfig("yarn", 160000.0, 16.0, 65536), kv_quant=True,
    )  # fmt: skip


def v4_tiny() -> DeepseekV4Config:
    """A 6-layer, ~4M-parameter DeepSeek-V4 (2 sliding, 2 CSA, 2 HCA) with the real 128-token window:
    the shape the tests and benchmarks use."""
    return DeepseekV4Config(
        vocab_size=2048, hidden_size=128, moe_intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, head_dim=64, q_lora_rank=64, num_experts_per_tok=2, n_routed_experts=8,
        layer_types=(SLIDING, SLIDING, CSA, HCA, CSA, HCA),
        mlp_layer_types=("hash_moe", "moe", "moe", "moe", "moe", "moe"),
        hc_mult=4, sliding_window=128, o_groups=2, o_lora_rank=32, index_n_heads=4, index_head_dim=32,
        index_topk=64, partial_rotary_factor=16 / 64, max_position_embeddings=262144,
        rope_compress=RopeConfig("yarn", 160000.0, 16.0, 65536),
    )  # fmt: skip


PRESETS_V4 = {"v4-flash": v4_flash, "v4-tiny": v4_tiny}


def all_presets() -> dict[str, Callable[[], DeepseekV4Config | DeepseekV41Config]]:
    """Every named config: DeepSeek-V4 and V4.1 (`tiny` is V4.1's checklist config, `small` the
    shipped size)."""
    from replaykv.model.presets_v41 import PRESETS_V41, v41_small, v41_tiny

    return {**PRESETS_V4, **PRESETS_V41, "tiny": v41_tiny, "small": v41_small}


def get_preset(name: str) -> DeepseekV4Config | DeepseekV41Config:
    presets = all_presets()
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(presets)}")
    return presets[name]()
