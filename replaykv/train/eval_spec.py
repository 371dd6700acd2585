"""What a recipe's evaluations are, as frozen dataclasses: the held-out evaluation the model
card reports (`EvalSpec`) and the shipping bar a stage checkpoint is scored on (`BarSpec`; run by
:mod:`replaykv.train.bar`). Not for: running them (see :mod:`replaykv.train.evaluate`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class EvalSpec:
    """Held-out evaluation: bits per byte on `text_sequences` windows of `text_len` bytes, and
    per-task exact match on prompts of `prompt_len` tokens (passkey: `passkey_per_depth` cases at
    each depth; other tasks `cases`), on the full path and with bounded replay at cut points
    `offsets` tokens after the evidence (empty: full path only)."""

    prompt_len: int
    cases: int
    passkey_depths: tuple[float, ...]
    passkey_per_depth: int
    offsets: tuple[int, ...]
    text_sequences: int
    text_len: int
    batch: int = 4
    seed: int = 99991

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class BarSpec:
    """Lengths of each rung, the pass-key depths, cases per cell and the bounded-replay offsets.
    `tail_depths`: the key's evidence ends this many tokens before the prompt's end, each given
    as (label, tokens); a tokens value above W puts it before the question's window.
    `trace_hops`: the multi-hop cell's answers name every code reached (`2: B (1) -> C (0)`, as rows of
    `Mixture.trace_hops` teach), scored by exact match of the whole answer; its chance stays
    the last code's. `trace_chains`: the chain cell's answers write the lines behind the value
    (`q = y = x = 123`, `Mixture.trace_chains`), the same way."""

    rung1_lengths: tuple[int, ...] = (1024, 2048)
    rung2_lengths: tuple[int, ...] = (4096,)
    extra_lengths: tuple[int, ...] = ()  # measured, not part of a rung (8K, 16K)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75)
    tail_depths: tuple[tuple[str, int], ...] = (("before last W", 140), ("inside last W", 60))
    cases: int = 40
    offsets: tuple[int, ...] = (0, 128)
    pass_rate: float = 0.95
    batch: int = 4
    seed: int = 77773
    trace_hops: bool = False
    trace_chains: bool = False

    def digest(self) -> str:
        fields = asdict(self)
        for name in ("trace_hops", "trace_chains"):  # a bar without them keeps its earlier digest
            if not fields[name]:
                del fields[name]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
