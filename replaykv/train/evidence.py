"""The evidence-attention loss: at a lookup's question, the attention over compressed entries is
taught to find the record the question asks for.

A lookup by a code drawn for the prompt has to match the question's code against a record's
through the compressed entries once the record lies before the question's window. The
language-model loss reaches that match only through the answer's bytes; on its own it taught
the `small` model where records are but hardly which one is asked (docs/training.md, "the match
by code is weak"). This loss adds the direct signal the data already know: for every question
row of a batch (`replaykv.train.rows.Evidence`), in every layer that reads compressed entries,
the negative log of the attention mass, averaged over heads, that the row's query puts on the
entries covering the record, out of a softmax over the entries it may see. The softmax leaves
out the window and the sink, so the loss shapes which entry wins among the entries and not
how much a layer reads them at all, and it spans every visible entry rather than the top-k, so
that the match is learnt before the indexer selects it (the indexer then learns to select it
from the same attention; see :mod:`replaykv.train.distill`).

The contrastive form (`contrast`, `Phase.evidence_contrast`) takes the softmax over the entries
covering the row's records only (`Evidence.records`): a layer earns nothing by reading every
record alike, only by reading the asked record more than its rivals, which is the match by code
itself. A question with no rival record visible yet is left out. With `tail` n > 0
(`Phase.evidence_tail`) each record counts only by its last n bytes, a record `A -> B`'s answer
B: the entries a lookup has to read, whose keys must hold the A before them. `layers`
(`Phase.evidence_layers`) limits the loss to the named layers (empty: every layer with
compressed entries), e.g. the decoder's, whose entries are one per token and drawn from the
encoder's last hidden states. `keyed_layers` (`Phase.evidence_keyed_layers`) gives the questions
whose records are keyed by a code (`Evidence.keyed`: lookup, multi-hop and recall records
`A -> B`) layers of their own, so that a chain's statements and the records by a code can be
taught in different layers (None: `layers` for both).

Not for: the indexer's own loss (:mod:`replaykv.train.distill`), the language-model losses.
"""

from __future__ import annotations

from typing import Any

import torch

from replaykv.model.compressor import causal_entry_limit
from replaykv.model.step import Step
from replaykv.train.rows import Evidence

_FLOOR = 1e-6  # mass floor inside the log: a record with no mass costs log(1e6) ≈ 14, not inf


def entry_attentions(model: Any) -> dict[int, Any]:
    """Layer index -> attention block, for every layer of `model` whose attention reads
    compressed entries (a layer of another pipeline stage, None, is left out)."""
    return {
        i: layer.self_attn
        for i, layer in enumerate(model.model.layers)
        if getattr(getattr(layer, "self_attn", None), "ratio", 0)
    }


class LayerLosses:
    """The bookkeeping of forward hooks that record one loss per attention layer over an armed
    forward: the armed rows, the layers seen since `arm`, the losses, the hook handles."""

    _rows: tuple[tuple[Evidence, ...], ...]
    _losses: list[torch.Tensor]
    _seen: set[int]
    _handles: list[Any]

    def _records(self, attn: Any, x: torch.Tensor, step: Step, length: int) -> bool:
        """Whether this forward of `attn` records: autograd on, exactly the armed rows over
        `length` positions from position 0 in one process (no context shard), and the layer's
        first such pass since `arm` (a later path's pass adds none). Marks the layer seen."""
        if (
            not torch.is_grad_enabled()
            or not any(self._rows)
            or x.shape[0] != len(self._rows)
            or x.shape[1] != length
            or any(step.start_host)
            or step.context is not None
            or attn.layer in self._seen
        ):
            return False
        self._seen.add(attn.layer)
        return True

    def _mean(self) -> torch.Tensor | None:
        return torch.stack(self._losses).mean() if self._losses else None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class EvidenceAttention(LayerLosses):
    """Forward hooks on every attention block with compressed entries. `arm(rows, length)` sets
    the questions of the next forward (per row of the micro-batch, the `Evidence` of its
    questions) and the length of the rows; a forward over exactly those rows from position 0
    with autograd on records each layer's loss; `pop()` returns the mean over the recorded
    layers and questions (None when nothing was recorded) and disarms; with `layers` given to
    `arm`, only those layers record (with `keyed_layers` as well, those layers for the keyed
    questions and `layers` for the rest). `remove()` drops the hooks."""

    def __init__(self, model: Any) -> None:
        self._rows: tuple[tuple[Evidence, ...], ...] = ()
        self._length = 0
        self._contrast = False
        self._tail = 0
        self._layers: tuple[int, ...] = ()
        self._keyed_layers: tuple[int, ...] | None = None
        self._losses: list[torch.Tensor] = []
        self._seen: set[int] = set()  # layers recorded since `arm`: a later path's pass adds none
        hooked = entry_attentions(model)
        self.layer_ids = tuple(hooked)
        self._handles = [attn.register_forward_hook(self._hook) for attn in hooked.values()]

    def arm(
        self,
        rows: tuple[tuple[Evidence, ...], ...],
        length: int,
        contrast: bool = False,
        tail: int = 0,
        layers: tuple[int, ...] = (),
        keyed_layers: tuple[int, ...] | None = None,
    ) -> None:
        named = set(layers) | set(keyed_layers or ())
        if not named <= set(self.layer_ids):
            absent = sorted(named - set(self.layer_ids))
            raise ValueError(
                f"evidence layers {absent} read no compressed entries (those are {self.layer_ids})"
            )
        self._rows, self._length, self._contrast, self._tail = rows, length, contrast, tail
        self._layers, self._keyed_layers = layers, keyed_layers
        self._losses.clear()
        self._seen.clear()

    def pop(self) -> torch.Tensor | None:
        total = self._mean()
        self.arm((), 0)
        return total

    def _taught(self, layer: int, keyed: bool) -> bool:
        """Whether `layer` teaches the questions whose records are keyed (or not)."""
        layers = self._keyed_layers if keyed and self._keyed_layers is not None else self._layers
        return not layers or layer in layers

    def _hook(self, attn: Any, args: tuple[Any, ...], output: torch.Tensor) -> None:
        x, step, cache = args[0], args[1], args[2]
        rows = tuple(tuple(e for e in row if self._taught(attn.layer, e.keyed)) for row in self._rows)
        if not any(rows):
            return
        if not self._records(attn, x, step, self._length):
            return
        loss = evidence_loss(attn, x, step, cache.entries, rows, self._contrast, self._tail)
        if loss is not None:
            self._losses.append(loss)


