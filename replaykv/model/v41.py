"""The DeepSeek-V4.1 text model: CSA2 shared compressed KV, causal encoder–decoder, lagged mHC.

Parameter names follow transformers' naming (architecture reference §12): `model.embed_tokens`,
`self_attn.q_a_proj`, `self_attn.compressor.*` on KV sources, `self_attn.indexer.*` on index
sources, fused `mlp.experts.gate_up_proj`, `attn_hc.*`; DeepSeek's released names are mapped on
load by :mod:`replaykv.model.checkpoint`.

Only KV sources own a compressor (ratio 2: gated pooling of pairs; ratio 1: a plain projection);
every later compressed layer reads its source's entries and index keys. Index sources publish a
top-k selection (Full sources score their own keys; Reindex layers re-score the source's keys
with their own weights, inside the candidate source's block mask); Reuse layers attend with the
latest selection. The window K=V entries are FP8, the compressed entries FP4 and the index keys
and queries MXFP4 (fake-quantised, QAT semantics) unless `config.kv_quant` is off.

The forward is split so that replay can run any layer range over any token range:
`embed` -> `run_layers` (any number of times) -> `head`. The attention block and its indexer
are in :mod:`replaykv.model.attention_v41`. Not for: owning caches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from replaykv.model import fused
from replaykv.model.attention_v41 import AttentionV41
from replaykv.model.cache_view import CacheView, LayerCacheView
from replaykv.model.config_v41 import DeepseekV41Config
from replaykv.model.layers import (
    HyperConnection,
    Linear,
    RMSNorm,
    hc_collapse,
    hc_expand,
    linear,
    native_weight,
)
from replaykv.model.moe import MoEV41
from replaykv.model.rope import inv_freq
from replaykv.model.step import IMAGE_ROW_ID, Residual, Selection, Step, build_step, flush_denormals
from replaykv.model.vision import VisionTower


class DecoderLayerV41(nn.Module):
    """Attention and MoE with lagged mHC: each site collapses with the previous site's pre-mix."""

    def __init__(self, config: DeepseekV41Config, layer: int) -> None:
        super().__init__()
        self.self_attn = AttentionV41(config, layer)
        self.mlp = MoEV41(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, state: Residual, step: Step, cache: LayerCacheView, selection: Selection) -> Residual:
        streams = state.streams
        if fused.active(streams):  # training: the compiled mHC forms (same values up to rounding)
            attn_pre, attn_post, attn_comb, x = fused.mix_collapse(
                self.attn_hc, self.input_layernorm, streams, state.pre_mix
            )
            streams = fused.expand(streams, self.self_attn(x, step, cache, selection), attn_post, attn_comb)
            ffn_pre, ffn_post, ffn_comb, x = fused.mix_collapse(
                self.ffn_hc, self.post_attention_layernorm, streams, attn_pre
            )
            ffn = self.mlp(x, state.input_ids)
            return Residual(fused.expand(streams, ffn, ffn_post, ffn_comb), ffn_pre, state.input_ids)
        attn_pre, attn_post, attn_comb = self.attn_hc.mixes(streams)
        attn = self.self_attn(
            self.input_layernorm(hc_collapse(streams, state.pre_mix)), step, cache, selection
        )
        streams = hc_expand(streams, attn, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = self.ffn_hc.mixes(streams)
        ffn = self.mlp(self.post_attention_layernorm(hc_collapse(streams, attn_pre)), state.input_ids)
        return Residual(hc_expand(streams, ffn, ffn_post, ffn_comb), ffn_pre, state.input_ids)


class DeepseekV41Model(nn.Module):
    """Embedding, layers, final collapse with the last pre-mix, final norm."""

    def __init__(self, config: DeepseekV41Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayerV41(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.vision: VisionTower | None = None
        if config.vision_config is not None:
            self.vision = VisionTower(config.vision_config, config.hidden_size)


class DeepseekV41ForCausalLM(nn.Module):
    """`model` + `lm_head` (float32 logits), with the forward split for replay."""

    def __init__(self, config: DeepseekV41Config) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV41Model(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self._freqs: dict[str, torch.Tensor] = {}
        self._freqs_device: torch.device | None = None

    # ------------------------------------------------------------------ pieces of a forward
    def step(self, cache: CacheView, seq: int, write_global: bool = True, global_from: int = 0) -> Step:
        """Positions and RoPE of a call adding `seq` tokens to every row of the view (rows from
        `global_from` on write global KV when `write_global`)."""
        dev = cache.positions.device
        if self._freqs_device != dev:
            c, rd = self.config, self.config.qk_rope_head_dim
            assert c.rope_main is not None and c.rope_compress is not None
            self._freqs = {
                "main": inv_freq(c.rope_main, rd, dev),
                "compress": inv_freq(c.rope_compress, rd, dev),
            }
            self._freqs_device = dev
        return build_step(cache.positions, cache.floors(), seq, self._freqs, write_global, global_from)

    def embed(
        self,
        input_ids: torch.Tensor,
        spans: Sequence[tuple[int, torch.Tensor]] = (),
        offset: int = 0,
    ) -> Residual:
        """input_ids [B, S] -> the residual entering layer 0 (stream 0 selected by the pre-mix).

        `spans`: images of row 0, each (first position, its span's vectors [L, hidden] from
        :meth:`VisionTower.span`); `offset`: the position of column 0. Positions a span covers
        take its vectors instead of the token embedding, and the residual's ids there are
        `IMAGE_ROW_ID` (the router's image bias reads them)."""
        x = self.model.embed_tokens(input_ids)
        if spans:
            if input_ids.shape[0] != 1:
                raise ValueError("image spans are placed in one row at a time")
            x, input_ids = x.clone(), input_ids.clone()
            s = input_ids.shape[1]
            for start, vectors in spans:
                a, b = max(start, offset), min(start + vectors.shape[0], offset + s)
                if a < b:
                    x[0, a - offset : b - offset] = vectors[a - start : b - start].to(x.dtype)
                    input_ids[0, a - offset : b - offset] = IMAGE_ROW_ID
        streams = x.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        pre_mix = torch.zeros(*streams.shape[:-1], dtype=torch.float32, device=x.device)
        pre_mix[..., 0] = 1.0
        return Residual(streams, pre_mix, input_ids)

    def run_layers(
        self,
        state: Residual,
        layers: range,
        step: Step,
        cache: CacheView,
        selection: Selection | None = None,
    ) -> Residual:
        """Run layers [a, b) over the rows of `step` (positions and window floors included)."""
        selection = selection if selection is not None else Selection()
        with flush_denormals():
            for i in layers:
                state = self.model.layers[i](state, step, cache.layers[i], selection)
        return state

    def head(self, state: Residual) -> torch.Tensor:
        """Final collapse with the last pre-mix, norm, float32 logits [B, S, vocab]."""
        hidden = self.model.norm(hc_collapse(state.streams, state.pre_mix))
        return linear(hidden.float(), w := self.lm_head.weight.float(), native_weight(self.lm_head, w))

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: CacheView,
        logits_rows: str = "all",
        spans: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> torch.Tensor:
        """A plain forward of S new tokens per row: every layer over every row. `spans`: image
        spans of a one-row call, at absolute positions (see `embed`)."""
        if len(cache.layers) != len(self.model.layers):
            raise ValueError(f"cache view has {len(cache.layers)} layers, the model {len(self.model.layers)}")
        step = self.step(cache, input_ids.shape[1])
        offset = step.start_host[0] if spans else 0
        state = self.run_layers(
            self.embed(input_ids, spans, offset), range(len(self.model.layers)), step, cache
        )
        if logits_rows == "last":
            state = state.rows(state.streams.shape[1] - 1, state.streams.shape[1])
        elif logits_rows == "none":
            return torch.zeros(input_ids.shape[0], 0, self.config.vocab_size, device=input_ids.device)
        return self.head(state)

    def decoder_global_kv(self, cache: CacheView) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's global KV: entries and index keys of the last KV source, which every
        decoder layer reads ([B, N, head_dim], [B, N, index_head_dim], N = tokens so far)."""
        cut = self.config.decoder_cut
        lc = cache.layers[cut]
        assert lc.entries is not None and lc.index_keys is not None
        n = max(cache.positions.tolist()) // max(1, self.config.compress_ratio(cut))
        return lc.entries[:, :n], lc.index_keys[:, :n]
