"""Named DeepSeek-V4.1 configurations: the released shape (for accounting, never built with real
weights here), the §10 checklist config the tests use, and the small model we train and ship.

Not for: weights (a preset with random weights is announced as such by whoever builds it).
"""

from __future__ import annotations

from collections.abc import Callable

from replaykv.model.config import RopeConfig
from replaykv.model.config_v41 import (
    RELEASED_COMPRESS_RATIOS,
    RELEASED_INDEX_SOURCES,
    RELEASED_KV_SOURCES,
    DeepseekV41Config,
)
from replaykv.model.vision import DeepseekV41VisionConfig


def _flash_compress_rope() -> RopeConfig:
    """The released compressed-branch RoPE: θ = 160000 with frequency-only YaRN ×16 from 64K."""
    return RopeConfig("yarn", 160000.0, 16.0, 65536, beta_fast=32.0, beta_slow=1.0)


def v41_flash() -> DeepseekV41Config:
    """DeepSeek-V4.1-Flash's released text backbone (architecture §0.1): 40 layers, ratios
    [0,0]+[2]*18+[1]*20, KV sources [2,8,14,20], index sources [2,8,14,20,24,28,32,36],
    candidate source 20. Engram and the 3 DSpark layers are off (not supported here)."""
    return DeepseekV41Config(
        vocab_size=129280, hidden_size=5120, num_hidden_layers=40, num_attention_heads=64, head_dim=512,
        q_lora_rank=1280, qk_rope_head_dim=64, o_groups=8, o_lora_rank=1024, sliding_window=128,
        compress_ratios=RELEASED_COMPRESS_RATIOS, kv_source_layer_ids=RELEASED_KV_SOURCES,
        index_source_layer_ids=RELEASED_INDEX_SOURCES, candidate_source_layer_id=20,
        candidate_topk_blocks=2048, candidate_block_size=8, index_n_heads=32, index_head_dim=128,
        index_topk=512, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_compress=_flash_compress_rope(), max_position_embeddings=1048576, hc_mult=4,
        hc_sinkhorn_iters=20, hc_eps=1e-6, n_routed_experts=384, num_experts_per_tok=6, n_shared_experts=1,
        moe_intermediate_size=2304, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0,
        rms_norm_eps=1e-20, bos_token_id=0, eos_token_id=1, image_token_id=129264, kv_quant=True,
    )  # fmt: skip


def v41_tiny() -> DeepseekV41Config:
    """The architecture §10 checklist config: every mechanism at toy size (10 layers, window 8).

    Ratios [0,0,2,2,2,2,1,1,1,1], KV sources [2,6], index sources [2,4,6,8], candidate source 6:
    layer 4 is an encoder Reindex layer, layer 8 a decoder Reindex layer constrained by the
    candidate blocks of layer 6. Byte vocabulary (512 ids; bos 256, eos 257 as ByteTokenizer).
    """
    return DeepseekV41Config(
        vocab_size=512, hidden_size=256, num_hidden_layers=10, num_attention_heads=4, head_dim=64,
        qk_rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32, sliding_window=8,
        index_n_heads=2, index_head_dim=32, index_topk=4, candidate_topk_blocks=2, candidate_block_size=2,
        compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1), kv_source_layer_ids=(2, 6),
        index_source_layer_ids=(2, 4, 6, 8), candidate_source_layer_id=6,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, hc_mult=2,
        max_position_embeddings=65536, rope_compress=_flash_compress_rope(), rms_norm_eps=1e-6,
        bos_token_id=256, eos_token_id=257,
    )  # fmt: skip


