"""DeepSeek-V4 attention: shared-KV MQA over a sliding window plus compressed entries, with sinks.

Every query attends jointly (one softmax, plus a per-head sink logit) to its window keys and to
its visible compressed entries: all of them for dense (HCA) layers, the indexer's top-k for
sparse (CSA) layers. The kernel works on blocks of queries and gathers each block's keys, so no
[S, S] or [S, S/r] tensor is ever built; memory grows linearly with the sequence.

Not for: allocating caches (the caller passes a :class:`LayerCacheView`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replaykv.model.cache_view import LayerCacheView
from replaykv.model.compressor import (
    Compressor,
    causal_entry_limit,
    ordered_ring,
    scatter_entries,
    topk_lowest_index,
    write_ring,
)
from replaykv.model.config import DeepseekV4Config
from replaykv.model.layers import RMSNorm, unweighted_rms_norm
from replaykv.model.rope import apply_rope, cos_sin

# Upper bound on the elements of one block's logits / gathered keys (keeps peak memory flat).
_BLOCK_BUDGET = 1 << 22


class RopeTables:
    """RoPE for one call: inverse frequencies per flavour ('main', 'compress') and the cos/sin
    of the call's rows ([B, S, rope_dim // 2] each)."""

    def __init__(self, freqs: dict[str, torch.Tensor], positions: torch.Tensor) -> None:
        self.freqs = freqs
        self.rows = {kind: cos_sin(f, positions) for kind, f in freqs.items()}

    def __getitem__(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows[kind]

    def at(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin at arbitrary positions [...] -> [..., rope_dim // 2]."""
        return cos_sin(self.freqs[kind], positions)


class IndexScorer(nn.Module):
    """Holds the per-head weight projection of the indexer (`scorer.weights_proj`)."""

    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)


class Indexer(nn.Module):
    """DeepSeek-V4 lightning indexer: its own overlapping compressor at index_head_dim, ReLU-scored
    multi-head keys, top-k per query. Parameters: kv_proj, gate_proj, position_bias, kv_norm,
    q_b_proj, scorer.weights_proj (transformers names)."""

    def __init__(self, config: DeepseekV4Config, ratio: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.topk = config.index_topk
        self.key_compressor = Compressor(
            config.hidden_size, self.head_dim, ratio, overlap=True, eps=config.rms_norm_eps
        )
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.scorer = IndexScorer(config.hidden_size, self.n_heads)

    def select(
        self,
        x: torch.Tensor,
        q_res: torch.Tensor,
        keys: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Top-k compressed entries per query, -1 where fewer are visible.

        x [B, S, hidden], q_res [B, S, q_lora], keys [B, N, Di] (rotated), positions [B, S]
        -> [B, S, min(topk, N)] long.
        """
        b, s, _ = x.shape
        n = keys.shape[1]
        k = min(self.topk, n)
        q = self.q_b_proj(q_res).view(b, s, self.n_heads, self.head_dim)
        q = apply_rope(q, cos[:, :, None], sin[:, :, None]).float()
        w = self.scorer.weights_proj(x).float() * self.n_heads**-0.5  # [B, S, Hi]
        w = w * self.head_dim**-0.5  # fold the score scale into the head weights
        limit = causal_entry_limit(positions, self.ratio)  # [B, S]
        keys_f = keys.float()
        out = torch.full((b, s, k), -1, dtype=torch.long, device=x.device)
        i0 = 0
        while i0 < s:
            # Block size from the visible prefix of the entries at this block's first query.
            n_first = max(1, int(limit[:, i0].max().item()))
            step = max(1, min(s - i0, _BLOCK_BUDGET // max(1, b * self.n_heads * n_first)))
            i1 = min(s, i0 + step)
            n_vis = int(limit[:, i0:i1].max().item())
            if n_vis > 0:
                qb = q[:, i0:i1]
                nq = i1 - i0
                dots = torch.matmul(qb.reshape(b, nq * self.n_heads, -1), keys_f[:, :n_vis].transpose(1, 2))
                dots = F.relu_(dots).view(b, nq, self.n_heads, n_vis)
                scores = torch.matmul(w[:, i0:i1, None, :], dots).squeeze(-2)  # [B, Q, N]
                lim = limit[:, i0:i1, None]
                entry = torch.arange(n_vis, device=x.device)
                scores = scores.masked_fill_(entry >= lim, float("-inf"))
                idx = topk_lowest_index(scores, min(k, n_vis))
                out[:, i0:i1, : idx.shape[-1]] = torch.where(idx >= lim, torch.full_like(idx, -1), idx)
            i0 = i1
        return out


def joint_attention(
    q: torch.Tensor,
    win_keys: torch.Tensor,
    win_pos: torch.Tensor,
    floors: torch.Tensor,
    window: int,
    sinks: torch.Tensor,
    entries: torch.Tensor | None,
    entry_limit: torch.Tensor | None,
    selection: torch.Tensor | None,
) -> torch.Tensor:
    """One softmax over window keys, visible compressed entries and the sink.

    q: [B, S, H, D] rotated queries; query i (position p + i) reads window rows j in [i, i + W - 1].
    win_keys: [B, W-1+S, D] window keys; row j sits at position win_pos[b, j].
    floors: [B] first readable window position. sinks: [H] float32.
    entries: [B, N, D] compressed entries (or None); entry_limit: [B, S] visible count per query;
    selection: [B, S, k] selected entry ids (-1 = none) for sparse layers, None for dense layers.
    Returns [B, S, H, D]. Queries go in blocks of about one window, so each block reads at most
    2W - 1 window rows and the visible prefix of the entries.
    """
    b, s, h, d = q.shape
    w = window
    scale = d**-0.5
    out = torch.empty_like(q)
    key_ok = win_pos >= floors[:, None].clamp(min=0)  # [B, W-1+S]
    n_sel = 0 if selection is None else selection.shape[-1]
    step = min(s, max(w, 64))
    if selection is not None:
        step = max(1, min(step, _BLOCK_BUDGET // max(1, b * n_sel * d)))
    sink = sinks.float().view(1, 1, h)
    band_cache: dict[int, torch.Tensor] = {}
    for i0 in range(0, s, step):
        i1 = min(s, i0 + step)
        nq = i1 - i0
        kw = win_keys[:, i0 : i1 + w - 1]  # [B, L, D]
        length = kw.shape[1]
        if nq not in band_cache:
            qi = torch.arange(nq, device=q.device)[:, None]
            kj = torch.arange(length, device=q.device)[None, :]
            band_cache[nq] = (kj >= qi) & (kj <= qi + w - 1)  # [Q, L]
        mask_w = band_cache[nq][None] & key_ok[:, None, i0 : i0 + length]  # [B, Q, L]
        qb = q[:, i0:i1]  # [B, Q, H, D]
        lw = torch.matmul(qb.reshape(b, nq * h, d), kw.transpose(1, 2)).view(b, nq, h, length).float()
        lw = lw.mul_(scale).masked_fill_(~mask_w[:, :, None], float("-inf"))
        mx = torch.maximum(lw.amax(dim=-1), sink)  # [B, Q, H]
        lc = kc = None
        if entries is not None and entry_limit is not None:
            lim = entry_limit[:, i0:i1]
            if selection is None:
                n = int(lim.max().item())
                kc = entries[:, :n]
                vis = torch.arange(n, device=q.device)[None, None, :] < lim[..., None]  # [B, Q, N]
                lc = torch.matmul(qb.reshape(b, nq * h, d), kc.transpose(1, 2)).view(b, nq, h, n).float()
            else:
                sel = selection[:, i0:i1]
                vis = sel >= 0
                kc = entries.gather(1, sel.clamp(min=0).flatten(1)[..., None].expand(-1, -1, d))
                kc = kc.view(b * nq, -1, d)
                lc = torch.bmm(qb.reshape(b * nq, h, d), kc.transpose(1, 2)).view(b, nq, h, -1).float()
            lc = lc.mul_(scale).masked_fill_(~vis[:, :, None], float("-inf"))
            if lc.shape[-1]:
                mx = torch.maximum(mx, lc.amax(dim=-1))
        pw = torch.exp(lw - mx[..., None])
        den = pw.sum(dim=-1) + torch.exp(sink - mx)
        o = torch.matmul(pw.to(q.dtype).view(b, nq * h, length), kw).view(b, nq, h, d)
        if lc is not None and kc is not None and lc.shape[-1]:
            pc = torch.exp(lc - mx[..., None])
            den = den + pc.sum(dim=-1)
            if selection is None:
                o = o + torch.matmul(pc.to(q.dtype).view(b, nq * h, -1), kc).view(b, nq, h, d)
            else:
                o = o + torch.bmm(pc.to(q.dtype).view(b * nq, h, -1), kc).view(b, nq, h, d)
        out[:, i0:i1] = (o / den[..., None].to(q.dtype)).to(q.dtype)
    return out


class Attention(nn.Module):
    """One DeepSeek-V4 attention block (transformers' parameter names under `self_attn.`)."""

    def __init__(self, config: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.config = config
        self.layer = layer
        self.n_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.window = config.sliding_window
        self.ratio = config.compress_ratio(layer)
        self.rope_kind = "main" if self.ratio == 0 else "compress"
        hidden, d, h = config.hidden_size, config.head_dim, config.num_attention_heads
        self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, h * d, bias=False)
        self.kv_proj = nn.Linear(hidden, d, bias=False)
        self.kv_norm = RMSNorm(d, config.rms_norm_eps)
        self.o_groups = config.o_groups
        self.o_a_proj = nn.Linear(h * d // config.o_groups, config.o_groups * config.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(config.o_groups * config.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if self.ratio:
            self.compressor = Compressor(
                hidden, d, self.ratio, overlap=config.has_indexer(layer), eps=config.rms_norm_eps
            )
            if config.has_indexer(layer):
                self.indexer = Indexer(config, self.ratio)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RopeTables,
        cache: LayerCacheView,
        floors: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, S, hidden] (normed), positions [B, S] absolute -> [B, S, hidden]."""
        b, s, _ = x.shape
        h, d, w = self.n_heads, self.head_dim, self.window
        cos, sin = rope[self.rope_kind]
        start = positions[:, 0]

        q_res = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_res).view(b, s, h, d)
        q = unweighted_rms_norm(q, self.config.rms_norm_eps)
        q = apply_rope(q, cos[:, :, None], sin[:, :, None])

        kv = apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)  # [B, S, D]
        win_keys = torch.cat([ordered_ring(cache.window, start, w - 1).to(kv.dtype), kv], dim=1)
        win_pos = start[:, None] - (w - 1) + torch.arange(w - 1 + s, device=x.device)
        write_ring(cache.window, kv, start)

        entries = limit = selection = None
        if self.compressor is not None:
            assert cache.entries is not None
            latents, groups, valid = self.compressor.pool(x, positions, start, cache.carry)
            if latents.shape[1]:
                rotated = apply_rope(latents, *rope.at("compress", groups * self.ratio))
                scatter_entries(cache.entries, rotated, groups, valid)
            n = int(torch.div(start + s, self.ratio, rounding_mode="floor").max().item())
            entries = cache.entries[:, :n].to(q.dtype)
            limit = causal_entry_limit(positions, self.ratio)
            if self.indexer is not None:
                assert cache.index_keys is not None
                ilat, igroups, ivalid = self.indexer.key_compressor.pool(
                    x, positions, start, cache.index_carry
                )
                if ilat.shape[1]:
                    ikeys = apply_rope(ilat, *rope.at("compress", igroups * self.ratio))
                    scatter_entries(cache.index_keys, ikeys, igroups, ivalid)
                selection = self.indexer.select(x, q_res, cache.index_keys[:, :n], positions, cos, sin)

        o = joint_attention(q, win_keys, win_pos, floors, w, self.sinks, entries, limit, selection)
        o = apply_rope(o, cos[:, :, None], sin[:, :, None], inverse=True)
        g = self.o_groups
        grouped = o.reshape(b * s, g, -1)
        wa = self.o_a_proj.weight.view(g, -1, grouped.shape[-1])  # [G, o_lora, H*D/G]
        z = torch.einsum("ngi,goi->ngo", grouped, wa).reshape(b, s, -1)
        return self.o_b_proj(z)
