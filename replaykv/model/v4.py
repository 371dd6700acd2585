"""The DeepSeek-V4 text model (transformers' `DeepseekV4ForCausalLM` parameter names).

`DeepseekV4ForCausalLM.forward(input_ids, cache)` runs S new tokens per row on top of what the
cache view already holds and returns logits. Residuals are hc_mult parallel streams mixed by
mHC hyper-connections; the last streams collapse through `hc_head`, the final norm and lm_head.
Not for: owning caches or scheduling requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from replaykv.model.attention import Attention
from replaykv.model.cache_view import CacheView, LayerCacheView
from replaykv.model.config import DeepseekV4Config
from replaykv.model.layers import (
    HyperConnection,
    HyperHead,
    Linear,
    RMSNorm,
    hc_collapse,
    hc_expand,
    linear,
    native_weight,
)
from replaykv.model.moe import MoE
from replaykv.model.rope import inv_freq
from replaykv.model.step import Residual, Selection, Step, build_step, flush_denormals


class DecoderLayer(nn.Module):
    """Attention and MoE, each wrapped by its own mHC site."""

    def __init__(self, config: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MoE(config, layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(
        self,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        step: Step,
        cache: LayerCacheView,
    ) -> torch.Tensor:
        """streams [B, S, n, hidden] -> [B, S, n, hidden]."""
        pre, post, comb = self.attn_hc.mixes(streams)
        attn = self.self_attn(self.input_layernorm(hc_collapse(streams, pre)), step, cache)
        streams = hc_expand(streams, attn, post, comb)
        pre, post, comb = self.ffn_hc.mixes(streams)
        ffn = self.mlp(self.post_attention_layernorm(hc_collapse(streams, pre)), input_ids)
        return hc_expand(streams, ffn, post, comb)


class DeepseekV4Model(nn.Module):
    """Embedding, decoder layers, final stream collapse and norm."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(config)

    def step(self, cache: CacheView, seq: int, write_global: bool = True, global_from: int = 0) -> Step:
        """Positions and RoPE tables of a call adding `seq` tokens to every row of the view (rows
        from `global_from` on write global KV when `write_global`)."""
        c = self.config
        dev = cache.positions.device
        key = (str(dev), c.qk_rope_head_dim)
        if getattr(self, "_freqs_key", None) != key:
            self._freqs = {
                "main": inv_freq(c.rope_main, c.qk_rope_head_dim, dev),
                "compress": inv_freq(c.rope_compress, c.qk_rope_head_dim, dev),
            }
            self._freqs_key = key
        return build_step(cache.positions, cache.floors(), seq, self._freqs, write_global, global_from)

    def forward(self, input_ids: torch.Tensor, cache: CacheView) -> torch.Tensor:
        """input_ids [B, S] -> final hidden states [B, S, hidden]."""
        s = input_ids.shape[1]
        if len(cache.layers) != len(self.layers):
            raise ValueError(f"cache view has {len(cache.layers)} layers, the model {len(self.layers)}")
        step = self.step(cache, s)
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
            streams = layer(streams, input_ids, step, layer_cache)
        return self.norm(self.hc_head(streams))


class DeepseekV4ForCausalLM(nn.Module):
    """`model` + `lm_head` (computed in float32)."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV4Model(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)

    # The forward split for replay (same calls as DeepSeek-V4.1; V4 has no lagged pre-mix).
    def step(self, cache: CacheView, seq: int, write_global: bool = True, global_from: int = 0) -> Step:
        return self.model.step(cache, seq, write_global, global_from)

    def embed(
        self, input_ids: torch.Tensor, spans: Sequence[tuple[int, torch.Tensor]] = (), offset: int = 0
    ) -> Residual:
        if spans:
            raise NotImplementedError("DeepSeek-V4 has no image path here; images need a DeepSeek-V4.1 model")
        x = self.model.embed_tokens(input_ids)
        streams = x.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        return Residual(streams, streams.new_zeros(streams.shape[:-1], dtype=torch.float32), input_ids)

    def run_layers(
        self, state: Residual, layers: range, step: Step, cache: CacheView, selection: Selection | None = None
    ) -> Residual:
        streams = state.streams
        with flush_denormals():
            for i in layers:
                streams = self.model.layers[i](streams, state.input_ids, step, cache.layers[i])
        return Residual(streams, state.pre_mix, state.input_ids)

    def head(self, state: Residual) -> torch.Tensor:
        hidden = self.model.norm(self.model.hc_head(state.streams))
        return linear(hidden.float(), w := self.lm_head.weight.float(), native_weight(self.lm_head, w))

    def forward(self, input_ids: torch.Tensor, cache: CacheView, logits_rows: str = "all") -> torch.Tensor:
        """input_ids [B, S] -> logits [B, S, vocab] ("all") or [B, 1, vocab] ("last"), float32."""
        with flush_denormals():
            hidden = self.model(input_ids, cache)
        if logits_rows == "last":
            hidden = hidden[:, -1:]
        elif logits_rows == "none":
            return hidden[:, :0].new_zeros(hidden.shape[0], 0, self.config.vocab_size).float()
        return linear(hidden.float(), w := self.lm_head.weight.float(), native_weight(self.lm_head, w))
