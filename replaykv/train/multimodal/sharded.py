"""Loading a long sequence's images across context-parallel ranks: each image read once.

Under context parallelism (:mod:`replaykv.train.context`) shard c of CP holds positions
[c·L, (c+1)·L) of the sequence. Its images are spread over the shards for reading: image k goes
to the shard that holds most of its span (between equal parts, the one with the fewest bytes
assigned so far), which reads it from storage, prepares it and runs the tower on it (phase 1
of the three-phase step), so only a straddling span's other part travels. The owner then
sends each shard the rows of the span that fall in that shard's positions, so a span that
straddles a boundary is split between two shards and an image is read and encoded exactly once
per step however many shards it touches. After the language model's backward (phase 2), each
shard sends its rows' gradients back to the owner, which runs the tower's backward (phase 3).

Every shard knows every image's placement (its span's start and length come with the
sequence's token ids), so message sizes are known on both sides; the transfers are point to
point over the CP group. With ``shard_reads=False`` every shard reads and encodes every image
that touches it (what a loader unaware of CP does); the counts tell the two apart.

Not for: the language model's own exchanges (halo rows, group entries).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from replaykv.images import prepare_image
from replaykv.model.vision import DeepseekV41VisionConfig, VisionTower
from replaykv.train.context import ContextShards
from replaykv.train.multimodal.data import ImageStore


@dataclass(frozen=True)
class Placement:
    """Image `image_id` of the store spans positions [start, start + length) of the sequence."""

    image_id: int
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


def assign_readers(placements: list[Placement], nbytes: list[int], shards: int, length: int) -> list[int]:
    """The reading shard of each image: the shard holding most of its span (so only a
    straddling span's other part travels); between shards holding equal parts, the one with
    the fewest bytes assigned so far, then the lower one. Deterministic, so every shard computes
    the same assignment. (`length`: positions per shard.)"""
    load = [0] * shards
    owner = [0] * len(placements)
    for k in sorted(range(len(placements)), key=lambda k: (-nbytes[k], k)):
        p = placements[k]
        held = [max(0, min(p.end, (c + 1) * length) - max(p.start, c * length)) for c in range(shards)]
        c = min(range(shards), key=lambda j: (-held[j], load[j], j))
        owner[k] = c
        load[c] += nbytes[k]
    return owner


@dataclass
class ShardImages:
    """One step's images on one shard: the spans its rows read (leaves), and what it owns."""

    spans: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (absolute start, rows)
    leaves: dict[int, torch.Tensor] = field(default_factory=dict)  # image index -> this shard's rows
    owned: dict[int, torch.Tensor] = field(default_factory=dict)  # image index -> vectors (graph)
    reads: int = 0


class ShardedImageLoader:
    """Phase 1 and phase 3 of the three-phase step for a sequence split over `shards` (None:
    one process holds the whole sequence)."""

    def __init__(
        self,
        tower: VisionTower,
        vision: DeepseekV41VisionConfig,
        store: ImageStore,
        shards: ContextShards | None,
        shard_length: int,
        shard_reads: bool = True,
    ) -> None:
        self.tower, self.vision, self.store = tower, vision, store
        self.shards, self.length, self.shard_reads = shards, shard_length, shard_reads
        self.index = shards.index if shards is not None else 0
        self.size = shards.size if shards is not None else 1

    def _rows(self, p: Placement, c: int) -> tuple[int, int]:
        """The span positions of `p` that shard `c` holds ([a, a) when none)."""
        a, b = max(p.start, c * self.length), min(p.end, (c + 1) * self.length)
        return (a, b) if a < b else (a, a)

    def _encode(self, p: Placement) -> torch.Tensor:
        image = prepare_image(self.store.read(p.image_id), self.vision)
        if image.span_length != p.length:
            raise ValueError(
                f"image {p.image_id} makes a span of {image.span_length}, its placement says {p.length}"
            )
        return self.tower.span(image)

    def forward(self, placements: list[Placement]) -> ShardImages:
        """Phase 1: read and encode this shard's images, exchange rows; the spans for `embed`."""
        out = ShardImages()
        touches = [
            [c for c in range(self.size) if self._rows(p, c)[0] < self._rows(p, c)[1]] for p in placements
        ]
        if not self.shard_reads:
            for k, p in enumerate(placements):
                if self.index in touches[k]:
                    vec = self._encode(p)
                    out.reads += 1
                    a, b = self._rows(p, self.index)
                    out.owned[k] = vec
                    leaf = vec[a - p.start : b - p.start].detach().requires_grad_(True)
                    out.leaves[k] = leaf
                    out.spans.append((a, leaf))
            return out
        owner = assign_readers(
            placements, [self.store.nbytes(p.image_id) for p in placements], self.size, self.length
        )
        ops: list[tuple[Any, torch.Tensor, int]] = []
        hidden = self.tower.image_start.shape[0]
        for k, p in enumerate(placements):
            a, b = self._rows(p, self.index)
            if owner[k] == self.index:
                vec = self._encode(p)
                out.reads += 1
                out.owned[k] = vec
                for c in touches[k]:
                    if c == self.index:
                        continue
                    ca, cb = self._rows(p, c)
                    ops.append((dist.isend, vec[ca - p.start : cb - p.start].detach().contiguous(), c))
                if a < b:
                    leaf = vec[a - p.start : b - p.start].detach().requires_grad_(True)
                    out.leaves[k] = leaf
            elif a < b:
                buf = torch.empty(b - a, hidden, dtype=self.tower.image_start.dtype)
                ops.append((dist.irecv, buf, owner[k]))
                out.leaves[k] = buf
        self._p2p(ops)
        for k in sorted(out.leaves):
            leaf = out.leaves[k]
            if not leaf.requires_grad:
                leaf.requires_grad_(True)
            out.spans.append((self._rows(placements[k], self.index)[0], leaf))
        self._owner = owner
        return out

    def backward(self, placements: list[Placement], step: ShardImages) -> None:
        """Phase 3: the rows' gradients back to each image's owner, then the tower's backward."""
        if not self.shard_reads or self.shards is None:
            outs = [step.owned[k] for k in step.leaves if step.leaves[k].grad is not None]
            grads = []
            for k in step.leaves:
                leaf = step.leaves[k]
                if leaf.grad is None:
                    continue
                p = placements[k]
                a, b = self._rows(p, self.index)
                g = torch.zeros_like(step.owned[k])
                g[a - p.start : b - p.start] = leaf.grad
                grads.append(g)
            if outs:
                torch.autograd.backward(outs, grads)
            return
        owner = self._owner
        ops: list[tuple[Any, torch.Tensor, int]] = []
        received: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        for k, p in enumerate(placements):
            a, b = self._rows(p, self.index)
            if owner[k] != self.index and a < b:
                leaf = step.leaves[k]
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                ops.append((dist.isend, grad.contiguous(), owner[k]))
            elif owner[k] == self.index:
                for c in range(self.size):
                    ca, cb = self._rows(p, c)
                    if c == self.index or ca >= cb:
                        continue
                    buf = torch.empty(cb - ca, step.owned[k].shape[1], dtype=step.owned[k].dtype)
                    ops.append((dist.irecv, buf, c))
                    received.setdefault(k, []).append((ca, cb, buf))
        self._p2p(ops)
        outs, grads = [], []
        for k, vec in step.owned.items():
            p = placements[k]
            g = torch.zeros_like(vec)
            a, b = self._rows(p, self.index)
            own = step.leaves.get(k)
            if own is not None and own.grad is not None:
                g[a - p.start : b - p.start] = own.grad
            for ca, cb, buf in received.get(k, []):
                g[ca - p.start : cb - p.start] += buf
            outs.append(vec)
            grads.append(g)
        if outs:
            torch.autograd.backward(outs, grads)

    def _p2p(self, pairs: list[tuple[Any, torch.Tensor, int]]) -> None:
        if not pairs or self.shards is None:
            return
        ops = [dist.P2POp(op, t, self.shards.ranks[peer], self.shards.group) for op, t, peer in pairs]
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def shard_lm_loss(
    model: Any,
    ids: torch.Tensor,
    targets: torch.Tensor,
    shards: ContextShards | None,
    spans: list[tuple[int, torch.Tensor]],
) -> torch.Tensor:
    """This shard's part of the next-token loss of one sequence `ids` [1, S] (weights
    `targets`), normalised by the whole sequence's weight, so the shards' parts sum to the
    one-process loss. Runs every layer on the shard's rows with the context exchanges on, the
    images' rows placed from `spans` (absolute starts)."""
    from replaykv.cache.views import allocate_view
    from replaykv.model.spec import ModelSpec
    from replaykv.train.paths import CacheGuard, embed_rows

    index, size = (shards.index, shards.size) if shards is not None else (0, 1)
    total = ids.shape[1]
    length = total // size
    start = index * length
    spec = ModelSpec.from_config(model.config)
    guard = CacheGuard()
    view = guard.track(allocate_view(spec, 1, total, ids.device, model.lm_head.weight.dtype))
    view.positions.fill_(start)
    with guard:
        state = embed_rows(model, ids[:, start : start + length], [spans], start)
        step = model.step(view, length)
        step.context = shards
        state = model.run_layers(state, range(len(model.model.layers)), step, view)
        logits = model.head(state)[0]
    end = min(start + length, total - 1)  # the last position has no next token
    rows = end - start
    weights = targets[0, start + 1 : end + 1].to(logits.dtype)
    ce = torch.nn.functional.cross_entropy(logits[:rows], ids[0, start + 1 : end + 1], reduction="none")
    return (ce * weights).sum() / targets[0, 1:].to(logits.dtype).sum().clamp(min=1.0)
