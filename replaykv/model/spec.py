"""ModelSpec: the model's own description of its caches, read by the cache and replay code.

Which layers keep a window (all of them), which compress and at which ratio, the width of
entries, index keys and compressor carry. The cache code allocates from this and never looks
at the model's internals. Not for: the math (see :mod:`replaykv.model`).
"""

from __future__ import annotations

from dataclasses import dataclass

from replaykv.model.config import DeepseekV4Config


@dataclass(frozen=True)
class LayerSpec:
    """Caches of one layer. ratio 0 = window only. Carry widths are float32 channels per row."""

    window: int
    head_dim: int
    ratio: int = 0
    carry_ring: int = 0
    carry_width: int = 0
    index_dim: int = 0
    index_carry_ring: int = 0
    index_carry_width: int = 0

    def entries_for(self, tokens: int) -> int:
        """Compressed entries after `tokens` tokens."""
        return tokens // self.ratio if self.ratio else 0


@dataclass(frozen=True)
class ModelSpec:
    """The cache description of a whole model."""

    layers: tuple[LayerSpec, ...]
    sliding_window: int
    max_position_embeddings: int

    @classmethod
    def from_config(cls, config: DeepseekV4Config) -> ModelSpec:
        layers = []
        for i in range(config.num_hidden_layers):
            r = config.compress_ratio(i)
            if r == 0:
                layers.append(LayerSpec(config.sliding_window, config.head_dim))
                continue
            overlap = config.has_indexer(i)
            ring = (2 if overlap else 1) * r
            width = (2 if overlap else 1) * config.head_dim
            layers.append(
                LayerSpec(
                    window=config.sliding_window,
                    head_dim=config.head_dim,
                    ratio=r,
                    carry_ring=ring,
                    carry_width=width,
                    index_dim=config.index_head_dim if overlap else 0,
                    index_carry_ring=ring if overlap else 0,
                    index_carry_width=2 * config.index_head_dim if overlap else 0,
                )
            )
        return cls(tuple(layers), config.sliding_window, config.max_position_embeddings)
