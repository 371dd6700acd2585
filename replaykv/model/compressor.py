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
from torch import nn

from replaykv.model.cache_view import CompressorCarry
from replaykv.model.layers import Linear, RMSNorm, cast, linear, linears, native_weight
from replaykv.model.step import Step


def ordered_ring(ring: torch.Tensor, start: torch.Tensor, count: int) -> torch.Tensor:
    """Rows of a ring (slot = pos % R) for positions [p - count, p), in order.

    ring: [B, R, C]; start: [B] (p per row) -> [B, count, C]. Slots of negative positions hold
    whatever the ring has there; callers never read them as valid.
    """
    if count == 0:
        return ring[:, :0]
    slots = (start[:, None] + torch.arange(-count, 0, device=ring.device)).remainder(ring.shape[1])
    return ring.gather(1, slots[..., None].expand(-1, -1, ring.shape[-1]))


def write_ring(ring: torch.Tensor, ext: torch.Tensor, ext_start: torch.Tensor) -> None:
    """Write the last min(R, L) rows of ext (row j is position ext_start + j) into the ring.

    ring: [B, R, C]; ext: [B, L, C]; ext_start: [B]. The rows written cover consecutive
    positions, so their slots are distinct.
    """
    r, length = ring.shape[1], ext.shape[1]
    n = min(r, length)
    if n == 0:
        return
    slots = (ext_start[:, None] + torch.arange(length - n, length, device=ring.device)).remainder(r)
    ring.scatter_(1, slots[..., None].expand(-1, -1, ring.shape[-1]), cast(ext[:, length - n :], ring.dtype))


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
        self.kv_proj = Linear(hidden, width)
        self.gate_proj: Linear | None = Linear(hidden, width) if gate else None
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
        xf = cast(x, torch.float32)
        if self.gate_proj is None:
            w = cast(self.kv_proj.weight, torch.float32)
            return linear(xf, w, native_weight(self.kv_proj, w)), None
        kv, gate = linears(xf, self, self.kv_proj.weight, self.gate_proj.weight, dtype=torch.float32)
        if self.position_bias is not None:
            gate = gate + self.position_bias[positions.remainder(self.ratio)]
        return kv, gate

    def pool(
        self, x: torch.Tensor, step: Step, carry: CompressorCarry | None
    ) -> tuple[torch.Tensor, list[int], list[int]]:
        """Entries of the groups that complete in this call, before RoPE.

        x: [B, S, hidden]. Returns (latents [B, G, out_dim] float32 after kv_norm, first group
        per row, groups completed per row); G is the most groups any row completes. Row b's
        latents [0, count[b]) are groups first[b] + [0, count[b]). Updates the carry in place.
        """
        b = x.shape[0]
        r = self.ratio
        kv, gate = self.project(x, step.positions)
        ring = self.ring if r > 1 or self.overlap else 0
        if carry is not None and ring > 0 and step.seq == 1:
            return self._pool_one(kv, gate, step, carry)
        if carry is not None and ring > 0:
            ext_start = step.start - ring
            ext_kv = torch.cat([ordered_ring(carry.kv, step.start, ring), kv], dim=1)
            ext_gate = None
            if gate is not None:
                ext_gate = torch.cat([ordered_ring(carry.gate, step.start, ring), gate], dim=1)
        else:
            ext_kv, ext_gate, ext_start = kv, gate, step.start
        first, count = step.groups(r)
        g_max = max(count) if count else 0
        if g_max > 0:
            groups = torch.tensor(first, device=x.device)[:, None] + torch.arange(g_max, device=x.device)
            latents = self.kv_norm(self._pool_groups(ext_kv, ext_gate, ext_start, groups, first))
        else:
            latents = kv.new_zeros(b, 0, self.out_dim)
        if carry is not None and ring > 0:
            write_ring(carry.kv, ext_kv, ext_start)
            if ext_gate is not None:
                write_ring(carry.gate, ext_gate, ext_start)
        return latents, first, count

    def _pool_one(
        self, kv: torch.Tensor, gate: torch.Tensor | None, step: Step, carry: CompressorCarry
    ) -> tuple[torch.Tensor, list[int], list[int]]:
        """Decode: put the new row in the carry; pool only when a group completes."""
        b, ring = kv.shape[0], carry.ring
        rows = torch.arange(b, device=kv.device)
        slots = step.start.remainder(ring)
        carry.kv[rows, slots] = kv[:, 0]
        if gate is not None:
            carry.gate[rows, slots] = gate[:, 0]
        first, count = step.groups(self.ratio)
        if max(count) == 0:
            return kv.new_zeros(b, 0, self.out_dim), first, count
        end = step.start + 1  # the ring now holds positions [end - ring, end)
        ext_kv = ordered_ring(carry.kv, end, ring)
        ext_gate = None if gate is None else ordered_ring(carry.gate, end, ring)
        groups = torch.tensor(first, device=kv.device)[:, None]
        latents = self.kv_norm(self._pool_groups(ext_kv, ext_gate, end - ring, groups, first))
        return latents, first, count

    def _pool_groups(
        self,
        ext_kv: torch.Tensor,
        ext_gate: torch.Tensor | None,
        ext_start: torch.Tensor,
        groups: torch.Tensor,
        first: list[int],
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
        if min(first) == 0:  # group 0 has no predecessor: its "Ca" half gets no weight
            first_group = (groups == 0)[..., None, None] & (torch.arange(2 * r, device=kv.device) < r)[
                :, None
            ]
            kv = kv.masked_fill(first_group, 0.0)
            gate = gate.masked_fill(first_group, float("-inf"))
        return (kv * gate.softmax(dim=2)).sum(dim=2)


def scatter_entries(store: torch.Tensor, values: torch.Tensor, first: list[int], count: list[int]) -> None:
    """store[b, first[b] + k] = values[b, k] for k < count[b]. store: [B, cap, D]."""
    cap = store.shape[1]
    for row, (g0, n) in enumerate(zip(first, count, strict=True)):
        if n == 0:
            continue
        if g0 + n > cap:
            raise ValueError(
                f"compressed-entry capacity {cap} exceeded; allocate the cache for a longer context"
            )
        store[row, g0 : g0 + n] = values[row, :n].to(store.dtype)


def causal_entry_limit(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Number of entries a query at absolute position t may see: (t + 1) // r."""
    return torch.div(positions + 1, ratio, rounding_mode="floor")


def _nudged(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Scores widened to float64 and nudged down by a relative index * 2^-50 (zeros by
    index * 2^-1000, infinities kept): equal scores order by index, and distinct float32 values
    keep their order (they differ by at least 2^-24 relative; the nudge stays below 2^-30 for
    N < 2^20)."""
    s64, i64 = scores.double(), index.double()
    nudged = torch.where(s64 == 0, -i64 * 2.0**-1000, s64 - s64.abs() * (i64 * 2.0**-50))
    return torch.where(torch.isinf(s64), s64, nudged)  # inf * 0 would be NaN


def topk_lowest_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last axis, ties broken by the lower index, in
    that order (score descending, then index ascending; NaN ranks above every number). With
    k >= N every index, in that order.

    scores: [..., N] float32 (or narrower); returns [..., k] long. One top-(k+1) pass finds a
    row's k-th best score t. When the next score is strictly below t the k found are the set;
    on a tie across the edge of the set it is every score above t and the lowest-indexed of
    those equal to t; a row holding NaN is ranked whole. The k chosen are ordered by `_nudged`,
    and so are all N when k >= N.
    """
    n = scores.shape[-1]
    if k == 0:
        return torch.topk(scores, 0, dim=-1).indices
    if k >= n:  # every index, in the same rank order as below (the order attention sums in)
        every = torch.arange(n, device=scores.device).expand(scores.shape)
        return every.gather(-1, _nudged(scores, every).argsort(dim=-1, descending=True, stable=True))
    vals, idx = torch.topk(scores, k + 1, dim=-1)
    nan = torch.isnan(vals[..., 0]).reshape(-1)  # top-k ranks NaN first
    tied = ~(vals[..., k - 1] > vals[..., k]).reshape(-1) & ~nan
    vals, idx = vals[..., :k].contiguous(), idx[..., :k].contiguous()
    if bool((tied | nan).any()):
        rows, v, i = scores.reshape(-1, n), vals.view(-1, k), idx.view(-1, k)
        at = tied.nonzero().squeeze(1)
        sub, edge = rows[at], v[at, k - 1 :]
        above, level = sub > edge, sub == edge
        room = k - above.sum(-1, keepdim=True)  # how many of the tied fit, lowest index first
        i[at] = (above | (level & (level.cumsum(-1) <= room))).nonzero()[:, 1].view(-1, k)
        v[at] = sub.gather(-1, i[at])
        at = nan.nonzero().squeeze(1)
        whole = torch.arange(n, device=scores.device).expand(len(at), n)
        i[at] = torch.topk(_nudged(rows[at], whole), k, dim=-1).indices
        v[at] = rows[at].gather(-1, i[at])
    return idx.gather(-1, _nudged(vals, idx).argsort(dim=-1, descending=True))
