"""Loading and saving Hugging Face-format checkpoints (config.json + safetensors).

DeepSeek-V4 (`model_type` deepseek_v4) and DeepSeek-V4.1 (flat `deepseek_v41_text` or composite
`deepseek_v41` configs). A directory written by transformers' `save_pretrained` loads unchanged,
and so do DeepSeek's released names; the family and naming are detected from config and keys,
and a checkpoint that matches neither is rejected with the keys that do not fit.
`save_pretrained` writes transformers' names. Not for: downloading from a hub.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from replaykv.model import native
from replaykv.model.config import DeepseekV4Config
from replaykv.model.config_v41 import DeepseekV41Config
from replaykv.model.v4 import DeepseekV4ForCausalLM
from replaykv.model.v41 import DeepseekV41ForCausalLM

AnyConfig = DeepseekV4Config | DeepseekV41Config
AnyModel = DeepseekV4ForCausalLM | DeepseekV41ForCausalLM

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Parameters that stay float32 whatever the compute dtype (as transformers keeps them).
_FP32_SUFFIXES = (
    "sinks", "position_bias", "e_score_correction_bias", "q_a_norm.weight", "kv_norm.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight",
)  # fmt: skip
_FP32_PARTS = ("attn_hc.", "ffn_hc.", "hc_head.", "e_score_correction_bias_vl", "model.vision.")
# The image path (tower, aligner, span vectors) stays float32: its norms are LayerNorms with float32
# weights, and its output is cast to the embedding dtype where a span is placed.

# DeepSeek-V4.1 indexers sit beside the compressor (V4 nests them inside it).
_V41_INDEXER = [
    (r"^self_attn\.compressor\.indexer\.scorer\.weights_proj\.", "self_attn.indexer.weights_proj."),
    (r"^self_attn\.compressor\.indexer\.q_b_proj\.", "self_attn.indexer.q_b_proj."),
    (r"^self_attn\.indexer\.wk\.", "self_attn.indexer.k_proj."),
    (r"^mlp\.gate\.bias_vl$", "mlp.gate.e_score_correction_bias_vl"),
]


# DeepSeek's released leaf names -> transformers' names, inside one layer ("attn." / "ffn." already mapped).
_DEEPSEEK_LEAVES = [
    (r"^attn_norm\.", "input_layernorm."),
    (r"^ffn_norm\.", "post_attention_layernorm."),
    (r"^hc_(attn|ffn)_(fn|base|scale)$", r"\1_hc.\2"),
    (r"^self_attn\.attn_sink$", "self_attn.sinks"),
    (r"^self_attn\.wq_a\.", "self_attn.q_a_proj."),
    (r"^self_attn\.q_norm\.", "self_attn.q_a_norm."),
    (r"^self_attn\.wq_b\.", "self_attn.q_b_proj."),
    (r"^self_attn\.wkv\.", "self_attn.kv_proj."),
    (r"^self_attn\.wo_a\.", "self_attn.o_a_proj."),
    (r"^self_attn\.wo_b\.", "self_attn.o_b_proj."),
    (r"^self_attn\.indexer\.compressor\.", "self_attn.compressor.indexer."),
    (r"^self_attn\.indexer\.wq_b\.", "self_attn.compressor.indexer.q_b_proj."),
    (r"^self_attn\.indexer\.weights_proj\.", "self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.ape$", ".position_bias"),
    (r"^(self_attn(\.compressor(\.indexer)?)?)\.norm\.", r"\1.kv_norm."),
    (r"^mlp\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"^mlp\.shared_experts\.w1\.", "mlp.shared_experts.gate_proj."),
    (r"^mlp\.shared_experts\.w2\.", "mlp.shared_experts.down_proj."),
    (r"^mlp\.shared_experts\.w3\.", "mlp.shared_experts.up_proj."),
]
_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "embed_tokens.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(w[123])\.weight$")


_M = TypeVar("_M", bound=nn.Module)


def to_transformers_names(state: dict[str, torch.Tensor], family: str = "v4") -> dict[str, torch.Tensor]:
    """Rename a checkpoint in any known naming to transformers' names.

    Accepts transformers' names, DeepSeek's released names (`embed.weight`,
    `layers.N.attn.wq_a.weight`, per-expert `w1/w2/w3`, `head.weight`) and the mix transformers
    5.24 writes (DeepSeek leaves under `model.`). Per-expert weights are fused into
    `experts.gate_up_proj` [E, 2I, H] (w1 rows then w3) and `experts.down_proj` [E, H, I].
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        bare = key[len("model.") :] if key.startswith("model.") else key
        if bare in _TOP_LEVEL or key in _TOP_LEVEL:
            out[_TOP_LEVEL.get(bare, _TOP_LEVEL.get(key, key))] = value
            continue
        m = re.match(r"^layers\.(\d+)\.(.*)$", bare)
        if not m:
            out[key] = value  # lm_head.weight, model.norm.weight, model.hc_head.* in transformers' names
            continue
        layer, rest = m.group(1), m.group(2)
        rest = re.sub(r"^attn\.", "self_attn.", rest)
        rest = re.sub(r"^ffn\.", "mlp.", rest)
        for pattern, repl in _DEEPSEEK_LEAVES + (_V41_INDEXER if family == "v41" else []):
            rest = re.sub(pattern, repl, rest)
        em = _EXPERT.match(rest)
        if em:
            experts.setdefault((layer, str(em.group(2))), {})[str(em.group(1))] = value
            continue
        out[f"model.layers.{layer}.{rest}"] = value
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for (layer, which), by_id in experts.items():
        if not all(str(i) in by_id for i in range(len(by_id))):
            raise ValueError(f"layer {layer}: expert ids of {which} are not 0..{len(by_id) - 1}")
        fused.setdefault(layer, {})[which] = torch.stack([by_id[str(i)] for i in range(len(by_id))])
    for layer, parts in fused.items():
        if set(parts) != {"w1", "w2", "w3"}:
            raise ValueError(f"layer {layer}: experts need w1, w2 and w3; found {sorted(parts)}")
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([parts["w1"], parts["w3"]], dim=1)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = parts["w2"]
    return out


