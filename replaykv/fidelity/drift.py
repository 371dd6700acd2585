"""Drift over turns: the same text read in one pass or in turns leaves slightly different
global KV when each turn's prefix hits global KV but misses its window snapshot, because each
turn's new compressed entries are written from a bounded-replay (approximate) state and the
next turn reads them.

A session splits a prompt [0, S) at turn boundaries t_1 < … < t_K = S. Turn k is a follow-up
request [0, t_k) on one cache view that holds the global KV the earlier turns wrote: with the
snapshot at t_{k-1} missing (its window rings overwritten with junk) the plan is bounded replay,
with it kept the plan is a hit, which must reproduce one-pass prefill exactly (architecture
§13.2). Per turn: the relative error of the stored compressed entries and index keys written so
far against a one-pass prefill of the same tokens, and KL(one pass ‖ turns) of the next-token
distribution of the turn's last row. At the last turn the task's answer is scored by teacher
forcing. Not for: single follow-ups (see :mod:`replaykv.fidelity.traces`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

from replaykv.accept.stats import bootstrap_median
from replaykv.cache.views import allocate_view
from replaykv.engine.runner import execute
from replaykv.engine.scenario import drop_snapshot
from replaykv.fidelity.prompts import prompts
from replaykv.fidelity.study import paired_difference
from replaykv.fidelity.traces import PATHS, decode
from replaykv.model.cache_view import CacheView
from replaykv.model.spec import ModelSpec
from replaykv.replay import CacheState, plan_prefill
from replaykv.train.evaluate import wilson


def turn_bounds(length: int, turns: int, alignment: int = 2) -> list[int]:
    """`turns` boundaries splitting [0, length) into near-equal turns, each aligned down."""
    if turns < 1 or turns > length // max(1, alignment):
        raise ValueError(f"cannot split {length} tokens into {turns} aligned turns")
    bounds = [length * (k + 1) // turns // alignment * alignment for k in range(turns - 1)]
    return [*bounds, length]


def _stored(view: CacheView, spec: ModelSpec, tokens: int) -> list[torch.Tensor]:
    """The compressed entries and index keys of every owning layer for the groups complete
    within [0, tokens) (layers reading another's entries share that layer's tensor)."""
    out: list[torch.Tensor] = []
    for layer, ls in zip(view.layers, spec.layers, strict=True):
        if ls.ratio <= 0:
            continue
        groups = tokens // ls.ratio
        for t in (layer.entries, layer.index_keys):
            if t is not None and groups:
                out.append(t[0, :groups].float())
    return out


def _rel(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    num = sum(float((g - r).pow(2).sum()) for g, r in zip(got, ref, strict=True))
    den = sum(float(r.pow(2).sum()) for r in ref)
    return (num / den) ** 0.5 if den > 0 else 0.0


def session(
    model: Any,
    ids: list[int],
    bounds: list[int],
    keep_snapshot: bool,
    answer: tuple[int, ...] = (),
    replay_span: int | None = None,
) -> dict[str, Any]:
    """Run the session of `ids` in turns ending at `bounds` and compare each turn with one-pass
    prefill (decoder replay off on both sides, so that only the encoder's state can drift)."""
    spec = ModelSpec.from_config(model.config)
    device = next(model.parameters()).device
    dtype = model.model.embed_tokens.weight.dtype
    flags = PATHS["bounded"].flags(replay_span)
    x = torch.tensor([ids], dtype=torch.long, device=device)
    extra = len(answer)
    one = allocate_view(spec, 1, len(ids) + extra, device, dtype)
    ref_logits = execute(model, plan_prefill(CacheState(tokens=len(ids)), spec, flags), x, one)[0].float()
    ref_lp = torch.log_softmax(ref_logits, dim=-1).cpu()
    view = allocate_view(spec, 1, len(ids) + extra, device, dtype)
    turns: list[dict[str, Any]] = []
    prev = 0
    last = torch.empty(0)
    for k, end in enumerate(bounds):
        if prev and not keep_snapshot:
            drop_snapshot(view, seed=k)
        state = CacheState(tokens=end, global_hit=prev, snapshot_at=(prev,) if keep_snapshot and prev else ())
        plan = plan_prefill(state, spec, flags)
        logits = execute(model, plan, x[:, :end], view)[0].float()
        last = torch.log_softmax(logits[-1], dim=-1).cpu()
        ref = ref_lp[end - 1]
        kl = float((ref.exp() * (ref - last)).sum().clamp_min(0.0))
        turns.append(
            {
                "turn": k + 1,
                "tokens": end,
                "path": plan.path,
                "global_kv_rel_error": _rel(_stored(view, spec, end), _stored(one, spec, end)),
                "kl_last_row": kl,
                "top1_last_row": bool(int(ref.argmax()) == int(last.argmax())),
            }
        )
        prev = end
    result: dict[str, Any] = {"keep_snapshot": keep_snapshot, "turns_detail": turns}
    if answer:
        result["answer_turns"] = _teacher_forced(model, view, last, answer)
        result["answer_one_pass"] = _teacher_forced(model, one, ref_lp[-1], answer)
    return result


def _teacher_forced(model: Any, view: CacheView, last: torch.Tensor, answer: tuple[int, ...]) -> bool:
    """Every answer token the argmax, feeding the answer (the view stands at the prompt's end)."""
    rows, _ = decode(model, view, last, list(answer), 0)
    return all(int(r.argmax()) == t for r, t in zip(rows, answer, strict=True))


def drift_study(
    model: Any,
    heldout: Any,
    lengths: tuple[int, ...],
    families: tuple[str, ...],
    count: int,
    turns: tuple[int, ...],
    replay_span: int | None = None,
    progress: Any = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Sessions of each prompt in each number of turns, with the snapshot missed and hit every
    turn; per-turn medians and last-turn answer accuracy against one pass."""
    spec = ModelSpec.from_config(model.config)
    window = replay_span or spec.sliding_window
    t0 = time.perf_counter()
    sessions: list[dict[str, Any]] = []
    for length in lengths:
        for family in families:
            for p in prompts(heldout, family, length, count, window):
                for k in turns:
                    bounds = turn_bounds(length, k, spec.group_alignment)
                    for keep in (False, True):
                        r = session(model, list(p.ids), bounds, keep, p.answer, replay_span)
                        sessions.append({"length": length, "family": family, "prompt": p.index, "turns": k, **r})
                if progress is not None:
                    progress(f"drift {length} {family} #{p.index}: {time.perf_counter() - t0:.0f} s")
    per: dict[tuple[int, bool, int], list[dict[str, Any]]] = defaultdict(list)
    for s in sessions:
        for t in s["turns_detail"]:
            per[(s["turns"], s["keep_snapshot"], t["turn"])].append(t)
    per_turn = [
        {
            "turns": k,
            "keep_snapshot": keep,
            "turn": turn,
            "rel_error": bootstrap_median([t["global_kv_rel_error"] for t in ts], seed=seed),
            "kl": bootstrap_median([t["kl_last_row"] for t in ts], seed=seed),
            "top1": bootstrap_median([float(t["top1_last_row"]) for t in ts], seed=seed),
        }
        for (k, keep, turn), ts in sorted(per.items())
    ]
    answers = []
    for k in turns:
        for keep in (False, True):
            ss = [s for s in sessions if s["turns"] == k and s["keep_snapshot"] == keep and "answer_turns" in s]
            base = [bool(s["answer_one_pass"]) for s in ss]
            cand = [bool(s["answer_turns"]) for s in ss]
            answers.append(
                {
                    "turns": k,
                    "keep_snapshot": keep,
                    "one_pass": wilson(sum(base), len(base)),
                    "in_turns": wilson(sum(cand), len(cand)),
                    "vs_one_pass": paired_difference(base, cand, seed),
                }
            )
    return {"seconds": time.perf_counter() - t0, "sessions": sessions, "per_turn": per_turn, "answers": answers}