def evidence_loss(
    attn: Any,
    x: torch.Tensor,
    step: Step,
    entries: torch.Tensor,
    rows: tuple[tuple[Evidence, ...], ...],
    contrast: bool = False,
    tail: int = 0,
) -> torch.Tensor | None:
    """Mean over questions of -log(mean over heads of the query's mass on its record's entries),
    the softmax over every visible entry or, with `contrast`, over those covering a record;
    with `tail` > 0 a record is its last `tail` bytes.

    x [B, S, hidden]: the block's (normed) input over positions [0, S); entries [B, N, D]: the
    layer's compressed entries (written by this forward, gradients flowing to their source)."""
    r = attn.ratio
    found = [(b, e) for b, row in enumerate(rows) for e in row if e.query < x.shape[1]]
    if not found:
        return None
    batch = torch.tensor([b for b, _ in found], device=x.device)
    query = torch.tensor([e.query for _, e in found], device=x.device)
    lo = torch.tensor([e.lo for _, e in found], device=x.device)
    hi = torch.tensor([e.hi for _, e in found], device=x.device)
    if tail:
        lo = torch.maximum(lo, hi - tail)
    visible = causal_entry_limit(query, r)  # [Q]
    n = int(visible.max())
    if n == 0:
        return None
    tables = (t[batch, query] for t in step.rope.heads(attn.rope_kind))
    q = attn.queries(x[batch, query], *tables)[1].float()  # [Q, H, D]
    with torch.autocast(x.device.type, enabled=False):  # a loss: float32 under bf16 products too
        keys = entries[batch, :n].float()  # [Q, N, D]
        logits = torch.einsum("qhd,qnd->qhn", q, keys) * attn.head_dim**-0.5
        ids = torch.arange(n, device=x.device)
        pool = ids < visible[:, None]  # [Q, N]
        # an entry covers positions [id·r, id·r + r): the record's entries are those it overlaps
        covers = (ids * r + r > lo[:, None]) & (ids * r < hi[:, None]) & pool  # [Q, N]
        keep = covers.any(dim=1)  # a record not yet compressed at its query has nothing to find
        if contrast:
            pool = pool & _covering([e.records for _, e in found], ids, r, tail)
            keep &= (pool & ~covers).any(dim=1)  # a rival to tell it from
        logits = logits.masked_fill(~pool[:, None], float("-inf"))
        if not bool(keep.any()):
            return None
        probs = torch.softmax(logits[keep], dim=-1)  # [Q', H, N]
        mass = (probs * covers[keep][:, None].to(probs.dtype)).sum(-1).mean(-1)  # [Q']
        return -torch.log(mass + _FLOOR).mean()


def _covering(
    records: list[tuple[tuple[int, int], ...]], ids: torch.Tensor, r: int, tail: int = 0
) -> torch.Tensor:
    """[Q, N] bool: entry `ids[n]` overlaps one of question q's records [lo, hi) (their last
    `tail` bytes when `tail` > 0)."""
    out = torch.zeros(len(records), len(ids), dtype=torch.bool, device=ids.device)
    for q, spans in enumerate(records):
        for lo, hi in spans:
            lo = max(lo, hi - tail) if tail else lo
            out[q] |= (ids * r + r > lo) & (ids * r < hi)
    return out
