"""One prompt, one cut, every path: next-token distributions along the exact path's greedy
continuation, and how each replay path departs from them.

Rows are indexed by position r: the distribution of row r is the model's prediction of token
r + 1. For a prompt [0, S) cached up to `cut` by an earlier request, the rows compared are the
follow-up's prompt rows [cut, S - 1) that the path computes (decoder replay computes only the
last W) and the continuation rows [S - 1, S - 1 + C): the last prompt row, then C - 1 decode
steps that feed the exact path's greedy tokens (teacher forcing). Until a path's argmax first
differs from the exact token its free greedy continuation is the exact one, so the first
disagreement in the continuation rows is where its greedy generation would first diverge.

The paths (architecture reference §13):

    exact      decoder replay off, snapshot hit: every layer over every row, equal to a cold
               prefill of [0, S); the reference, independent of the cut
    bounded    encoder bounded replay of [cut - W, cut) (snapshot missing), decoder replay off
    decoder    decoder replay on (the decoder layers run the last W prompt rows), snapshot hit
    both       encoder bounded replay and decoder replay
    recovery   snapshot missing, rebuilt by the exact strategy: must equal `exact`
    broken     bounded replay with the deliberate fault "window_untruncated": must not

Not for: choosing prompts or aggregating (see :mod:`replaykv.fidelity.study`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from replaykv.cache.views import advance
from replaykv.engine.scenario import follow_up
from replaykv.replay import ReplayFlags


@dataclass(frozen=True)
class PathSpec:
    """How a follow-up request is served: decoder replay on or off, whether the window snapshot
    at the cut is still in the pool, the miss strategy, a deliberate fault (tests only)."""

    decoder_replay: bool
    keep_snapshot: bool
    miss_strategy: str = "bounded"
    fault: str | None = None

    def flags(self, replay_span: int | None = None) -> ReplayFlags:
        return ReplayFlags(
            enable_decoder_swa_bounded_replay=self.decoder_replay,
            swa_miss_strategy=self.miss_strategy,
            replay_span=replay_span,
        )


PATHS: dict[str, PathSpec] = {
    "exact": PathSpec(decoder_replay=False, keep_snapshot=True),
    "bounded": PathSpec(decoder_replay=False, keep_snapshot=False),
    "decoder": PathSpec(decoder_replay=True, keep_snapshot=True),
    "both": PathSpec(decoder_replay=True, keep_snapshot=False),
    "recovery": PathSpec(decoder_replay=False, keep_snapshot=False, miss_strategy="exact"),
    "broken": PathSpec(decoder_replay=False, keep_snapshot=False, fault="window_untruncated"),
}
REPLAY_PATHS = ("bounded", "decoder", "both")


@dataclass
class Trace:
    """Log-probabilities [R, vocab] of rows [first_row, first_row + R) (NaN rows: not computed)
    and the tokens the continuation rows were fed or chose."""

    first_row: int
    logprobs: torch.Tensor
    continuation: list[int]


def decode(model: Any, view: Any, last: torch.Tensor, feed: list[int], greedy: int) -> tuple[list[torch.Tensor], list[int]]:
    """Decode from the view left after a prefill whose last row's logits are `last` [vocab]:
    feed `feed` (teacher forcing) or, when it is empty, `greedy` argmax tokens. Returns the
    rows' logits (the last prefill row first) and the tokens fed after each."""
    device = next(model.parameters()).device
    rows, tokens = [last], []
    steps = len(feed) if feed else greedy
    with torch.inference_mode():
        for j in range(steps):
            tok = feed[j] if feed else int(rows[-1].argmax())
            tokens.append(tok)
            if j == steps - 1:
                break
            out = model(torch.tensor([[tok]], device=device), view, logits_rows="last")
            advance(view, 1)
            rows.append(out[0, -1].float().cpu())
    return rows, tokens


def trace(
    model: Any,
    ids: list[int],
    cut: int,
    path: str,
    continuation: int | list[int],
    replay_span: int | None = None,
) -> Trace:
    """The rows [cut, S - 1 + C) of `path` for the prompt `ids` cut at `cut`. `continuation`: a
    number of greedy tokens to generate (the exact path's own continuation) or the tokens to
    feed (another path, teacher-forced on the exact continuation)."""
    spec = PATHS[path]
    feed = continuation if isinstance(continuation, list) else []
    n = continuation if isinstance(continuation, int) else len(continuation)
    if n < 1:
        raise ValueError("the continuation needs at least one token")
    logits, _, view = follow_up(
        model, ids, cut, spec.flags(replay_span), spec.keep_snapshot, capacity=n, fault=spec.fault
    )
    decoded, tokens = decode(model, view, logits[-1], feed, n)
    rows = torch.cat([logits[:-1], torch.stack(decoded)], dim=0)
    return Trace(cut, torch.log_softmax(rows, dim=-1), tokens)


def compare(exact: Trace, other: Trace, prompt_len: int) -> dict[str, Any]:
    """How `other` departs from `exact` on the rows both computed: KL(exact ‖ other) and top-1
    agreement per row, the first continuation row whose argmax differs from the exact token
    (None: none within the continuation), and summaries over prompt and continuation rows."""
    lo = other.first_row
    ref = exact.logprobs[lo - exact.first_row :]
    got = other.logprobs
    if ref.shape != got.shape:
        raise ValueError(f"traces cover different rows: {tuple(ref.shape)} vs {tuple(got.shape)}")
    valid = torch.isfinite(got).all(dim=-1) & torch.isfinite(ref).all(dim=-1)
    kl = torch.where(valid, (ref.exp() * (ref - got)).sum(dim=-1).clamp_min(0.0), torch.nan)
    agree = ref.argmax(dim=-1) == got.argmax(dim=-1)
    cont0 = prompt_len - 1 - lo  # the index of row S - 1
    chosen = torch.tensor(exact.continuation)
    differs = (got[cont0:].argmax(dim=-1) != chosen).nonzero()
    first = int(differs[0, 0]) if differs.numel() else None

    def part(mask: torch.Tensor) -> dict[str, float]:
        m = mask & valid
        if not bool(m.any()):
            return {"rows": 0, "kl_mean": math.nan, "kl_max": math.nan, "top1": math.nan}
        return {
            "rows": int(m.sum()),
            "kl_mean": float(kl[m].mean()),
            "kl_max": float(kl[m].max()),
            "top1": float(agree[m].float().mean()),
        }

    index = torch.arange(got.shape[0])
    return {
        "kl": [None if math.isnan(v) else v for v in kl.tolist()],
        "first_row": lo,
        "prompt": part(index < cont0),
        "continuation": part(index >= cont0),
        "first_divergence": first,
        "continuation_len": len(exact.continuation),
    }
