"""Builders of random transformers DeepSeek-V4 models for equivalence tests (transformers is test-only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# Schedules mixing sliding-only, CSA and HCA layers, with windows small enough that a few hundred
# tokens cross them many times. Index heads are kept >= 16 so top-k ties (which transformers
# breaks arbitrarily) do not occur.
SCHEDULES: dict[str, dict[str, Any]] = {
    "mixed": dict(
        layer_types=[S, C, H, C], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={C: 4, H: 16}, sliding_window=16, hc_mult=2, index_topk=6,
    ),
    "hca_first": dict(
        layer_types=[H, H, C, S, C], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
        compress_rates={C: 4, H: 8}, sliding_window=8, hc_mult=4, index_topk=5,
    ),
    "csa_yarn": dict(
        layer_types=[C, C, C], mlp_layer_types=["moe", "moe", "moe"],
        compress_rates={C: 4, H: 128}, sliding_window=5, hc_mult=3, index_topk=9,
        rope_parameters={"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
    ),
}  # fmt: skip


def build_hf_model(schedule: str, seed: int = 0) -> Any:
    """A random transformers DeepseekV4ForCausalLM with every zero-initialised extra randomised."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    kw = dict(SCHEDULES[schedule])
    cfg = DeepseekV4Config(
        vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=len(kw["layer_types"]),
        num_attention_heads=4, head_dim=32, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=6,
        o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=32, partial_rotary_factor=16 / 32,
        max_position_embeddings=4096, attn_implementation="eager", **kw,
    )  # fmt: skip
    model = DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, cfg.n_routed_experts, b.shape))
            elif name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


def save_hf_model(schedule: str, directory: Path, seed: int = 0) -> Any:
    model = build_hf_model(schedule, seed)
    model.save_pretrained(directory)
    return model


def hf_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()
