"""Does a lookup question's attention follow the asked code through the compressed entries?

    python scripts/probe_attention.py replaykv/weights/small --length 512 --cases 12

For held-out one-link lookup prompts (scripts/probe_lookups.py's first cell: its filler, seed and
records `A -> B`), the question's code is set to each record's own code in turn, the prompt is
prefilled, and at its last position each layer that reads compressed entries is measured: the
attention mass (the largest over heads) on the entries that cover each record's answer code B,
out of one softmax over the window, the sink and the visible (or selected) entries, as the layer
computes it. Only records that end before the question's window are counted, so that the
entries are the one way to them. A layer that finds a record by its code puts more mass on it
when its code is asked than when another record's is: the two means and their ratio are printed
per layer. A ratio near 1 means the layer reads records by their place or kind, not their code.
`--part code` measures the mass on each record's own code A instead, `--part record` on the
whole record `A -> B`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from replaykv.cache.views import allocate_view
from replaykv.model.checkpoint import load_model
from replaykv.model.compressor import causal_entry_limit, ordered_ring
from replaykv.model.spec import ModelSpec
from replaykv.train.data import load_corpus

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_lookups import CELLS, cases_of

ARROW = list(b" -> ")
CODE = 4  # characters of a record's code (replaykv.train.tasks' multi-hop records)
# [lo, hi) of each part of a record `A -> B`, from its first byte
PARTS = {
    "answer": (CODE + len(ARROW), 2 * CODE + len(ARROW)),
    "code": (0, CODE),
    "record": (0, 2 * CODE + len(ARROW)),
}


class LastRowAttention:
    """Forward hooks on every attention block with compressed entries: after each call, the
    last row's attention probabilities over the entries and the entry ids (`rows`), and over
    [window | sink | entries] with the window keys' positions (`joint`, read by `mass`)."""

    def __init__(self, model: Any) -> None:
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor, int, int]] = {}
        self.joint: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = {}
        self.handles = [
            layer.self_attn.register_forward_hook(self._hook)
            for layer in model.model.layers
            if getattr(layer.self_attn, "ratio", 0)
        ]

    def _hook(self, attn: Any, args: tuple[Any, ...], output: torch.Tensor) -> None:
        x, step, cache, selection = args[:4]
        s, w, d = x.shape[1], attn.window, attn.head_dim
        with torch.no_grad():
            tables = (t[:1, -1:] for t in step.rope.heads(attn.rope_kind))
            q = attn.queries(x[:1, -1:], *tables)[1][0, 0].float()  # [H, D]
            window = ordered_ring(cache.window[:1], step.start[:1] + s, w)[0].float()  # [W, D]
            visible = int(causal_entry_limit(step.positions[:1, -1], attn.ratio)[0])
            ids = torch.arange(visible, device=x.device)
            if selection.topk is not None:
                chosen = selection.topk[0, -1]
                ids = chosen[chosen >= 0]
            entries = cache.entries[0, ids].float()
            logits = torch.cat([q @ window.T, attn.sinks.float()[:, None] * d**0.5, q @ entries.T], 1)
            probs = torch.softmax(logits * d**-0.5, dim=1)  # [H, W + 1 + k]
        self.rows[attn.layer] = (probs[:, w + 1 :], ids, attn.ratio, w)
        last = int(step.positions[0, -1])
        window_pos = torch.arange(last - w + 1, last + 1, device=x.device)
        self.joint[attn.layer] = (probs, window_pos, ids, attn.ratio)

    def mass(self, layer: int, lo: int, hi: int) -> torch.Tensor:
        """[H]: the last row's mass on positions [lo, hi) in `layer`, the window's keys there and
        the entries that overlap them."""
        probs, window_pos, ids, r = self.joint[layer]
        w = len(window_pos)
        in_window = (window_pos >= lo) & (window_pos < hi)
        covers = (ids * r + r > lo) & (ids * r < hi)
        return probs[:, :w][:, in_window].sum(1) + probs[:, w + 1 :][:, covers].sum(1)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def records_before_window(prompt: list[int], window: int) -> list[int]:
    """Start of each record `A -> B` whose last byte lies before the question's window."""
    n = len(prompt)
    starts = [i - CODE for i in range(CODE, n - CODE) if prompt[i : i + len(ARROW)] == ARROW]
    return [r for r in starts if r + 2 * CODE + len(ARROW) <= n - window]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--cases", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--part", choices=tuple(PARTS), default="answer", help="which part of each record")
    args = p.parse_args()
    part_lo, part_hi = PARTS[args.part]
    torch.set_num_threads(args.threads)
    model = load_model(args.model).float().eval()
    spec = ModelSpec.from_config(model.config)
    window = model.config.sliding_window
    label, task, controls, _ = CELLS[0]
    cases = cases_of(task, controls, args.length, args.cases, load_corpus()["heldout"])
    probe = LastRowAttention(model)
    asked: dict[int, list[float]] = {}
    other: dict[int, list[float]] = {}
    prompts = 0
    for case in cases:
        prompt = list(case.prompt)
        records = records_before_window(prompt, window)
        code_at = len(prompt) - 3 - CODE  # the question ends "from CODE:" then two special tokens
        if len(records) < 2 or prompt[code_at - 5 : code_at] != list(b"from "):
            continue
        prompts += 1
        mass: dict[int, np.ndarray] = {}
        for a, start in enumerate(records):
            ids = prompt[:code_at] + prompt[start : start + CODE] + prompt[code_at + CODE :]
            view = allocate_view(spec, 1, len(ids) + 1, torch.device("cpu"), torch.float32)
            with torch.no_grad():
                model(torch.tensor([ids]), view, logits_rows="last")
            for layer, (probs, entry_ids, ratio, _) in probe.rows.items():
                first = entry_ids * ratio  # an entry covers positions [first, first + ratio)
                m = mass.setdefault(layer, np.zeros((len(records), len(records))))
                for b, rec in enumerate(records):
                    cover = (first + ratio > rec + part_lo) & (first < rec + part_hi)
                    m[a, b] = probs[:, cover].sum(1).max().item()
        for layer, m in mass.items():
            k = len(records)
            asked.setdefault(layer, []).append(float(np.trace(m)) / k)
            other.setdefault(layer, []).append(float(m.sum() - np.trace(m)) / (k * k - k))
    probe.remove()
    print(
        f"{label} @ {args.length}: {prompts} prompts, records before the window asked in turn; part: {args.part}"
    )
    print("layer  mass on the asked record  on another record  ratio")
    for layer in sorted(asked):
        x, y = float(np.mean(asked[layer])), float(np.mean(other[layer]))
        print(f"{layer:5d}  {x:24.3f}  {y:16.3f}  {x / max(y, 1e-9):5.2f}")


if __name__ == "__main__":
    main()
