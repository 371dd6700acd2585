"""Cache views: what the model reads and writes during one forward, allocated by the caller.

The model owns no cache state. Each forward receives a :class:`CacheView` holding, per layer,
the window ring (slot = position % sliding_window), the compressed entries and index keys of
the layer's compressor, and the compressor's carry (raw projections of the last few positions,
enough to finish an open group). Everything is indexed by absolute positions, so the same view
serves one-shot prefill, chunked prefill and decode, for a batch of rows at different positions.

Region map of one row during a call that adds S tokens at position p:
    [0, p)        already processed: window entries for [p - W + 1, p) are in the ring,
                  compressed entries for complete groups g < p // r are in `entries`
    [p, p + S)    this call: written to the ring (last W of them) and, when a group completes,
                  to `entries` / `index_keys` at slot g

Not for: allocation, paging, persistence or accounting (see :mod:`replaykv.cache`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CompressorCarry:
    """Raw float32 projections of the last `ring` positions of one compressor (slot = position % ring).

    kv, gate: [B, ring, Dc]. The gate already includes the learned position bias. ring = 2r for
    overlapping (CSA) compressors and r otherwise; rows at negative positions are never read.
    """

    kv: torch.Tensor
    gate: torch.Tensor

    @property
    def ring(self) -> int:
        return int(self.kv.shape[1])


@dataclass
class LayerCacheView:
    """One layer's caches.

    window: [B, W, D] ring of this layer's window K=V entries.
    entries: [B, capacity, D] compressed entries of this layer's compressor (None for sliding-only).
    carry: the compressor's carry (None for sliding-only).
    index_keys: [B, capacity, Di] indexer keys (None without an indexer).
    index_carry: the indexer compressor's carry (DeepSeek-V4 indexers own a compressor).
    """

    window: torch.Tensor
    entries: torch.Tensor | None = None
    carry: CompressorCarry | None = None
    index_keys: torch.Tensor | None = None
    index_carry: CompressorCarry | None = None


@dataclass
class CacheView:
    """Per-forward view of all caches of a batch of rows.

    positions: [B] long, the absolute position of each row's first new token (= tokens already
    processed). window_floor: [B] long, the first position any window may read (0 = no floor).
    The model reads and writes the tensors in `layers` in place; it never changes `positions` —
    the caller advances them after the call.
    """

    positions: torch.Tensor
    layers: list[LayerCacheView]
    window_floor: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.positions.shape[0])

    def floors(self) -> torch.Tensor:
        if self.window_floor is None:
            return torch.zeros_like(self.positions)
        return self.window_floor
