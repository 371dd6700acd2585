"""Context parallelism for training: a sequence split into CP contiguous shards, one per process.

Shard c holds positions [c·S, (c+1)·S) of every row and runs every layer on them. What a layer
needs from earlier positions comes from the other shards, through torch.distributed:

* **The window.** A layer's window reaches W - 1 positions back: before attending, each shard
  sends its last W - 1 window K=V rows to the next shard and receives the previous shard's
  (:meth:`ContextShards.halo`; shard 0 receives nothing, those positions are masked). The
  gradient of the received rows goes back the same way.
* **The global KV.** A KV source pools only its shard's groups (S is a multiple of every
  ratio), then the shards exchange their groups' FP4 entries and index keys, so every shard's
  group caches hold the whole sequence (:meth:`ContextShards.share`); the indexers then select
  over every visible entry as in one process. The gradient of each shard's groups is summed
  over the shards that read them.
* Everything else (mHC, the experts, the selection of a shard's own queries) is per token.

The model calls these through `Step.context`; it owns no communication. Not for: splitting the
batch or the loss (see :mod:`replaykv.train.pipeline`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from replaykv.model.cache_view import LayerCacheView


class ContextShards:
    """This process's shard `index` of `size`, exchanging over `group` (global ranks `ranks`)."""

    def __init__(self, index: int, size: int, group: Any, ranks: list[int]) -> None:
        self.index, self.size, self.group, self.ranks = index, size, group, ranks

    def halo(self, kv: torch.Tensor, rows: int) -> torch.Tensor:
        """The previous shard's last `rows` rows of `kv` [B, S, D] (zeros on shard 0)."""
        out: torch.Tensor = _Halo.apply(kv, rows, self)
        return out

    def share(
        self, cache: LayerCacheView, ratio: int, step: Any, names: tuple[str, ...] = ("entries", "index_keys")
    ) -> None:
        """Fill the group caches (entries, index keys) with every shard's groups."""
        n = step.seq // ratio
        lo = step.start_host[0] // ratio
        for name in names:
            store = getattr(cache, name)
            if store is None:
                continue
            pieces = _AllGather.apply(store[:, lo : lo + n], self)
            for j, piece in enumerate(pieces):
                if j != self.index:
                    store[:, j * n : (j + 1) * n] = piece.to(store.dtype)


def _p2p(pairs: list[tuple[Any, torch.Tensor, int]], group: Any) -> None:
    ops = [dist.P2POp(op, t, peer, group) for op, t, peer in pairs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, kv: torch.Tensor, rows: int, shards: ContextShards) -> torch.Tensor:
        b, _, d = kv.shape
        out = kv.new_zeros(b, rows, d)
        pairs: list[tuple[Any, torch.Tensor, int]] = []
        if shards.index + 1 < shards.size:
            pairs.append((dist.isend, kv[:, -rows:].contiguous(), shards.ranks[shards.index + 1]))
        if shards.index > 0:
            pairs.append((dist.irecv, out, shards.ranks[shards.index - 1]))
        _p2p(pairs, shards.group)
        ctx.shards, ctx.rows, ctx.shape = shards, rows, kv.shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        shards, rows = ctx.shards, ctx.rows
        b, s, d = ctx.shape
        tail = grad.new_zeros(b, rows, d)
        pairs: list[tuple[Any, torch.Tensor, int]] = []
        if shards.index > 0:
            pairs.append((dist.isend, grad.contiguous(), shards.ranks[shards.index - 1]))
        if shards.index + 1 < shards.size:
            pairs.append((dist.irecv, tail, shards.ranks[shards.index + 1]))
        _p2p(pairs, shards.group)
        out = grad.new_zeros(b, s, d)
        out[:, s - rows :] = tail
        return out, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, piece: torch.Tensor, shards: ContextShards) -> tuple[torch.Tensor, ...]:
        piece = piece.contiguous()
        pieces = [torch.empty_like(piece) for _ in range(shards.size)]
        dist.all_gather(pieces, piece, group=shards.group)
        ctx.shards = shards
        return tuple(pieces)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        shards = ctx.shards
        stacked = torch.stack([g.contiguous() for g in grads])
        dist.all_reduce(stacked, group=shards.group)  # each shard's piece: the sum of its readers'
        return stacked[shards.index], None
