"""DeepseekV41Config: both config.json forms, transformers' defaults, the NeMo schedule rules,
Engram/DSpark refusal and the roles of the released schedule (architecture §1, §9.1, §12)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from replaykv.model.config_v41 import (
    FULL,
    REINDEX,
    REUSE,
    WINDOW_ONLY,
    DeepseekV41Config,
    hf_default_compress_ratios,
)
from replaykv.model.presets_v41 import PRESETS_V41, get_preset_v41, v41_flash, v41_small, v41_tiny

RELEASED_RATIOS = [0, 0] + [2] * 18 + [1] * 20


def released_text_fields() -> dict[str, Any]:
    """The text fields of the released checkpoint's config.json, as transformers writes them."""
    return {
        "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40,
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1280,
        "qk_rope_head_dim": 64, "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "max_position_embeddings": 1048576, "attention_bias": False, "attention_dropout": 0.0,
        "sliding_window": 128, "compress_ratios": [*RELEASED_RATIOS, 0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "o_groups": 8, "o_lora_rank": 1024,
        "moe_intermediate_size": 2304, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6,
        "scoring_func": "sqrtsoftplus", "gate_temp": 1.0, "norm_topk_prob": True, "routed_scaling_factor": 1.5,
        "topk_method": "noaux_tc", "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682], "engram_vocab_size": 16000000,
        "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256, "engram_pad_id": 2,
        "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3, "dspark_block_size": 5,
        "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
        "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3, "hidden_act": "silu",
        "initializer_range": 0.02, "rms_norm_eps": 1e-20, "use_cache": True, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None, "output_router_logits": False,
        "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
    }  # fmt: skip


def released_composite() -> dict[str, Any]:
    return {
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        "text_config": released_text_fields(),
        "vision_config": {"model_type": "deepseek_v41_vision", "hidden_size": 1024, "num_hidden_layers": 32},
        "image_token_id": 129264,
        "tie_word_embeddings": False,
        "transformers_version": "5.30.0.dev0",
        "dtype": "bfloat16",
    }


# ------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("name", sorted(PRESETS_V41))
def test_flat_and_composite_round_trip_to_equal_configs(name: str) -> None:
    # kv_quant is a loading choice (`--kv-quant`), not a config.json field: a preset with the
    # quantisers off (`v41-tiny-smooth`) reads back with them on.
    config = get_preset_v41(name).replace(kv_quant=True)
    flat = DeepseekV41Config.from_dict(json.loads(json.dumps(config.to_dict())))
    composite = DeepseekV41Config.from_dict(json.loads(json.dumps(config.to_dict(composite=True))))
    assert flat == composite == config
    assert flat.digest() == composite.digest() == config.digest()


def test_released_config_is_refused_for_engram_and_loads_as_backbone() -> None:
    with pytest.raises(NotImplementedError, match="Engram is not supported yet"):
        DeepseekV41Config.from_dict(released_composite())
    composite = DeepseekV41Config.from_dict(released_composite(), backbone_only=True)
    flat = DeepseekV41Config.from_dict(released_text_fields(), backbone_only=True)
    assert composite == flat == v41_flash()


def test_flat_config_without_text_config_in_a_composite_is_adopted() -> None:
    # transformers f026c83: a `deepseek_v41` config with the text fields at the top level.
    fields = {k: v for k, v in released_text_fields().items() if k != "model_type"}
    raw = {"model_type": "deepseek_v41", **fields, "image_token_id": 129264}
    assert DeepseekV41Config.from_dict(raw, backbone_only=True) == v41_flash()


def test_dspark_is_refused_and_absent_key_means_transformers_default() -> None:
    with pytest.raises(NotImplementedError, match="DSpark is not supported yet"):
        DeepseekV41Config(num_nextn_predict_layers=3)
    fields = v41_tiny().to_dict()
    del fields["num_nextn_predict_layers"]  # transformers' default is 3 draft layers
    with pytest.raises(
        NotImplementedError, match=r"DSpark is not supported yet.*num_nextn_predict_layers is 3"
    ):
        DeepseekV41Config.from_dict(fields)


def test_engram_is_refused() -> None:
    with pytest.raises(
        NotImplementedError, match=r"Engram is not supported yet: engram_layer_ids is \[1, 14\]"
    ):
        DeepseekV41Config(engram_layer_ids=(1, 14), engram_num_embeddings=(10, 10))


def test_generic_keys_are_ignored_and_unknown_keys_rejected() -> None:
    fields = v41_tiny().to_dict()
    fields.update(
        transformers_version="5.30.0", torch_dtype="bfloat16", use_cache=True, initializer_range=0.02
    )
    assert DeepseekV41Config.from_dict(fields) == v41_tiny()
    with pytest.raises(ValueError, match=r"unknown DeepSeek-V4.1 config fields: \['frobnicate'\]"):
        DeepseekV41Config.from_dict({**fields, "frobnicate": 1})
    composite = v41_tiny().to_dict(composite=True)
    with pytest.raises(
        ValueError, match=r"unknown DeepSeek-V4.1 composite config fields: \['audio_config'\]"
    ):
        DeepseekV41Config.from_dict({**composite, "audio_config": {}})
    with pytest.raises(ValueError, match="model_type is 'deepseek_v4'"):
        DeepseekV41Config.from_dict({**fields, "model_type": "deepseek_v4"})
    with pytest.raises(ValueError, match="tie_word_embeddings is True in the composite"):
        DeepseekV41Config.from_dict({**composite, "tie_word_embeddings": True})


def test_nemo_engram_pad_name_and_int_thetas_load() -> None:
    fields = v41_tiny().to_dict()
    fields["engram_pad_token_id"] = fields.pop("engram_pad_id")
    fields["rope_theta"], fields["compress_rope_theta"] = 10000, 160000
    loaded = DeepseekV41Config.from_dict(fields)
    assert loaded == v41_tiny() and loaded.digest() == v41_tiny().digest()


def test_layer_types_must_agree_with_the_sources() -> None:
    fields = v41_tiny().to_dict()
    assert fields["layer_types"][2] == "shared_compressed_attention"
    fields["layer_types"] = ["sliding_attention"] * 10
    with pytest.raises(ValueError, match=r"layer_types .* disagrees with kv_source_layer_ids"):
        DeepseekV41Config.from_dict(fields)


def test_digest_tracks_the_network_only() -> None:
    tiny = v41_tiny()
    assert tiny.digest() != tiny.replace(kv_quant=False).digest()
    assert tiny.digest() != tiny.replace(index_topk=8).digest()
    assert tiny.digest() == tiny.replace(image_token_id=7).digest()


# ------------------------------------------------------------------------------- defaults


def test_hf_scaling_rule_for_compress_ratios() -> None:
    assert hf_default_compress_ratios(40) == tuple(RELEASED_RATIOS)
    assert hf_default_compress_ratios(10) == (0, 0, 2, 2, 2, 2, 1, 1, 1, 1)
    assert hf_default_compress_ratios(12) == (0, 0) + (2,) * 5 + (1,) * 5
    assert hf_default_compress_ratios(1) == (0,)
    default = DeepseekV41Config()
    assert default.ratios == tuple(RELEASED_RATIOS)
    assert default.kv_sources == (2, 8, 14, 20)
    assert default.index_sources == (2, 8, 14, 20, 24, 28, 32, 36)
    assert default.candidate_source == 20
    scaled = DeepseekV41Config(num_hidden_layers=10)
    assert scaled.kv_sources == scaled.index_sources == (2, 6)  # first layer of each ratio run
    assert scaled.candidate_source == 6
    truncated = DeepseekV41Config(num_hidden_layers=10, compress_ratios=tuple(RELEASED_RATIOS[:10]))
    assert truncated.kv_sources == truncated.index_sources == (2, 8)  # released ids below 10 (NeMo)


# ------------------------------------------------------------------------------- roles


def test_released_schedule_roles_sources_and_owners() -> None:
    c = v41_flash()
    expected_owner = {**dict.fromkeys(range(2, 8), 2), **dict.fromkeys(range(8, 14), 8),
                      **dict.fromkeys(range(14, 20), 14), **dict.fromkeys(range(20, 24), 20),
                      **dict.fromkeys(range(24, 28), 24), **dict.fromkeys(range(28, 32), 28),
                      **dict.fromkeys(range(32, 36), 32), **dict.fromkeys(range(36, 40), 36)}  # fmt: skip
    expected_source = {i: (2 if i < 8 else 8 if i < 14 else 14 if i < 20 else 20) for i in range(2, 40)}
    for i in range(40):
        assert c.selection_owner(i) == expected_owner.get(i), i
        assert c.kv_source_of(i) == expected_source.get(i), i
    roles = [c.layer_role(i) for i in range(40)]
    assert [i for i, r in enumerate(roles) if r == WINDOW_ONLY] == [0, 1]
    assert [i for i, r in enumerate(roles) if r == FULL] == [2, 8, 14, 20]
    assert [i for i, r in enumerate(roles) if r == REINDEX] == [24, 28, 32, 36]
    assert roles.count(REUSE) == 30  # "40 层里有 30 层是 Reuse"
    assert c.decoder_cut == 20 and c.decoder_layers == tuple(range(21, 40))
    assert c.layer_types.count("shared_compressed_attention") == 4
    assert c.rope_for_layer(0).rope_type == "default" and c.rope_for_layer(2).rope_type == "yarn"


def test_checklist_and_small_schedules() -> None:
    tiny = v41_tiny()
    assert [tiny.layer_role(i) for i in range(10)] == [
        WINDOW_ONLY, WINDOW_ONLY, FULL, REUSE, REINDEX, REUSE, FULL, REUSE, REINDEX, REUSE,
    ]  # fmt: skip
    assert [tiny.selection_owner(i) for i in range(10)] == [None, None, 2, 2, 4, 4, 6, 6, 8, 8]
    assert tiny.decoder_cut == 6 and tiny.candidate_source == 6
    small = v41_small()
    assert small.sliding_window == 128 and small.ratios[:2] == (0, 0)
    assert small.decoder_cut == small.candidate_source and small.ratios[small.decoder_cut] == 1
    decoder_roles = {small.layer_role(i) for i in small.decoder_layers}
    assert decoder_roles == {REUSE, REINDEX}
    encoder_sources = [s for s in small.kv_sources if small.ratios[s] == 2]
    assert len(encoder_sources) >= 2 and REUSE in {small.layer_role(i) for i in range(2, small.decoder_cut)}


# ------------------------------------------------------------------------------- validation

# (changes to v41_tiny, exception, regex the message must match)
_RULES: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"compress_ratios": (0, 0, 2, 2, 2, 2, 1, 1, 1)}, ValueError,
     "compress_ratios has 9 entries but num_hidden_layers is 10"),
    ({"compress_ratios": (0, 0, 2, -2, 2, 2, 1, 1, 1, 1)}, ValueError, r"compress_ratios must be >= 0.*layers \[3\]"),
    ({"kv_source_layer_ids": (2, 6, 12)}, ValueError, r"kv_source_layer_ids: layer ids \[12\] are out of range"),
    ({"index_source_layer_ids": (2, 6, 4, 8)}, ValueError, "index_source_layer_ids must be sorted and unique"),
    ({"kv_source_layer_ids": (2, 2, 6)}, ValueError, "kv_source_layer_ids must be sorted and unique"),
    ({"kv_source_layer_ids": (1, 2, 6), "index_source_layer_ids": (1, 2, 4, 6, 8)}, ValueError,
     r"rule 'a KV source must have compress ratio > 0': layers \[1\]"),
    ({"index_source_layer_ids": (0, 2, 4, 6, 8)}, ValueError,
     r"rule 'an index source must have compress ratio > 0': layers \[0\]"),
    ({"compress_ratios": (0, 2, 2, 2, 2, 2, 1, 1, 1, 1), "index_source_layer_ids": (1, 2, 4, 6, 8)}, ValueError,
     r"rule 'an index source needs a KV source at or before it': layers \[1\]"),
    ({"compress_ratios": (0, 2, 2, 2, 2, 2, 1, 1, 1, 1)}, ValueError,
     r"rule 'every compressed layer reads a KV source at or before it': layers \[1\]"),
    ({"compress_ratios": (0, 0, 2, 2, 2, 2, 2, 1, 1, 1)}, ValueError,
     r"rule 'every compressed layer shares its KV source's ratio': layers 7 \(ratio 1, source 6 has 2\), 8 .*9"),
    ({"index_source_layer_ids": (4, 6, 8)}, ValueError, r"rule 'every KV source is an index source': layers \[2\]"),
    ({"candidate_source_layer_id": 8}, ValueError,
     r"rule 'the candidate source must be a KV source \(negative disables it\)'.* 8 is not in .*\[2, 6\]"),
    ({"candidate_topk_blocks": 0}, ValueError, "candidate_topk_blocks and candidate_block_size must be positive"),
    ({"head_dim": 48}, ValueError, r"kv_quant is on but head_dim \(48\) is not a multiple of 32"),
    ({"index_head_dim": 48}, ValueError, r"kv_quant is on but index_head_dim \(48\) is not a multiple of 32"),
    ({"qk_rope_head_dim": 15}, ValueError, "qk_rope_head_dim must be a positive even integer"),
    ({"qk_rope_head_dim": 48}, ValueError, r"qk_rope_head_dim \(48\) must not exceed .*index_head_dim \(32\)"),
    ({"o_groups": 3}, ValueError, r"num_attention_heads \(4\) must be a multiple of o_groups \(3\)"),
    ({"num_key_value_heads": 2}, ValueError, "set num_key_value_heads to 1"),
    ({"num_experts_per_tok": 5}, ValueError, r"num_experts_per_tok \(5\) must not exceed n_routed_experts \(4\)"),
    ({"hidden_size": 0}, ValueError, "hidden_size must be a positive integer"),
    ({"eos_token_id": 600}, ValueError, r"eos_token_id \[600\] is outside the vocabulary \[0, 512\)"),
    ({"rope_theta": 5000.0}, ValueError, r"rope_main.rope_theta \(10000.0\) differs from rope_theta \(5000.0\)"),
    ({"scoring_func": "softmax"}, NotImplementedError, "scoring_func 'softmax' is not implemented"),
    ({"attention_bias": True}, NotImplementedError, "attention_bias is not implemented"),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "error", "pattern"), _RULES, ids=[p[:40] for _, _, p in _RULES])
