"""Indexer training: the lightning indexers learn from the main attention's distribution
(DeepSeek-V3.2's DSA), since the language-model loss cannot reach them through a discrete top-k.

Not for: the language-model losses (see :mod:`replaykv.train.paths`).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from replaykv.model.cache_view import LayerCacheView
from replaykv.model.compressor import causal_entry_limit
from replaykv.model.quant import mxfp4_index_fake_quant
from replaykv.model.rope import apply_rope
from replaykv.model.step import Step


class IndexerDistillation:
    """Trains the lightning indexers, which the language-model loss cannot reach (their top-k is
    discrete), as DeepSeek-V3.2's DSA does: on `rows` query rows per call, the KL divergence from
    the layer's main attention distribution over all visible compressed entries (softmax per
    head, averaged over heads; no gradient) to the softmax of the indexer's scores.

    Installed on a model it (1) runs every index layer's `select` without autograd (indices only),
    (2) computes index keys from detached latents, so the KL reaches only the indexer's own
    weights, and (3) adds a forward hook on each index layer that records the KL when autograd
    is on. `pop()` returns the sum since the last call. `remove()` restores the model.
    """

    def __init__(self, model: Any, rows: int) -> None:
        self.rows = rows
        self._losses: list[torch.Tensor] = []
        self._undo: list[Callable[[], None]] = []
        for layer in model.model.layers:
            attn = getattr(layer, "self_attn", None)  # None: a layer another pipeline stage holds
            idx = getattr(attn, "indexer", None)
            if attn is None or idx is None:
                continue
            select, keys = idx.select, idx.keys

            def no_grad_select(self: Any, *args: Any, _select: Any = select) -> None:
                with torch.no_grad():
                    _select(*args)

            def detached_keys(
                self: Any, latents: torch.Tensor, *args: Any, _keys: Any = keys
            ) -> torch.Tensor:
                return _keys(latents.detach(), *args)

            idx.select = types.MethodType(no_grad_select, idx)
            idx.keys = types.MethodType(detached_keys, idx)
            self._undo.append(_restorer(idx, attn.register_forward_hook(self._hook)))

    def remove(self) -> None:
        """Restore the model's own methods and drop the hooks."""
        for undo in self._undo:
            undo()
        self._undo.clear()

    def pop(self) -> torch.Tensor | None:
        if not self._losses:
            return None
        total = torch.stack(self._losses).sum()
        self._losses.clear()
        return total

    def _hook(self, attn: Any, args: tuple[Any, ...], output: torch.Tensor) -> None:
        if not torch.is_grad_enabled() or self.rows <= 0:
            return
        x, step, cache = args[0], args[1], args[2]
        kl = self._kl(attn, x, step, cache)
        if kl is not None:
            self._losses.append(kl)

    def _kl(self, attn: Any, x: torch.Tensor, step: Step, cache: LayerCacheView) -> torch.Tensor | None:
        assert cache.entries is not None and cache.index_keys is not None
        b, s, _ = x.shape
        n = max((p + s) // attn.ratio for p in step.start_host)
        if n < 2:
            return None
        rows = torch.unique(torch.linspace(0, s - 1, min(self.rows, s), device=x.device).round().long())
        denominator = None
        if step.context is not None:
            # A shard of a longer sequence: the rows one process would sample from the whole
            # sequence, those in this shard, over the whole sample's count (the shards' KLs sum
            # to one process's).
            total, start = step.context.size * s, step.start_host[0]
            every = torch.unique(
                torch.linspace(0, total - 1, min(self.rows, total), device=x.device).round().long()
            )
            denominator = b * int(((every + 1) // attn.ratio >= 2).sum())
            rows = every[(every >= start) & (every < start + s)] - start
            if rows.numel() == 0:
                return None
        limit = causal_entry_limit(step.positions[:, rows], attn.ratio)  # [B, R]
        visible = torch.arange(n, device=x.device) < limit[..., None]  # [B, R, N]
        valid = limit >= 2
        if not bool(valid.any()):
            return None
        idx = attn.indexer
        xr = x.detach()[:, rows]
        r = xr.shape[1]
        with torch.no_grad():
            q_res, q = attn.queries(xr, *(t[:, rows] for t in step.rope.heads(attn.rope_kind)))
            q = q.float()
            entries = cache.entries[:, :n].detach().float()
            logits = torch.einsum("brhd,bnd->brhn", q, entries) * attn.head_dim**-0.5
            logits = logits.masked_fill(~visible[:, :, None], float("-inf"))
            target = torch.softmax(logits, dim=-1).mean(dim=2).nan_to_num(0.0)  # [B, R, N]
        cos_c, sin_c = (t[:, rows] for t in step.rope.heads("compress"))
        qi = idx.q_b_proj(q_res).view(b, r, idx.n_heads, idx.head_dim)
        qi = mxfp4_index_fake_quant(apply_rope(qi, cos_c, sin_c), enabled=idx.quant).float()
        w = idx.weights_proj(xr).float() * idx.n_heads**-0.5  # [B, R, Hi]
        dots = F.relu(torch.einsum("brhd,bnd->brhn", qi, cache.index_keys[:, :n].float()))
        scores = (dots * idx.head_dim**-0.5 * w[..., None]).sum(dim=2)  # [B, R, N]
        log_q = torch.log_softmax(scores.masked_fill(~visible, -1e9), dim=-1)
        kl = F.kl_div(log_q, target, reduction="none").sum(-1)  # [B, R]
        return (kl * valid).sum() / (valid.sum() if denominator is None else denominator)


def _restorer(indexer: Any, handle: Any) -> Callable[[], None]:
    def undo() -> None:
        del indexer.select, indexer.keys  # the instance attributes: the class methods show again
        handle.remove()

    return undo
