"""Allocation of per-request cache views from a :class:`ModelSpec`.

`allocate_view(spec, batch, max_tokens)` builds a :class:`CacheView` whose tensors the caller
owns; `advance(view, n)` moves the rows' positions after a forward. Not for: sharing pages
between requests or persistence (later ledgers build on these tensors).
"""

from __future__ import annotations

import torch

from replaykv.model.cache_view import CacheView, CompressorCarry, LayerCacheView
from replaykv.model.spec import ModelSpec


def allocate_view(
    spec: ModelSpec,
    batch: int,
    max_tokens: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> CacheView:
    """Zero-filled caches for `batch` rows of up to `max_tokens` tokens each."""
    dev = torch.device(device)
    layers: list[LayerCacheView] = []
    for ls in spec.layers:
        view = LayerCacheView(window=torch.zeros(batch, ls.window, ls.head_dim, device=dev, dtype=dtype))
        if ls.ratio and not ls.owns_compressor:
            # Reuse / Reindex layers read their source's entries and index keys: same tensors.
            src = layers[ls.source]
            view.entries, view.index_keys = src.entries, src.index_keys
        elif ls.ratio:
            cap = max(1, ls.entries_for(max_tokens))
            view.entries = torch.zeros(batch, cap, ls.head_dim, device=dev, dtype=dtype)
            if ls.carry_ring:
                view.carry = CompressorCarry(
                    torch.zeros(batch, ls.carry_ring, ls.carry_width, device=dev),
                    torch.zeros(batch, ls.carry_ring, ls.carry_width, device=dev),
                )
            if ls.index_dim:
                view.index_keys = torch.zeros(batch, cap, ls.index_dim, device=dev, dtype=dtype)
            if ls.index_carry_ring:
                view.index_carry = CompressorCarry(
                    torch.zeros(batch, ls.index_carry_ring, ls.index_carry_width, device=dev),
                    torch.zeros(batch, ls.index_carry_ring, ls.index_carry_width, device=dev),
                )
        layers.append(view)
    return CacheView(positions=torch.zeros(batch, dtype=torch.long, device=dev), layers=layers)


def advance(view: CacheView, n: int | torch.Tensor) -> None:
    """Move every row's position forward by n tokens (after a forward of n tokens)."""
    view.positions += n
