"""The DeepSeek-V4.1 attention block and its lightning indexer (architecture reference §12).

`AttentionV41`: queries through a low-rank projection, one shared K = V window head (FP8), the
compressed entries of its KV source (FP4) read whole or through the latest top-k selection, sink
logits and a grouped low-rank output projection. `IndexerV41`: an index source's scorer (Full
sources score their own keys, Reindex layers re-score the source's inside the candidate blocks).
`publish_groups`: a KV source's new groups into its group's caches. Not for: owning caches (the
block writes into the views it is given), the layer stack (:mod:`replaykv.model.v41`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from replaykv.model.attention import (
    _BLOCK_BUDGET,
    grouped_projection,
    head_sum,
    index_dots,
    joint_attention,
    sliced_scores,
)
from replaykv.model.cache_view import LayerCacheView
from replaykv.model.compressor import (
    Compressor,
    causal_entry_limit,
    ordered_ring,
    scatter_entries,
    topk_lowest_index,
    write_ring,
)
from replaykv.model.config_v41 import DeepseekV41Config
from replaykv.model.layers import Linear, RMSNorm, cast
from replaykv.model.quant import fp4_entry_fake_quant, fp8_window_fake_quant, mxfp4_index_fake_quant
from replaykv.model.rope import apply_rope
from replaykv.model.step import Selection, Step


class IndexerV41(nn.Module):
    """Index source: queries from the attention's q residual, keys from the source's latents.

    Parameters (transformers names): q_b_proj [Hi·Di, q_lora], weights_proj [Hi, hidden] and,
    on KV sources, k_proj [Di, head_dim] and k_norm [Di].
    """

    def __init__(self, config: DeepseekV41Config, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.ratio = config.compress_ratio(layer)
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.topk = config.index_topk
        self.quant = config.kv_quant
        self.is_candidate_source = layer == config.candidate_source
        self.uses_candidates = 0 <= config.candidate_source < layer
        self.cand_blocks = config.candidate_topk_blocks
        self.cand_size = config.candidate_block_size
        self.q_b_proj = Linear(config.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = Linear(config.hidden_size, self.n_heads)
        self.owns_keys = config.is_kv_source(layer)
        self.k_proj: Linear | None = None
        self.k_norm: RMSNorm | None = None
        if self.owns_keys:
            self.k_proj = Linear(config.head_dim, self.head_dim)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def keys(self, latents: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Index keys of new groups from their pre-RoPE latents: MXFP4(rope(k_norm(k_proj(latent))))."""
        assert self.k_proj is not None and self.k_norm is not None
        k = self.k_norm(self.k_proj(cast(latents, self.k_proj.weight.dtype)))
        return mxfp4_index_fake_quant(apply_rope(k, cos, sin), enabled=self.quant)

    def _scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """sum_h w_h · relu(q_h · k) / sqrt(Di): q [B, Q, H, Di], w [B, Q, H], keys [B, N, Di] -> [B, Q, N]."""
        b, nq, h, _ = q.shape
        dots = F.relu_(index_dots(q, keys)).mul_(self.head_dim**-0.5)
        return head_sum(dots.view(b, nq, h, keys.shape[1]), w)

    def select(
        self, x: torch.Tensor, q_res: torch.Tensor, keys: torch.Tensor, step: Step, selection: Selection
    ) -> None:
        """Score every query against the visible keys; publish top-k (and candidates) in `selection`."""
        b, s, _ = x.shape
        k = self.topk  # fixed width (-1 padded): attention reductions do not depend on chunking
        q = self.q_b_proj(q_res).view(b, s, self.n_heads, self.head_dim)
        q = mxfp4_index_fake_quant(apply_rope(q, *step.rope.heads("compress")), enabled=self.quant).float()
        w = self.weights_proj(x).float() * self.n_heads**-0.5  # [B, S, Hi]
        limit = causal_entry_limit(step.positions, self.ratio)  # [B, S]
        keys_f = keys.float()
        topk = torch.full((b, s, k), -1, dtype=torch.long, device=x.device)
        n_cand = 0
        if self.is_candidate_source:
            n_blocks = -(-keys.shape[1] // self.cand_size)
            n_cand = min(self.cand_blocks, n_blocks)
        cands = torch.full((b, s, n_cand), -1, dtype=torch.long, device=x.device) if n_cand else None
        for i0, i1, n_vis in step.entry_blocks(self.ratio, b * self.n_heads, _BLOCK_BUDGET):
            if n_vis > 0:
                scores = sliced_scores(self._scores, q[:, i0:i1], w[:, i0:i1], keys_f[:, :n_vis])  # [B, Q, N]
                lim = limit[:, i0:i1, None]
                lo = step.common_entries(self.ratio, i0)  # entries [0, lo) are visible to all
                if lo < n_vis:
                    tail = torch.arange(lo, n_vis, device=x.device) >= lim
                    scores[..., lo:].masked_fill_(tail, float("-inf"))
                if cands is not None:
                    picked = self._candidates(scores, lim)
                    cands[:, i0:i1, : picked.shape[-1]] = picked
                elif self.uses_candidates and selection.candidates is not None:
                    scores = scores.masked_fill_(
                        ~self._candidate_mask(selection.candidates[:, i0:i1], n_vis), float("-inf")
                    )
                idx = topk_lowest_index(scores, min(k, n_vis))
                dropped = scores.gather(-1, idx) == float("-inf")
                topk[:, i0:i1, : idx.shape[-1]] = idx.masked_fill_(dropped, -1)
        selection.topk = topk
        if cands is not None:
            selection.candidates = cands

    def _candidates(self, scores: torch.Tensor, lim: torch.Tensor) -> torch.Tensor:
        """Level one of the two-level top-k: the best blocks of `cand_size` positions per query,
        the block of the newest visible position always kept, unreachable blocks dropped.
        scores: [B, Q, N] (-inf where unreachable); lim: [B, Q, 1] -> block ids [B, Q, kb]."""
        n = scores.shape[-1]
        pad = -n % self.cand_size
        blocks = F.pad(scores, (0, pad), value=float("-inf")).unflatten(-1, (-1, self.cand_size)).amax(-1)
        newest = torch.div(lim - 1, self.cand_size, rounding_mode="floor")  # [B, Q, 1]
        blocks = blocks.masked_fill(
            torch.arange(blocks.shape[-1], device=scores.device) == newest, float("inf")
        )
        kb = min(self.cand_blocks, blocks.shape[-1])
        idx = topk_lowest_index(blocks, kb)
        return idx.masked_fill_(blocks.gather(-1, idx) == float("-inf"), -1)

    def _candidate_mask(self, cand: torch.Tensor, n: int) -> torch.Tensor:
        """Block ids [B, Q, kb] -> position mask [B, Q, n]."""
        n_blocks = -(-n // self.cand_size)
        mask = torch.zeros(*cand.shape[:-1], n_blocks + 1, dtype=torch.bool, device=cand.device)
        mask.scatter_(-1, cand.clamp(min=-1).remainder(n_blocks + 1).masked_fill(cand < 0, n_blocks), True)
        return mask[..., :n_blocks].repeat_interleave(self.cand_size, dim=-1)[..., :n]


class AttentionV41(nn.Module):
    """One DeepSeek-V4.1 attention block (transformers' parameter names under `self_attn.`)."""

    def __init__(self, config: DeepseekV41Config, layer: int) -> None:
        super().__init__()
        self.config = config
        self.layer = layer
        h, d, hidden = config.num_attention_heads, config.head_dim, config.hidden_size
        self.n_heads, self.head_dim, self.window = h, d, config.sliding_window
        self.ratio = config.compress_ratio(layer)
        self.rope_kind = "main" if self.ratio == 0 else "compress"
        self.quant = config.kv_quant
        self.q_a_proj = Linear(hidden, config.q_lora_rank)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = Linear(config.q_lora_rank, h * d)
        self.kv_proj = Linear(hidden, d)
        self.kv_norm = RMSNorm(d, config.rms_norm_eps)
        self.o_groups = config.o_groups
        self.o_a_proj = Linear(h * d // config.o_groups, config.o_groups * config.o_lora_rank)
        self.o_b_proj = Linear(config.o_groups * config.o_lora_rank, hidden)
        self.sinks = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        self.compressor: Compressor | None = None
        if config.is_kv_source(layer):
            r = self.ratio
            self.compressor = Compressor(
                hidden, d, r, overlap=False, eps=config.rms_norm_eps, gate=r > 1, position_bias=False
            )
        self.indexer = IndexerV41(config, layer) if config.has_indexer(layer) else None

    def forward(
        self, x: torch.Tensor, step: Step, cache: LayerCacheView, selection: Selection
    ) -> torch.Tensor:
        """x [B, S, hidden] (normed) -> [B, S, hidden]."""
        b, s, _ = x.shape
        w = self.window
        cos, sin = step.rope[self.rope_kind]
        cos_h, sin_h = step.rope.heads(self.rope_kind)
        q_res, q = self.queries(x, cos_h, sin_h)
        kv = apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)
        kv = fp8_window_fake_quant(kv, enabled=self.quant)  # [B, S, D]
        ring_first = None
        if s == 1:  # decode: write the slot, then read the window (in place where its dtype allows)
            slots = step.start.remainder(w)
            cache.window[torch.arange(b, device=x.device), slots] = cast(kv[:, 0], cache.window.dtype)
            if cache.window.dtype == kv.dtype:
                win_keys, ring_first = cache.window, step.start + 1 - w
            else:
                win_keys = cast(ordered_ring(cache.window, step.start + 1, w), kv.dtype)
        else:
            earlier = ordered_ring(cache.window, step.start, w - 1)
            if step.context is not None:  # a sequence shard: the previous shard's last rows
                earlier = step.context.halo(kv, w - 1)
            win_keys = torch.cat([cast(earlier, kv.dtype), kv], dim=1)
            write_ring(cache.window, kv, step.start)

        entries = chosen = None
        if self.ratio:
            assert cache.entries is not None and cache.index_keys is not None
            writing = step.global_rows
            if self.compressor is not None and writing is not None:
                self._compress(x[:, step.global_from :], writing, cache)
                if step.context is not None:  # a sequence shard: the other shards' groups
                    step.context.share(cache, self.ratio, step)
            n = max((p + s) // self.ratio for p in step.start_host)
            if self.indexer is not None:
                self.indexer.select(x, q_res, cache.index_keys[:, :n], step, selection)
            chosen = selection.topk
            if chosen is not None:
                entries = cast(cache.entries[:, :n], q.dtype)
        o = joint_attention(q, win_keys, step, w, self.sinks, entries, self.ratio, chosen, ring_first)
        o = apply_rope(o, cos_h, sin_h, inverse=True)
        return self.o_b_proj(grouped_projection(o, self.o_a_proj.weight, self.o_groups, self.o_a_proj))

    def queries(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The q residual [..., S, q_lora] and the rotated queries [..., S, H, D] of rows x
        [..., S, hidden] (normed), given the per-head RoPE tables of their positions: what the
        forward attends with, for anyone who reads this block's attention on chosen rows (the
        indexer's distillation, the evidence loss, probes)."""
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_res).view(*x.shape[:-1], self.n_heads, self.head_dim)
        return q_res, apply_rope(q, cos, sin)

    def _compress(self, x: torch.Tensor, step: Step, cache: LayerCacheView) -> None:
        """New groups -> index keys (from the pre-RoPE latents) and FP4 entries at position g·r."""
        assert self.compressor is not None
        latents, first, count = self.compressor.pool(x, step, cache.carry)
        keys = self.indexer.keys if self.indexer is not None and self.indexer.owns_keys else None
        publish_groups(latents, first, count, self.ratio, self.quant, keys, step, cache)


def publish_groups(
    latents: torch.Tensor,
    first: list[int],
    count: list[int],
    ratio: int,
    quant: bool,
    keys: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None,
    step: Step,
    cache: LayerCacheView,
) -> None:
    """A KV source's new groups into its group's caches: FP4 entries (RoPE at position g·r) and,
    with `keys` (the source indexer's key function), the index keys. latents [B, G, D] pre-RoPE;
    row b's latents [0, count[b]) are groups first[b] + [0, count[b]). Any holder of the latents
    can run this: the source layer itself, or a later pipeline stage rebuilding the group's
    caches from latents it received (with a replica of the key function)."""
    assert cache.entries is not None and cache.index_keys is not None
    if latents.shape[1] == 0:
        return
    groups = torch.tensor(first, device=latents.device)[:, None] + torch.arange(
        latents.shape[1], device=latents.device
    )
    cos, sin = step.rope.at("compress", groups * ratio)
    if keys is not None:
        scatter_entries(cache.index_keys, keys(latents, cos, sin), first, count)
    rotated = fp4_entry_fake_quant(apply_rope(latents, cos, sin), enabled=quant)
    scatter_entries(cache.entries, rotated, first, count)
