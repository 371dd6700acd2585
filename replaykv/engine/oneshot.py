"""One request at a time: chunked prefill, teacher-forced scoring and greedy generation.

The smallest correct way to run the model over a cache view; the batching engine builds on the
same calls. Not for: scheduling several requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from replaykv.cache.views import advance, allocate_view
from replaykv.model.cache_view import CacheView
from replaykv.model.spec import ModelSpec
from replaykv.model.v4 import DeepseekV4ForCausalLM


def prefill(
    model: DeepseekV4ForCausalLM,
    ids: torch.Tensor,
    view: CacheView,
    chunk: int | None = None,
    logits_rows: str = "all",
    on_logits: Callable[[torch.Tensor], None] | None = None,
    spans: Sequence[tuple[int, torch.Tensor]] = (),
) -> torch.Tensor:
    """Run ids [B, S] in chunks of `chunk` tokens, advancing the view; returns the last chunk's logits.

    With on_logits, every chunk's logits are handed over as they come (for scoring long inputs).
    `spans`: image spans of a one-row input (first position, span vectors), placed in every chunk.
    """
    s = ids.shape[1]
    step = s if not chunk or chunk <= 0 else chunk
    logits = torch.empty(0)
    with torch.inference_mode():
        for i in range(0, s, step):
            part = ids[:, i : i + step]
            rows = logits_rows if (on_logits is not None or i + step >= s) else "none"
            logits = model(part, view, logits_rows=rows, spans=spans) if spans else model(part, view, logits_rows=rows)
            advance(view, part.shape[1])
            if on_logits is not None:
                on_logits(logits)
    return logits


def score(
    model: DeepseekV4ForCausalLM,
    ids: list[int],
    chunk: int | None = None,
    spans: Sequence[tuple[int, torch.Tensor]] = (),
) -> torch.Tensor:
    """Teacher-forced float32 logits [S, vocab] of one sequence (its image spans placed)."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    view = allocate_view(ModelSpec.from_config(model.config), 1, len(ids), device, _cache_dtype(model))
    parts: list[torch.Tensor] = []
    prefill(model, x, view, chunk, on_logits=lambda lg: parts.append(lg[0].float().cpu()), spans=spans)
    return torch.cat(parts, dim=0)


def greedy_generate(
    model: DeepseekV4ForCausalLM,
    ids: list[int],
    max_new_tokens: int,
    chunk: int | None = None,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """Greedy continuation of `ids` (new token ids only)."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    view = allocate_view(
        ModelSpec.from_config(model.config), 1, len(ids) + max_new_tokens, device, _cache_dtype(model)
    )
    logits = prefill(model, x, view, chunk, logits_rows="last")
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            nxt = int(logits[0, -1].argmax().item())
            out.append(nxt)
            if nxt in stop_ids:
                break
            logits = model(torch.tensor([[nxt]], device=device), view, logits_rows="last")
            advance(view, 1)
    return out


def _cache_dtype(model: DeepseekV4ForCausalLM) -> torch.dtype:
    return model.model.embed_tokens.weight.dtype
