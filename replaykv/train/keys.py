"""The record-key loss: a KV source's compressed entry at a record's answer is taught to hold the
record's code.

A lookup by a code drawn for the prompt, beyond the question's window, matches the question's
code against the compressed entries. For a record `A -> B` the entry the question has to read is
the one covering the answer's first byte B[0], and its key (entries are keys and values at once)
must then hold the A five to eight bytes before it. The evidence-attention loss
(:mod:`replaykv.train.evidence`) teaches that match through the attention, whose gradient
reaches a key only as the query it should match: with neither side formed it has nothing to grow
from (docs/training.md). This loss builds the key side on its own: a linear read-out per KV
source layer predicts the four bytes of A from the entry covering B[0] (cross-entropy over the
256 byte values, mean over records and bytes), so that the gradient flows through the entry into
the source's compressor and the layers below it. The read-out heads are trained with the model
(their own AdamW group, at `LR_SCALE` times the schedule's rate) and are not part of it: an
export holds the model alone, while a run's resumable state saves them with their moments (an
exact resume continues them; a cold resume from a stage checkpoint starts them again). They
start at zero: a random head would send the entries a gradient in random directions while it
learns; a zero head first fits what the entries already hold (its gradient into them grows with
it, along what it reads), and starts at the uniform prediction, ln 256 ≈ 5.55.

Records are those of the rows' `Evidence` (`replaykv.train.rows`: lookup rows, and multi-hop
and recall rows when `Phase.evidence_rows` names them; not a chain's statements, whose
`Evidence.keyed` is false); a record whose B[0] lies past the forward's length is left out.

Not for: the attention-side losses (:mod:`replaykv.train.evidence`,
:mod:`replaykv.train.distill`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from replaykv.train.evidence import LayerLosses, entry_attentions
from replaykv.train.rows import Evidence

CODE_BYTES = 4  # a record's code A (`replaykv.train.rows.lookup_row`)
LR_SCALE = 10.0  # the heads' rate against the schedule's: fresh probes on a trained model
ANSWER = CODE_BYTES + len(" -> ")  # B[0]'s offset in a record `A -> B`


class RecordKeys(nn.Module, LayerLosses):
    """Read-out heads on the compressed entries of KV source layers, with forward hooks on their
    attention blocks. `arm(rows, ids)` sets the next forward's records (per row of the
    micro-batch, its `Evidence`) and its token ids; a forward over exactly those rows from
    position 0 with autograd on records each source's loss; `pop()` returns the mean over the
    recorded sources (None when nothing was recorded) and disarms. `remove()` drops the hooks.

    `layers`: the KV source layers to read (empty: every KV source whose attention reads
    compressed entries); a layer that is not one is a `ValueError` naming it."""

    def __init__(self, model: Any, layers: tuple[int, ...] = ()) -> None:
        super().__init__()
        config = model.config
        attns = {i: a for i, a in entry_attentions(model).items() if config.is_kv_source(i)}
        self.layer_ids = tuple(layers) or tuple(attns)
        absent = sorted(set(self.layer_ids) - set(attns))
        if absent:
            raise ValueError(f"record-key layers {absent} are not KV sources (those are {tuple(attns)})")
        self.heads = nn.ModuleDict(
            {str(i): nn.Linear(int(attns[i].head_dim), CODE_BYTES * 256) for i in self.layer_ids}
        )
        for q in self.heads.parameters():
            nn.init.zeros_(q)
        self._rows: tuple[tuple[Evidence, ...], ...] = ()
        self._ids: torch.Tensor | None = None
        self._losses: list[torch.Tensor] = []
        self._seen: set[int] = set()
        self._handles = [attns[i].register_forward_hook(self._hook) for i in self.layer_ids]

    def arm(self, rows: tuple[tuple[Evidence, ...], ...], ids: torch.Tensor | None) -> None:
        self._rows, self._ids = rows, ids
        self._losses.clear()
        self._seen.clear()

    def pop(self) -> torch.Tensor | None:
        total = self._mean()
        self.arm((), None)
        return total

    def _hook(self, attn: Any, args: tuple[Any, ...], output: torch.Tensor) -> None:
        x, step, cache = args[0], args[1], args[2]
        ids = self._ids
        if ids is None or not self._records(attn, x, step, ids.shape[1]):
            return
        loss = record_key_loss(self.heads[str(attn.layer)], cache.entries, attn.ratio, ids, self._rows)
        if loss is not None:
            self._losses.append(loss)


def record_key_loss(
    head: nn.Module,
    entries: torch.Tensor,
    ratio: int,
    ids: torch.Tensor,
    rows: tuple[tuple[Evidence, ...], ...],
) -> torch.Tensor | None:
    """Mean cross-entropy of `head`'s prediction of each record's code bytes from the entry
    covering its answer's first byte. entries [B, N, D] (this forward's, gradients flowing to
    their source); ids [B, S]; a record [lo, hi) is `A -> B` with A at lo and B[0] at
    lo + ANSWER."""
    found = sorted({(b, lo) for b, row in enumerate(rows) for e in row if e.keyed for lo, _ in e.records})
    found = [(b, lo) for b, lo in found if (lo + ANSWER) // ratio < entries.shape[1]]
    if not found:
        return None
    batch = torch.tensor([b for b, _ in found], device=entries.device)
    lo = torch.tensor([lo for _, lo in found], device=entries.device)
    with torch.autocast(entries.device.type, enabled=False):  # a loss: float32 under bf16 products
        at = entries[batch, (lo + ANSWER) // ratio].float()  # [R, D]
        logits = head(at).view(len(found), CODE_BYTES, 256)
        code = ids[batch[:, None], lo[:, None] + torch.arange(CODE_BYTES, device=ids.device)]
        return F.cross_entropy(logits.reshape(-1, 256), code.reshape(-1).long())