def v41_small() -> DeepseekV41Config:
    """The model we train and ship: the V4.1 schedule shape at ~13M parameters.

    12 layers with transformers' scaling rule [0,0]+[2]*5+[1]*5 and the real 128-token window:

    ======  ==============  ========  ===================================================
    layers  ratio           source    roles
    ======  ==============  ========  ===================================================
    0-1     0 (window)      -         window-only
    2-4     2 (encoder)     2         2 Full, 3-4 Reuse
    5-6     2 (encoder)     5         5 Full, 6 Reuse
    7-11    1 (decoder)     7         7 Full + candidate source, 8 Reuse, 9 Reindex, 10-11 Reuse
    ======  ==============  ========  ===================================================

    Decoder cut 7, so decoder replay trims layers 8-11. hidden 256, 4 heads × 64, RoPE 16, 4 index
    heads × 32 (2 heads tie too often, architecture §11), top-512 (V4.1-Flash's value) of 64
    candidate blocks × 8 (with top-64, the checkpoint at step 3500 found held-out pass keys at
    2,048 tokens in 2-5 of 20 cases per depth, with top-512 the same weights in 16-18: the
    indexer's selection, not the attention, lost them; docs/training.md),
    8 experts top-2 of width 128 plus one shared expert, 4 mHC streams, byte vocabulary (512 ids).
    """
    return DeepseekV41Config(
        vocab_size=512, hidden_size=256, num_hidden_layers=12, num_attention_heads=4, head_dim=64,
        qk_rope_head_dim=16, q_lora_rank=128, o_groups=2, o_lora_rank=64, sliding_window=128,
        index_n_heads=4, index_head_dim=32, index_topk=512, candidate_topk_blocks=64, candidate_block_size=8,
        compress_ratios=(0, 0, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1), kv_source_layer_ids=(2, 5, 7),
        index_source_layer_ids=(2, 5, 7, 9), candidate_source_layer_id=7,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, hc_mult=4,
        max_position_embeddings=65536, rope_compress=_flash_compress_rope(), rms_norm_eps=1e-6,
        bos_token_id=256, eos_token_id=257,
    )  # fmt: skip


def v41_tiny_vision() -> DeepseekV41Config:
    """`v41-tiny` with an image path small enough for tests on 2 cores: a 2-layer tower of width
    32 (2 heads), patch 14, pixel-unshuffle 3, at least 84² pixels (a 2 × 2 grid, 8 positions:
    the window's width) and at most 64 positions per image; image token id 511 (the last id of
    the padded vocabulary)."""
    vision = DeepseekV41VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        min_pixels=84 * 84, max_image_tokens=64,
    )  # fmt: skip
    return v41_tiny().replace(vision_config=vision, image_token_id=511)


def v41_small_vision() -> DeepseekV41Config:
    """`v41-small` with a 4-layer tower of width 128 (4 heads, MLP 256), at least 224² pixels
    (a 6 × 6 grid, 44 positions) and at most 256 positions per image; image token id 511."""
    vision = DeepseekV41VisionConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        min_pixels=224 * 224, max_image_tokens=256,
    )  # fmt: skip
    return v41_small().replace(vision_config=vision, image_token_id=511)


def v41_tiny_smooth() -> DeepseekV41Config:
    """`v41-tiny` with every discrete choice made continuous: each indexer selects every
    compressed entry of a 64-position sequence, the candidate source every block, each token
    goes to all 4 experts, and the KV quantisers are off. For equivalence checks over many
    optimizer steps, where a near tie in a top-k or a rounding step falling the other way would
    turn float32 summation-order differences into diverging weights (docs/training.md)."""
    return v41_tiny().replace(index_topk=64, candidate_topk_blocks=32, num_experts_per_tok=4, kv_quant=False)


PRESETS_V41: dict[str, Callable[[], DeepseekV41Config]] = {
    "v41-flash": v41_flash,
    "v41-tiny": v41_tiny,
    "v41-small": v41_small,
    "v41-tiny-vision": v41_tiny_vision,
    "v41-small-vision": v41_small_vision,
    "v41-tiny-smooth": v41_tiny_smooth,
}


def get_preset_v41(name: str) -> DeepseekV41Config:
    if name not in PRESETS_V41:
        raise ValueError(f"unknown DeepSeek-V4.1 preset {name!r}; choose one of {sorted(PRESETS_V41)}")
    return PRESETS_V41[name]()
