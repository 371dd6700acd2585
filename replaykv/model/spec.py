"""ModelSpec: the model's own description of its caches, read by the cache and replay code.

Which layers keep a window (all of them), which own a compressor (KV sources) and at which
ratio, which layers read which source's entries, the widths of entries, index keys and
compressor carry, and where the decoder starts. The cache code allocates from this and never
looks at the model's internals; DeepSeek-V4 and V4.1 differ only here.
Not for: the math (see :mod:`replaykv.model`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replaykv.model.config import DeepseekV4Config
    from replaykv.model.config_v41 import DeepseekV41Config


@dataclass(frozen=True)
class LayerSpec:
    """Caches of one layer.

    ratio 0 = window only. `source` is the layer whose compressed entries (and index keys) this
    layer reads: itself for a KV source, an earlier layer for DeepSeek-V4.1's Reuse / Reindex
    layers, -1 for window-only layers. Only sources (`owns_compressor`) own carry and entries.
    Carry widths are float32 channels per row.
    """

    window: int
    head_dim: int
    ratio: int = 0
    source: int = -1
    owns_compressor: bool = False
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
    """The cache description of a whole model.

    `kind` is "v4" or "v41". `decoder_cut` is the last layer that every prefill row runs
    under decoder replay (V4.1: max(kv_source_layer_ids)); None when the model has no
    causal encoder–decoder split (V4).
    """

    kind: str
    layers: tuple[LayerSpec, ...]
    sliding_window: int
    max_position_embeddings: int
    decoder_cut: int | None = None
    index_topk: int = 0

    @property
    def sources(self) -> tuple[int, ...]:
        return tuple(i for i, ls in enumerate(self.layers) if ls.owns_compressor)

    @property
    def ratios(self) -> tuple[int, ...]:
        return tuple(ls.ratio for ls in self.layers)

    @property
    def group_alignment(self) -> int:
        """Positions that end a group of every source: the least common multiple of the ratios."""
        from math import lcm

        return lcm(*[max(1, self.layers[s].ratio) for s in self.sources]) if self.sources else 1

    @classmethod
    def from_config(cls, config: DeepseekV4Config | DeepseekV41Config) -> ModelSpec:
        from replaykv.model.config_v41 import DeepseekV41Config

        if isinstance(config, DeepseekV41Config):
            return cls._from_v41(config)
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
                    source=i,
                    owns_compressor=True,
                    carry_ring=ring,
                    carry_width=width,
                    index_dim=config.index_head_dim if overlap else 0,
                    index_carry_ring=ring if overlap else 0,
                    index_carry_width=2 * config.index_head_dim if overlap else 0,
                )
            )
        return cls(
            "v4",
            tuple(layers),
            config.sliding_window,
            config.max_position_embeddings,
            None,
            config.index_topk,
        )

    @classmethod
    def _from_v41(cls, config: DeepseekV41Config) -> ModelSpec:
        layers = []
        for i in range(config.num_hidden_layers):
            r = config.compress_ratio(i)
            src = config.kv_source_of(i)
            if r == 0 or src is None:
                layers.append(LayerSpec(config.sliding_window, config.head_dim))
                continue
            owns = src == i
            layers.append(
                LayerSpec(
                    window=config.sliding_window,
                    head_dim=config.head_dim,
                    ratio=r,
                    source=src,
                    owns_compressor=owns,
                    carry_ring=r if owns and r > 1 else 0,
                    carry_width=config.head_dim if owns and r > 1 else 0,
                    index_dim=config.index_head_dim,
                )
            )
        return cls(
            "v41",
            tuple(layers),
            config.sliding_window,
            config.max_position_embeddings,
            config.decoder_cut,
            config.index_topk,
        )
