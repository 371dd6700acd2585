"""Executing a prefill plan over a cache view, one request row at a time.

The plan runs as its calls (`PrefillPlan.calls`: its segments, bounded replay's replayed and
new rows in one call per layer range). Each runs a layer range over a token range with its
window floor; a call that starts above layer 0 takes its input rows from the outputs of earlier
calls that ended at that layer (possibly two adjacent pieces, e.g. exact replay's rebuilt and
new rows feeding decoder replay), together with the top-k selection those rows had. Not for:
choosing the plan (see :mod:`replaykv.replay`) or scheduling several requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from replaykv.model.cache_view import CacheView
from replaykv.model.step import Residual, Selection, SplitModel
from replaykv.replay import PrefillPlan


@dataclass
class _Piece:
    layer_end: int
    start: int
    end: int
    state: Residual
    selection: Selection


def _pad_cols(t: torch.Tensor | None, width: int, rows: int, like: torch.Tensor) -> torch.Tensor:
    if t is None:
        return torch.full((like.shape[0], rows, width), -1, dtype=torch.long, device=like.device)
    return F.pad(t, (0, width - t.shape[-1]), value=-1)


def _join_selections(parts: list[Selection], rows: list[int], like: torch.Tensor) -> Selection:
    out = Selection()
    for name in ("topk", "candidates"):
        tensors = [getattr(p, name) for p in parts]
        if all(t is None for t in tensors):
            continue
        width = max(t.shape[-1] for t in tensors if t is not None)
        setattr(
            out,
            name,
            torch.cat([_pad_cols(t, width, n, like) for t, n in zip(tensors, rows, strict=True)], 1),
        )
    return out


def _gather(pieces: list[_Piece], layer: int, start: int, end: int) -> tuple[Residual, Selection]:
    """Rows [start, end) of the outputs that ended at `layer`, joined in position order."""
    cands = sorted((p for p in pieces if p.layer_end == layer), key=lambda p: (p.start, -(p.end - p.start)))
    parts: list[tuple[Residual, Selection]] = []
    pos = start
    for p in cands:
        if p.start <= pos < p.end:
            hi = min(end, p.end)
            a, b = pos - p.start, hi - p.start
            parts.append((p.state.rows(a, b), p.selection.rows(a, b)))
            pos = hi
            if pos >= end:
                break
    if pos < end:
        raise RuntimeError(f"plan error: no output of layer {layer} covers rows [{pos}, {end})")
    if len(parts) == 1:
        return parts[0]
    states = [st for st, _ in parts]
    joined = Residual(
        torch.cat([s.streams for s in states], 1),
        torch.cat([s.pre_mix for s in states], 1),
        torch.cat([s.input_ids for s in states], 1),
    )
    rows = [s.streams.shape[1] for s in states]
    return joined, _join_selections([sel for _, sel in parts], rows, joined.input_ids)


def execute(
    model: SplitModel,
    plan: PrefillPlan,
    input_ids: torch.Tensor,
    view: CacheView,
    spans: Sequence[tuple[int, torch.Tensor]] = (),
) -> torch.Tensor:
    """Run `plan` for the request `input_ids` [1, S] on `view` (already holding the cached global
    KV, and the snapshot when the plan restores one). Returns float32 logits [1, R, vocab] of the
    plan's logits rows; leaves the view's position at S with no window floor. `spans`: the
    request's image spans (first position, span vectors); every call from layer 0 places the
    vectors over the rows it runs, replayed rows included."""
    if input_ids.shape[0] != 1:
        raise ValueError("execute runs one request row; batch requests through the engine")
    pieces: list[_Piece] = []
    n_layers = len(view.layers)
    with torch.inference_mode():
        for call in plan.calls:
            (a, b), (t0, t1) = call.layers, call.tokens
            if a == 0:
                state, selection = model.embed(input_ids[:, t0:t1], spans, t0), Selection()
            else:
                state, selection = _gather(pieces, a, t0, t1)
            view.positions.fill_(t0)
            view.window_floor = torch.full_like(view.positions, call.window_floor)
            step = model.step(view, t1 - t0, call.global_from < t1, call.global_from - t0)
            out = model.run_layers(state, range(a, b), step, view, selection)
            pieces.append(_Piece(b, t0, t1, out, selection))
        r0, r1 = plan.logits_rows
        final, _ = _gather(pieces, n_layers, r0, r1)
        logits = model.head(final)
    view.positions.fill_(plan.tokens)
    view.window_floor = None
    return logits
