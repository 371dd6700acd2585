"""KV compressors and the lightning indexer of the DeepSeek-V4 family.

A compressor pools the raw projections of r consecutive tokens (group g = positions
[g·r, g·r + r)) into one entry with a channelwise softmax over learned gates. Overlapping
compressors (DeepSeek-V4 CSA) pool 2r slots: the first projection half ("Ca") of group g−1 and
the second half ("Cb") of group g. Everything is addressed by absolute positions, so a group
may complete in any call; the carry holds the raw rows it still needs.

Not for: attention over the entries (see :mod:`replaykv.model.attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replaykv.model.cache_view import CompressorCarry
from replaykv.model.layers import RMSNorm


def ordered_ring(ring: torch.Tensor, positions: torch.Tensor, count: int) -> torch.Tensor:
    """Rows of a ring (slot = pos % R) for positions [p - count, p), in order.

    ring: [B, R, C]; positions: [B] (p per row) -> [B, count, C].
    """
    if count == 0:
        return ring[:, :0]
    r = ring.shape[1]
    pos = positions[:, None] - count + torch.arange(count, device=ring.device)
    slots = pos.remainder(r)
    return ring.gather(1, slots[..., None].expand(-1, -1, ring.shape[-1]))


def write_ring(
    ring: torch.Tensor, ext: torch.Tensor, ext_start: torch.Tensor, keep: torch.Tensor | None = None
) -> None:
    """Write the last min(R, L) rows of ext (row j is position ext_start + j) into the ring.

    ring: [B, R, C]; ext: [B, L, C]; ext_start: [B]. Rows whose position is negative are skipped.
    `keep` ([B] bool) limits the write to some rows of the batch.
    """
    r, length = ring.shape[1], ext.shape[1]
    n = min(r, length)
    if n == 0:
        return
    j = torch.arange(length - n, length, device=ring.device)
    pos = ext_start[:, None] + j  # [B, n]
    ok = pos >= 0
    if keep is not None:
        ok &= keep[:, None]
    b_idx = torch.arange(ring.shape[0], device=ring.device)[:, None].expand_as(pos)
    ring[b_idx[ok], pos.remainder(r)[ok]] = ext[:, length - n :][ok].to(ring.dtype)


class Compressor(nn.Module):
    """Gated channelwise softmax pooling of r tokens into one `out_dim` entry, then RMSNorm.

    Parameters (transformers names): kv_proj, gate_proj [c·out_dim, hidden] with c = 2 when
    overlapping, position_bias [r, c·out_dim] (when `position_bias`), kv_norm [out_dim].
    Ratio 1 without a gate is a plain projection (DeepSeek-V4.1's decoder source).
    """

    def __init__(
        self,
        hidden: int,
        out_dim: int,
        ratio: int,
        overlap: bool,
        eps: float,
        gate: bool = True,
        position_bias: bool = True,
    ) -> None:
        super().__init__()
        self.ratio = ratio
        self.overlap = overlap
        self.out_dim = out_dim
        width = (2 if overlap else 1) * out_dim
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj: nn.Linear | None = nn.Linear(hidden, width, bias=False) if gate else None
        self.position_bias: nn.Parameter | None = (
            nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32)) if position_bias else None
        )
        self.kv_norm = RMSNorm(out_dim, eps)

    @property
    def ring(self) -> int:
        """Rows of carry needed between calls."""
        return (2 if self.overlap else 1) * self.ratio

    @property
    def proj_width(self) -> int:
        return (2 if self.overlap else 1) * self.out_dim

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, S, hidden], positions [B, S] -> float32 (kv, gate + position bias) [B, S, width]."""
        kv = F.linear(x.float(), self.kv_proj.weight.float())
        if self.gate_proj is None:
            return kv, None
        gate = F.linear(x.float(), self.gate_proj.weight.float())
        if self.position_bias is not None:
            gate = gate + self.position_bias.float()[positions.remainder(self.ratio)]
        return kv, gate

    def pool(
        self, x: torch.Tensor, positions: torch.Tensor, start: torch.Tensor, carry: CompressorCarry | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Entries of the groups that complete in this call, before RoPE.

        x: [B, S, hidden]; positions: [B, S] absolute; start: [B] (= positions[:, 0]).
        Returns (latents [B, G, out_dim] float32 after kv_norm, group index [B, G], valid [B, G]);
        G is the largest number of groups completed by any row. Updates the carry in place.
        """
        b, s, _ = x.shape
        r = self.ratio
        kv, gate = self.project(x, positions)
        ring = self.ring if r > 1 or self.overlap else 0
        if carry is not None and ring > 0:
            ext_kv = torch.cat([ordered_ring(carry.kv, start, ring), kv], dim=1)
            ext_gate = (
                torch.cat([ordered_ring(carry.gate, start, ring), gate], dim=1) if gate is not None else None
            )
            ext_start = start - ring
        else:
            ext_kv, ext_gate, ext_start = kv, gate, start
        first = torch.div(start, r, rounding_mode="floor")
        n_groups = torch.div(start + s, r, rounding_mode="floor") - first
        g_max = int(n_groups.max().item()) if b else 0
        if g_max > 0:
            k = torch.arange(g_max, device=x.device)
            groups = first[:, None] + k  # [B, G]
            valid = k[None, :] < n_groups[:, None]
            latents = self._pool_groups(ext_kv, ext_gate, ext_start, groups)
        else:
            groups = torch.zeros(b, 0, dtype=torch.long, device=x.device)
            valid = torch.zeros(b, 0, dtype=torch.bool, device=x.device)
            latents = kv.new_zeros(b, 0, self.out_dim)
        if carry is not None and ring > 0:
            write_ring(carry.kv, ext_kv, ext_start)
            if ext_gate is not None:
                write_ring(carry.gate, ext_gate, ext_start)
        return self.kv_norm(latents), groups, valid

    def _pool_groups(
        self,
        ext_kv: torch.Tensor,
        ext_gate: torch.Tensor | None,
        ext_start: torch.Tensor,
        groups: torch.Tensor,
    ) -> torch.Tensor:
        r, d = self.ratio, self.out_dim
        length = ext_kv.shape[1]
        offs = torch.arange(r, device=ext_kv.device)
        cur = groups[..., None] * r + offs - ext_start[:, None, None]  # [B, G, r] ext rows of group g
        cur = cur.clamp(0, length - 1)

        def take(t: torch.Tensor, idx: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
            flat = idx.flatten(1)
            out = t.gather(1, flat[..., None].expand(-1, -1, t.shape[-1]))[..., lo:hi]
            return out.view(*idx.shape, hi - lo)

        if not self.overlap:
            kv = take(ext_kv, cur, 0, d)  # [B, G, r, D]
            if ext_gate is None:
                return kv.squeeze(2) if r == 1 else kv.mean(dim=2)
            gate = take(ext_gate, cur, 0, d)
            return (kv * gate.softmax(dim=2)).sum(dim=2)
        assert ext_gate is not None
        prev = (cur - r).clamp(0, length - 1)
        kv = torch.cat([take(ext_kv, prev, 0, d), take(ext_kv, cur, d, 2 * d)], dim=2)  # [B, G, 2r, D]
        gate = torch.cat([take(ext_gate, prev, 0, d), take(ext_gate, cur, d, 2 * d)], dim=2)
        first_group = (groups == 0)[..., None, None] & (torch.arange(2 * r, device=kv.device) < r)[:, None]
        kv = kv.masked_fill(first_group, 0.0)
        gate = gate.masked_fill(first_group, float("-inf"))
        return (kv * gate.softmax(dim=2)).sum(dim=2)


def scatter_entries(
    store: torch.Tensor, values: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor
) -> None:
    """store[b, groups[b, k]] = values[b, k] where valid. store: [B, cap, D]."""
    if values.shape[1] == 0:
        return
    cap = store.shape[1]
    if bool((groups[valid] >= cap).any()):
        raise ValueError(f"compressed-entry capacity {cap} exceeded; allocate the cache for a longer context")
    b_idx = torch.arange(store.shape[0], device=store.device)[:, None].expand_as(groups)
    store[b_idx[valid], groups[valid]] = values[valid].to(store.dtype)


def causal_entry_limit(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Number of entries a query at absolute position t may see: (t + 1) // r."""
    return torch.div(positions + 1, ratio, rounding_mode="floor")


def topk_lowest_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last axis, ties broken by the lower index.

    scores: [..., N] float; returns [..., k] long. Uses topk and repairs only rows with a tie
    at the cut-off, where a stable sort decides.
    """
    top = torch.topk(scores, k, dim=-1)
    if k == 0 or k == scores.shape[-1]:
        return top.indices
    thr = top.values[..., -1:]
    n_eq = (scores == thr).sum(-1)
    n_gt = (scores > thr).sum(-1)
    tied = (n_gt + n_eq > k) & torch.isfinite(thr.squeeze(-1))
    if bool(tied.any()):
        rows = scores[tied]
        order = torch.sort(rows, dim=-1, descending=True, stable=True).indices[..., :k]
        indices = top.indices.clone()
        indices[tied] = order
        return indices
    return top.indices
