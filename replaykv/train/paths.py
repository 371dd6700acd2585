"""Grad-enabled forward paths: a prefill plan's segments run with autograd, for training and for
evaluation that must match the engine's truncated-window paths.

`run_plan` is the training twin of :func:`replaykv.engine.runner.execute` (which runs under
``torch.inference_mode``): the same segments over a cache view, for a batch of rows that share
one plan. The model writes its caches in place (window rings, compressed entries, compressor
carry); :class:`CacheGuard` makes autograd safe with that by saving a copy of any tensor that
aliases a cache tensor when autograd saves it, so a later in-place write (the next segment, or a
layer writing its ring after reading it) cannot invalidate the backward pass.

The paths of one training sequence [0, L) with follow-up boundary P (the answer starts there)
and optional cut c (architecture §6, §13):

    full      every layer over [0, L)                                  loss rows [0, L-1)
    decoder   encoder over [0, L) (reused from `full`), decoder over   loss rows [P-1, L-1)
              [P-W, L) with window floor P-W on fresh decoder windows
    bounded   global KV of [0, c) from `full`, snapshot missing:        loss rows [P-1, L-1)
              encoder replays [s, c) (read-only global KV, floor s = c-W), then [c, L) with
              floor s; decoder over [P-W, L) with floor P-W

Rows after P are the follow-up's decode steps: decode never reads a window below the prefill's
floor, so they run inside the plan's last segments (`extend`). Not for: choosing plans (see
:mod:`replaykv.replay`) or the optimiser (see :mod:`replaykv.train.setup`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from replaykv.cache.views import allocate_view
from replaykv.model.cache_view import CacheView, CompressorCarry, LayerCacheView
from replaykv.model.spec import ModelSpec
from replaykv.model.step import Residual, Selection, SplitModel
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.replay import CacheState, PrefillPlan, ReplayFlags, Segment, plan_prefill

FULL_FLAGS = ReplayFlags(enable_decoder_swa_bounded_replay=False)
REPLAY_FLAGS = ReplayFlags()  # the engine's defaults: encoder bounded replay + decoder replay


# ---------------------------------------------------------------------------- autograd and caches
class CacheGuard:
    """Saved-tensor hooks that copy any saved tensor aliasing a tracked cache tensor.

    Without it, `ring.gather(...)` saves the ring and the `scatter_` that follows (same layer,
    or the next segment) bumps its version: backward then fails ("modified by an inplace
    operation"). Copies are taken only for cache tensors, which are small next to activations.
    Every other saved tensor is kept as a detached alias: a pack hook that returns a tensor
    with its `grad_fn` makes a reference cycle through the graph when the tensor is its node's
    own output (as `relu_` saves), which Python's collector cannot see, so each step's graph
    would outlive its backward. Backward reads only the values, so first-order gradients are
    unchanged.
    """

    def __init__(self) -> None:
        self._ptrs: set[int] = set()
        self._hooks: Any = None

    def track(self, view: CacheView) -> CacheView:
        for t in _cache_tensors(view):
            self._ptrs.add(t.untyped_storage().data_ptr())
        return view

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.layout == torch.strided and t.untyped_storage().data_ptr() in self._ptrs:
            return t.detach().clone()
        return t.detach()  # an alias without grad_fn: see the class docstring

    def __enter__(self) -> CacheGuard:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def _cache_tensors(view: CacheView) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for lc in view.layers:
        out.append(lc.window)
        for t in (lc.entries, lc.index_keys):
            if t is not None:
                out.append(t)
        for c in (lc.carry, lc.index_carry):
            if c is not None:
                out += [c.kv, c.gate]
    return out


def fork_view(view: CacheView, rows: slice | None = None) -> CacheView:
    """What an earlier request leaves without its snapshot: the global KV (compressed entries,
    index keys, compressor carry) copied — differentiably — and fresh zero window rings.
    Tensors shared between layers (Reuse / Reindex layers read their source's) stay shared."""
    rows = rows if rows is not None else slice(None)
    clones: dict[int, torch.Tensor] = {}

    def copy(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if id(t) not in clones:
            clones[id(t)] = t[rows].clone()
        return clones[id(t)]

    def carry(c: CompressorCarry | None) -> CompressorCarry | None:
        if c is None:
            return None
        kv, gate = copy(c.kv), copy(c.gate)
        assert kv is not None and gate is not None
        return CompressorCarry(kv, gate)

    layers = [
        LayerCacheView(
            window=torch.zeros_like(lc.window[rows]),
            entries=copy(lc.entries),
            carry=carry(lc.carry),
            index_keys=copy(lc.index_keys),
            index_carry=carry(lc.index_carry),
        )
        for lc in view.layers
    ]
    return CacheView(positions=torch.zeros_like(view.positions[rows]), layers=layers)


# ---------------------------------------------------------------------------- plans
def extend(plan: PrefillPlan, end: int) -> PrefillPlan:
    """The plan followed by decode rows [plan.tokens, end): the segments that produce the last
    prompt rows continue over them with the same window floor."""
    segs = tuple(
        dataclasses.replace(s, tokens=(s.tokens[0], end)) if s.tokens[1] == plan.tokens else s
        for s in plan.segments
    )
    return dataclasses.replace(plan, segments=segs, tokens=end, logits_rows=(plan.logits_rows[0], end))


def split_at(plan: PrefillPlan, layer: int) -> PrefillPlan:
    """Split every segment that spans `layer` into [a, layer) and [layer, b) (same rows, floor):
    the same numbers, but the encoder part becomes reusable by other plans."""
    segs: list[Segment] = []
    for s in plan.segments:
        a, b = s.layers
        if a < layer < b:
            segs += [dataclasses.replace(s, layers=(a, layer)), dataclasses.replace(s, layers=(layer, b))]
        else:
            segs.append(s)
    return dataclasses.replace(plan, segments=tuple(segs))


def full_plan(spec: ModelSpec, tokens: int) -> PrefillPlan:
    """Every layer over [0, tokens), split at the first decoder layer."""
    plan = plan_prefill(CacheState(tokens), spec, FULL_FLAGS)
    return split_at(plan, decoder_start(spec))


def follow_up_plan(spec: ModelSpec, prompt_len: int, end: int, cut: int = 0) -> PrefillPlan:
    """The engine's plan for a prompt of `prompt_len` tokens with decoder replay on and a global
    KV hit at `cut` without its snapshot (0: a cold prefill), continued by decode rows to `end`."""
    state = CacheState(prompt_len, global_hit=cut)
    return extend(plan_prefill(state, spec, REPLAY_FLAGS), end)


def decoder_start(spec: ModelSpec) -> int:
    return len(spec.layers) if spec.decoder_cut is None else spec.decoder_cut + 1


@dataclass
class Piece:
    """The output of one segment: rows [segment.tokens) after layer segment.layers[1]."""

    segment: Segment
    state: Residual
    selection: Selection

    def same_work(self, seg: Segment) -> bool:
        s = self.segment
        return (s.layers, s.tokens, s.window_floor, s.write_global) == (
            seg.layers,
            seg.tokens,
            seg.window_floor,
            seg.write_global,
        )


RowSpans = Sequence[Sequence[tuple[int, torch.Tensor]]]
"""Image spans per batch row: (first position, span vectors [L, hidden]) for each image of a row."""


def embed_rows(model: SplitModel, ids: torch.Tensor, spans: RowSpans = (), offset: int = 0) -> Residual:
    """`model.embed` of rows `ids` [B, S] at position `offset`, row b's images `spans[b]` placed."""
    if not any(spans):
        return model.embed(ids)
    parts = [
        model.embed(ids[b : b + 1], spans[b] if b < len(spans) else (), offset) for b in range(ids.shape[0])
    ]
    return Residual(
        torch.cat([p.streams for p in parts]),
        torch.cat([p.pre_mix for p in parts]),
        torch.cat([p.input_ids for p in parts]),
    )


def run_plan(
    model: SplitModel,
    plan: PrefillPlan,
    ids: torch.Tensor,
    view: CacheView,
    reuse: list[Piece] | None = None,
    spans: RowSpans = (),
) -> tuple[torch.Tensor, list[Piece]]:
    """Run `plan` for the rows `ids` [B, S] on `view` with autograd (when enabled); `spans`:
    each row's image spans, placed on every row a layer-0 segment runs.

    Segments whose work matches a piece in `reuse` (same layers, rows, floor, global-KV mode,
    computed on the same rows from the same starting caches) take that piece instead of running.
    Returns float32 logits [B, R, vocab] of plan.logits_rows (R = 0: no head) and all pieces;
    leaves the view's position at plan.tokens with no window floor.
    """
    pieces = list(reuse or [])
    n_layers = len(view.layers)
    for seg in plan.segments:
        (a, b), (t0, t1) = seg.layers, seg.tokens
        if t1 <= t0 or any(p.same_work(seg) for p in pieces):
            continue
        if a == 0:
            state, selection = embed_rows(model, ids[:, t0:t1], spans, t0), Selection()
        else:
            state, selection = _gather(pieces, a, t0, t1)
        view.positions.fill_(t0)
        view.window_floor = torch.full_like(view.positions, seg.window_floor)
        step = model.step(view, t1 - t0, write_global=seg.write_global)
        out = model.run_layers(state, range(a, b), step, view, selection)
        pieces.append(Piece(seg, out, selection))
    view.positions.fill_(plan.tokens)
    view.window_floor = None
    r0, r1 = plan.logits_rows
    if r1 <= r0:
        return torch.zeros(ids.shape[0], 0, model.config.vocab_size, device=ids.device), pieces
    final, _ = _gather(pieces, n_layers, r0, r1)
    return model.head(final), pieces


def _gather(pieces: list[Piece], layer: int, start: int, end: int) -> tuple[Residual, Selection]:
    """Rows [start, end) of the outputs that ended at `layer`, joined in position order."""
    cands = sorted(
        (p for p in pieces if p.segment.layers[1] == layer),
        key=lambda p: (p.segment.tokens[0], -(p.segment.tokens[1] - p.segment.tokens[0])),
    )
    parts: list[tuple[Residual, Selection]] = []
    pos = start
    for p in cands:
        p0, p1 = p.segment.tokens
        if p0 <= pos < p1:
            hi = min(end, p1)
            parts.append((p.state.rows(pos - p0, hi - p0), p.selection.rows(pos - p0, hi - p0)))
            pos = hi
            if pos >= end:
                break
    if pos < end:
        raise RuntimeError(f"plan error: no output of layer {layer} covers rows [{pos}, {end})")
    if len(parts) == 1:
        state, sel = parts[0]
        return state, Selection(sel.topk, sel.candidates)  # a fresh object: layers replace fields
    states = [st for st, _ in parts]
    joined = Residual(
        torch.cat([s.streams for s in states], 1),
        torch.cat([s.pre_mix for s in states], 1),
        torch.cat([s.input_ids for s in states], 1),
    )
    out = Selection()
    for name in ("topk", "candidates"):
        tensors = [getattr(sel, name) for _, sel in parts]
        if all(t is None for t in tensors):
            continue
        width = max(t.shape[-1] for t in tensors if t is not None)
        cols = []
        for t, st in zip(tensors, states, strict=True):
            if t is None:
                t = torch.full((st.input_ids.shape[0], st.input_ids.shape[1], width), -1, dtype=torch.long)
                t = t.to(st.input_ids.device)
            cols.append(F.pad(t, (0, width - t.shape[-1]), value=-1))
        setattr(out, name, torch.cat(cols, 1))
    return joined, out


# ---------------------------------------------------------------------------- training losses
def weighted_ce(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged with per-position `weights` (bool: the plain mean over the True
    positions). logits [B, T, V], targets/weights [B, T]."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="none")
    w = weights.reshape(-1).to(ce.dtype)
    return (ce * w).sum() / w.sum().clamp(min=1.0)


def path_losses(
    model: DeepseekV41ForCausalLM,
    spec: ModelSpec,
    ids: torch.Tensor,
    targets: torch.Tensor,
    prompt_len: int,
    cut: int,
    full: bool = True,
    follow_up: bool = False,
) -> dict[str, torch.Tensor]:
    """Losses of one batch on the paths of the module docstring.

    ids, targets [B, L] (targets[t]: the loss weight of position t, bool or float). `full`: the full-path loss;
    `follow_up`: the follow-up's loss under decoder replay ("decoder") or, with cut > 0, encoder
    bounded replay at `cut` as well ("bounded"). The encoder pass of the full path is shared.
    """
    b, length = ids.shape
    guard = CacheGuard()
    view = guard.track(allocate_view(spec, b, length, ids.device, model.lm_head.weight.dtype))
    losses: dict[str, torch.Tensor] = {}
    plan = full_plan(spec, length)
    with guard:
        if full:
            logits, pieces = run_plan(model, plan, ids, view)
            losses["full"] = weighted_ce(logits[:, :-1], ids[:, 1:], targets[:, 1:])
        else:
            encoder = dataclasses.replace(plan, segments=plan.segments[:1], logits_rows=(0, 0))
            _, pieces = run_plan(model, encoder, ids, view)
        if follow_up:
            up = follow_up_plan(spec, prompt_len, length, cut)
            fork = guard.track(fork_view(view))
            logits, _ = run_plan(model, up, ids, fork, reuse=None if cut else pieces[:1])
            r0, p = up.logits_rows[0], prompt_len
            name = "bounded" if cut else "decoder"
            losses[name] = weighted_ce(logits[:, p - 1 - r0 : length - 1 - r0], ids[:, p:], targets[:, p:])
    return losses