def test_every_rule_fails_with_a_clear_message(
    changes: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    fields = {**v41_tiny().__dict__, **changes}
    if "rope_theta" in changes:
        fields["rope_main"] = v41_tiny().rope_main
    with pytest.raises(error, match=pattern):
        DeepseekV41Config(**fields)


def test_rules_relax_where_documented() -> None:
    tiny = v41_tiny()
    assert tiny.replace(candidate_source_layer_id=-1).candidate_enabled is False
    assert tiny.replace(head_dim=48, index_head_dim=48, kv_quant=False).head_dim == 48
    window_only = DeepseekV41Config(num_hidden_layers=2, compress_ratios=(0, 0), hidden_size=64, num_attention_heads=4,
                                    head_dim=64, q_lora_rank=16, o_groups=2, o_lora_rank=16, index_head_dim=64)  # fmt: skip
    assert (
        window_only.kv_sources == ()
        and window_only.decoder_layers == ()
        and window_only.candidate_source == -1
    )


def test_messages_name_the_rule_verbatim() -> None:
    # The message quotes the rule so a user can find it in the docs (architecture §9.1).
    with pytest.raises(ValueError) as info:
        v41_tiny().replace(index_source_layer_ids=(4, 6, 8))
    assert re.search(r"'every KV source is an index source'", str(info.value))
