"""Cache scenarios on one text, in process: what a replay path does to a follow-up request.

`score_after_cut` prefills tokens [0, cut) as an earlier, finished request (under the same
decoder setting), optionally drops the window snapshot it left (filling the window rings with
garbage so that any read of them shows), then runs the follow-up request [0, S) through the
plan the chosen path makes and returns the logits of rows [cut, S). Rows the path does not
compute (decoder replay computes the decoder only for the last W rows) are NaN. Images in the
text (`images`) are placed from their span vectors on every row a layer-0 call runs, the
earlier request's and the replayed ones alike.
Not for: serving (the engine does the same through the cache manager).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from replaykv.cache.views import allocate_view
from replaykv.engine.runner import execute
from replaykv.images import PromptImage, check_placement
from replaykv.model.cache_view import CacheView
from replaykv.model.spec import ModelSpec
from replaykv.replay import CacheState, PrefillPlan, ReplayFlags, plan_prefill


def drop_snapshot(view: CacheView, seed: int = 0) -> None:
    """Overwrite every window ring with large random values (a missing snapshot)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for layer in view.layers:
        junk = torch.randn(layer.window.shape, generator=gen) * 1e3
        layer.window.copy_(junk.to(layer.window.dtype))


def prefill_as_request(
    model: Any,
    ids: torch.Tensor,
    view: CacheView,
    flags: ReplayFlags,
    spans: Sequence[tuple[int, torch.Tensor]] = (),
) -> tuple[torch.Tensor, PrefillPlan]:
    """A cold prefill of `ids` [1, S] under `flags`' decoder setting."""
    spec = ModelSpec.from_config(model.config)
    plan = plan_prefill(CacheState(tokens=ids.shape[1]), spec, flags)
    return execute(model, plan, ids, view, spans), plan


def image_spans(model: Any, images: Sequence[PromptImage]) -> list[tuple[int, torch.Tensor]]:
    """(first position, span vectors) of each image, from the model's tower."""
    if not images:
        return []
    vision = getattr(model.model, "vision", None)
    if vision is None:
        raise ValueError("the model has no vision tower; it cannot read images")
    with torch.inference_mode():
        return [(im.start, vision.span(im.image)) for im in images]


def inject_fault(fault: str | None, plan: PrefillPlan, view: CacheView) -> PrefillPlan:
    """A deliberate fault (replay.FAULTS, None: none) applied to one request's plan and view, so
    that an acceptance contract or a fidelity study can be shown to catch a wrong replay:
    "window_untruncated" lets bounded replay read window keys below the replay start (junk, as
    the snapshot is missing), "drop_global_kv" zeroes the cached global KV a hit loaded."""
    if fault == "window_untruncated" and plan.path == "bounded":
        drop_snapshot(view, seed=len(plan.segments))
        return dataclasses.replace(plan, segments=tuple(dataclasses.replace(g, window_floor=0) for g in plan.segments))
    if fault == "drop_global_kv" and plan.use_global:
        for layer in view.layers:
            for t in (layer.entries, layer.index_keys):
                if t is not None:
                    t.zero_()
    return plan


def follow_up(
    model: Any,
    ids: list[int],
    cut: int,
    flags: ReplayFlags,
    keep_snapshot: bool,
    images: Sequence[PromptImage] = (),
    capacity: int = 0,
    fault: str | None = None,
) -> tuple[torch.Tensor, PrefillPlan, CacheView]:
    """Run the follow-up request `ids` after an earlier request cached [0, cut): the logits
    [S - cut, vocab] (NaN on rows the path does not compute), the plan, and the view left at
    position S with room for `capacity` more tokens (to decode on)."""
    spec = ModelSpec.from_config(model.config)
    device = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    s_len = len(ids)
    if not 0 <= cut < s_len:
        raise ValueError(f"--cut must be in [0, {s_len}) for a {s_len}-token input, got {cut}")
    dtype = model.model.embed_tokens.weight.dtype
    check_placement(ids, images, model.config.image_token_id)  # an ImageError is a ValueError
    spans = image_spans(model, images)
    view = allocate_view(spec, 1, s_len + capacity, device, dtype)
    if cut > 0:
        prefill_as_request(model, x[:, :cut], view, flags, spans)
    if not keep_snapshot:
        drop_snapshot(view)
    state = CacheState(tokens=s_len, global_hit=cut, snapshot_at=(cut,) if keep_snapshot and cut else ())
    plan = inject_fault(fault, plan_prefill(state, spec, flags), view)
    logits = execute(model, plan, x, view, spans)[0].float()
    out = torch.full((s_len - cut, logits.shape[-1]), float("nan"))
    r0, r1 = plan.logits_rows
    lo = max(r0, cut)
    out[lo - cut : r1 - cut] = logits[lo - r0 :].cpu()
    return out, plan, view


def score_after_cut(
    model: Any,
    ids: list[int],
    cut: int,
    flags: ReplayFlags,
    keep_snapshot: bool,
    images: Sequence[PromptImage] = (),
) -> tuple[torch.Tensor, PrefillPlan]:
    """Logits [S - cut, vocab] of the follow-up request and the plan that produced them."""
    logits, plan, _ = follow_up(model, ids, cut, flags, keep_snapshot, images)
    return logits, plan
