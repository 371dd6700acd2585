"""What every layer of one forward needs to know about the rows it runs: positions and RoPE.

Built once per forward from the cache view. Host-side copies of the start positions let layers
size their work without a device synchronisation per layer. Not for: cache tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import torch

from replaykv.model.rope import rope_table


@dataclass
class RopeTables:
    """RoPE of one call: inverse frequencies per flavour ('main', 'compress') and the tables of
    the call's rows ([B, S, rope_dim] each)."""

    freqs: dict[str, torch.Tensor]
    rows: dict[str, tuple[torch.Tensor, torch.Tensor]]
    per_head: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def build(cls, freqs: dict[str, torch.Tensor], positions: torch.Tensor) -> RopeTables:
        rows = {kind: rope_table(f, positions) for kind, f in freqs.items()}
        per_head = {kind: (c[:, :, None], s[:, :, None]) for kind, (c, s) in rows.items()}
        return cls(freqs, rows, per_head)

    def __getitem__(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows[kind]

    def heads(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables with a head axis: [B, S, 1, rope_dim]."""
        return self.per_head[kind]

    def at(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables at arbitrary positions [...] -> [..., rope_dim]."""
        return rope_table(self.freqs[kind], positions)

    def tail(self, offset: int) -> RopeTables:
        """The tables of the call's rows [offset, S)."""
        rows = {kind: (c[:, offset:], s[:, offset:]) for kind, (c, s) in self.rows.items()}
        per_head = {kind: (c[:, offset:], s[:, offset:]) for kind, (c, s) in self.per_head.items()}
        return RopeTables(self.freqs, rows, per_head)


def build_step(
    positions_start: torch.Tensor,
    floors: torch.Tensor,
    seq: int,
    freqs: dict[str, torch.Tensor],
    write_global: bool,
    global_from: int = 0,
) -> Step:
    """The Step of a call adding `seq` tokens to rows starting at `positions_start` [B]; with
    write_global, rows [global_from, seq) of the call write global KV (see `Step.global_rows`)."""
    positions = positions_start[:, None] + torch.arange(seq, device=positions_start.device)
    return Step(
        positions=positions,
        start=positions_start,
        start_host=tuple(positions_start.tolist()),
        floors=floors,
        floors_host=tuple(floors.tolist()),
        rope=RopeTables.build(freqs, positions),
        write_global=write_global,
        global_from=global_from,
    )


@dataclass
class Step:
    """Rows of one forward: B rows, S new tokens each, row b at positions start[b] + [0, S)."""

    positions: torch.Tensor  # [B, S] long
    start: torch.Tensor  # [B] long
    start_host: tuple[int, ...]
    floors: torch.Tensor  # [B] long, first readable window position
    floors_host: tuple[int, ...]
    rope: RopeTables
    # False while replaying rows whose global KV is already cached: sources then neither pool
    # nor write compressed entries, index keys or compressor carry (they only read them).
    write_global: bool = True
    # With write_global, the first row of the call that writes global KV: rows before it are
    # replayed rows riding in the same call as the new rows after them (read-only, as above).
    global_from: int = 0
    # Context parallelism (training): the call holds one shard of a longer sequence, and this
    # object supplies what the shards before it computed (see replaykv.train.context).
    context: Any = None

    @cached_property
    def global_rows(self) -> Step | None:
        """The Step of the rows that write global KV ([global_from, S)), or None when none do
        (built once per call, read by every source layer)."""
        g = self.global_from
        if not self.write_global or g >= self.seq:
            return None
        if g == 0:
            return self
        return Step(
            positions=self.positions[:, g:],
            start=self.start + g,
            start_host=tuple(p + g for p in self.start_host),
            floors=self.floors,
            floors_host=self.floors_host,
            rope=self.rope.tail(g),
        )

    @property
    def batch(self) -> int:
        return len(self.start_host)

    @property
    def seq(self) -> int:
        return int(self.positions.shape[1])

    def window_unclipped(self, window: int) -> bool:
        """True when every row's window keys are all readable (no floor, no negative position)."""
        first = min(self.start_host) - (window - 1)
        return first >= 0 and max(self.floors_host) <= first

    def groups(self, ratio: int) -> tuple[list[int], list[int]]:
        """Per row: the first group this call may complete and how many it completes."""
        s = self.seq
        first = [p // ratio for p in self.start_host]
        count = [(p + s) // ratio - p // ratio for p in self.start_host]
        return first, count

    def visible_entries(self, ratio: int, query: int) -> int:
        """Largest number of entries any row's query `query` (0-based in the call) may see."""
        return max((p + query + 1) // ratio for p in self.start_host)

    def common_entries(self, ratio: int, query: int) -> int:
        """Number of entries that every row's query `query` and every later query may see: a
        block of queries from `query` on needs a causal mask only on the entries after these."""
        return min((p + query + 1) // ratio for p in self.start_host)

    def entry_blocks(self, ratio: int, per_entry: int, budget: int) -> Iterator[tuple[int, int, int]]:
        """Blocks of queries (i0, i1, visible entries at i1 - 1) such that block rows × visible
        entries × per_entry stays within `budget` (visible prefixes grow with position)."""
        s, i0 = self.seq, 0
        while i0 < s:
            n = max(1, per_entry * self.visible_entries(ratio, i0))
            rows = max(1, min(s - i0, budget // n))
            while rows > 1 and rows * per_entry * self.visible_entries(ratio, i0 + rows - 1) > budget:
                rows //= 2
            yield i0, i0 + rows, self.visible_entries(ratio, i0 + rows - 1)
            i0 += rows


IMAGE_ROW_ID = -1
"""The id a residual carries at image-span positions (their token ids are all the image token)."""


@dataclass
class Residual:
    """The residual state between layers: hc_mult streams and the lagged pre-mix.

    streams: [B, S, n, hidden]; pre_mix: [B, S, n] float32 (the collapse weights the next site
    uses); input_ids: [B, S], `IMAGE_ROW_ID` at positions an image span covers.
    """

    streams: torch.Tensor
    pre_mix: torch.Tensor
    input_ids: torch.Tensor

    def rows(self, start: int, end: int) -> Residual:
        """The rows [start, end) of every sequence (for decoder replay's tail)."""
        return Residual(self.streams[:, start:end], self.pre_mix[:, start:end], self.input_ids[:, start:end])


@dataclass
class Selection:
    """Per-forward index state published by index sources for the layers after them.

    topk: [B, S, k] selected entry ids (-1 = none). candidates: [B, S, kb] candidate block ids
    (-1 = none) from the candidate source, or None.
    """

    topk: torch.Tensor | None = None
    candidates: torch.Tensor | None = None

    def rows(self, start: int, end: int) -> Selection:
        return Selection(
            None if self.topk is None else self.topk[:, start:end],
            None if self.candidates is None else self.candidates[:, start:end],
        )


class SplitModel(Protocol):
    """The forward split every replayable model offers (DeepSeek-V4 and V4.1)."""

    config: Any

    def step(self, cache: Any, seq: int, write_global: bool = True, global_from: int = 0) -> Step: ...

    def embed(
        self, input_ids: torch.Tensor, spans: Sequence[tuple[int, torch.Tensor]] = (), offset: int = 0
    ) -> Residual: ...

    def run_layers(
        self, state: Residual, layers: range, step: Step, cache: Any, selection: Selection | None = None
    ) -> Residual: ...

    def head(self, state: Residual) -> torch.Tensor: ...


@contextlib.contextmanager
def flush_denormals() -> Iterator[None]:
    """Run CPU math with denormals flushed to zero (restored to IEEE on exit).

    Tiny intermediates of the quantised attention (FP4 scales, sink-dominated softmax rows) hit
    the CPU's slow path for subnormal floats: prefill ran ~5× slower without this. It changes no
    value above 1.2e-38; GPUs flush in their kernels anyway.
    """
    changed = torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if changed:
            torch.set_flush_denormal(False)