def to_internal_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' names -> our module names (the indexer sits beside the compressor)."""
    out = {}
    for key, value in state.items():
        if ".self_attn.compressor.indexer." in key:
            head, tail = key.split(".self_attn.compressor.indexer.")
            if tail.split(".")[0] in ("kv_proj", "gate_proj", "position_bias", "kv_norm"):
                tail = "key_compressor." + tail
            key = f"{head}.self_attn.indexer.{tail}"
        out[key] = value
    return out


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def read_state_dict(model_dir: Path, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint directory (single file or sharded with an index), read one at a
    time through ``safe_open`` (memory-mapped); names starting with a prefix in `skip` are never read."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(model_dir.glob("*.safetensors"))]
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(model_dir / name), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                if not key.startswith(skip):
                    # its own allocation: file-buffer alignment can change fp32 rounding
                    state[key] = f.get_tensor(key).clone()
    return state


def load_config(model_dir: str | Path, kv_quant: bool | None = None) -> AnyConfig:
    """DeepSeek-V4 or V4.1 config from `config.json`, chosen by its model_type.

    `kv_quant` (None: as the config says) is applied before the config is validated.
    """
    raw: dict[str, Any] = json.loads((Path(model_dir) / "config.json").read_text())
    return config_from_dict(raw, kv_quant)


def config_from_dict(raw: dict[str, Any], kv_quant: bool | None = None) -> AnyConfig:
    model_type = raw.get("model_type")
    overrides = {} if kv_quant is None else {"kv_quant": kv_quant}
    if model_type == "deepseek_v4":
        config = DeepseekV4Config.from_dict(raw)
        return config if kv_quant is None else config.replace(kv_quant=kv_quant)
    if model_type in ("deepseek_v41", "deepseek_v41_text"):
        return DeepseekV41Config.from_dict(raw, overrides=overrides)
    raise ValueError(
        f"config model_type {model_type!r} is not supported; expected deepseek_v4, deepseek_v41 or deepseek_v41_text"
    )


def build_model(config: AnyConfig) -> AnyModel:
    if isinstance(config, DeepseekV41Config):
        return DeepseekV41ForCausalLM(config)
    return DeepseekV4ForCausalLM(config)


def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast to dtype, keeping norms, mixes, sinks, biases and routing tables in float32/int."""
    for name, p in model.named_parameters():
        keep = name.endswith(_FP32_SUFFIXES) or any(part in name for part in _FP32_PARTS)
        p.data = p.data.float() if keep else p.data.to(dtype)
    return model


def load_model(
    model_dir: str | Path,
    device: torch.device | str = "cpu",
    dtype: str | torch.dtype = "float32",
    config: AnyConfig | None = None,
) -> Any:
    """Build the model from `config.json` (or `config`) and load its weights (either naming)."""
    model_dir = Path(model_dir)
    config = config if config is not None else load_config(model_dir)
    with torch.device("meta"):
        model = build_model(config)
    model = model.to_empty(device="cpu")
    # DeepSeek's released image path (``vision.``, ``aligner.``, ...) has no mapping onto ours;
    # our own tower loads from ``model.vision.`` (see :mod:`replaykv.model.vision`).
    ignored = ("mtp.", "model.mtp.", "vision.", "aligner.", "image_start", "image_end", "image_newline")
    state = read_state_dict(model_dir, skip=ignored)
    family = "v41" if isinstance(config, DeepseekV41Config) else "v4"
    state = to_transformers_names(state, family)
    if family == "v4":
        state = to_internal_names(state)
    if config.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {model_dir} does not match its config: missing {sorted(missing)[:8]}, "
            f"unexpected {sorted(unexpected)[:8]}"
        )
    cast_model(model, parse_dtype(dtype))
    return place(model, device)


def place(model: _M, device: str | torch.device) -> _M:
    """The model on `device` for inference (eval mode). On the CPU the native kernels are built
    now (once per machine, under a minute), so that no request pays for the build."""
    if torch.device(device).type == "cpu":
        native.enabled()
    return model.to(torch.device(device)).eval()


def to_transformers_state_dict(model: AnyModel) -> dict[str, torch.Tensor]:
    """Our state dict under transformers' names (V4: the indexer nested under the compressor)."""
    out = {}
    v4 = isinstance(model, DeepseekV4ForCausalLM)
    for k, v in model.state_dict().items():
        if v4 and ".self_attn.indexer." in k:
            head, tail = k.split(".self_attn.indexer.")
            tail = tail.replace("key_compressor.", "")
            k = f"{head}.self_attn.compressor.indexer.{tail}"
        out[k] = v.detach().contiguous().cpu()
    return out


WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# A safetensors header holds, per tensor, its name, dtype, shape and offsets as JSON; shards are
# packed leaving this much per tensor (and the fixed part) for it.
_HEADER_PER_TENSOR = 256
_HEADER_FIXED = 1024


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over the model's tensors as they sit in memory (names, dtypes, shapes, bytes): what
    cache namespaces and reports name the weights by."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (its index's shards when it has one)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        return [model_dir / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [model_dir / WEIGHTS_FILE] if (model_dir / WEIGHTS_FILE).is_file() else []


def has_weights(model_dir: str | Path) -> bool:
    """Whether `model_dir` holds a single-file or a sharded (indexed) checkpoint."""
    return bool(weight_files(model_dir))


def _shards(state: dict[str, torch.Tensor], shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in order, packed into files of at most `shard_bytes` (header included)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = _HEADER_FIXED
    for name, t in state.items():
        need = t.numel() * t.element_size() + _HEADER_PER_TENSOR + len(name)
        if _HEADER_FIXED + need > shard_bytes:
            raise ValueError(f"tensor {name} ({need:,} bytes) does not fit a shard of {shard_bytes:,} bytes")
        if shards[-1] and used + need > shard_bytes:
            shards.append({})
            used = _HEADER_FIXED
        shards[-1][name] = t
        used += need
    return shards


def save_pretrained(model: AnyModel, model_dir: str | Path, shard_bytes: int | None = None) -> None:
    """Write config.json and the weights in transformers' layout: model.safetensors, or with
    `shard_bytes` and more weights than that, shards of at most `shard_bytes` bytes each
    (model-0000i-of-0000n.safetensors) listed by model.safetensors.index.json. Weight files of an
    earlier save in `model_dir` are removed first, so the directory holds one checkpoint."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg["dtype"] = str(model.lm_head.weight.dtype).replace("torch.", "")
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for old in [*model_dir.glob("model*.safetensors"), model_dir / INDEX_FILE]:
        old.unlink(missing_ok=True)
    state = to_transformers_state_dict(model)
    total = sum(t.numel() * t.element_size() for t in state.values())
    if shard_bytes is None or total + _HEADER_FIXED + _HEADER_PER_TENSOR * len(state) <= shard_bytes:
        save_file(state, str(model_dir / WEIGHTS_FILE), metadata={"format": "pt"})
        return
    shards = _shards(state, shard_bytes)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(model_dir / name), metadata={"format": "pt"})
        size = (model_dir / name).stat().st_size
        if size > shard_bytes:  # the header estimate fell short: never hand out an oversized file
            raise RuntimeError(f"{name} is {size:,} bytes, over the {shard_bytes:,}-byte shard size")
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (model_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
