"""Training recipes as frozen dataclasses: `tiny` (seconds, for tests), `small` (the shipped base
model) and `adapt` (the replay-adaptation phase that starts from `small`'s export).

A recipe is a list of phases (data shape, mixture, which forward paths carry loss) under one
learning-rate schedule (linear warmup, cosine to `min_lr` over all phases), plus the optimiser,
the auxiliary losses, and the held-out evaluation the model card reports. Everything that
changes the numbers lives here, so `replaykv train --recipe small` is the whole specification.
Not for: running anything (see :mod:`replaykv.train.loop`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, replace


@dataclass(frozen=True)
class Mixture:
    """Sampling weights of the row kinds (normalised when sampled) and, for text rows, the share
    of prose (docstrings) versus code. `copy` rows are text with random strings repeated later in
    the row (see :func:`replaykv.train.data.copy_row`): dense copy targets at distances inside
    and beyond the window, the skill every retrieval task is built on. `repeat` rows are one
    random string repeated to fill the row (see :func:`replaykv.train.data.repeat_row`):
    nothing but in-window copying, for a first phase that forms the copying circuit."""

    text: float = 0.45
    passkey: float = 0.15
    multihop: float = 0.12
    chain: float = 0.10
    extract: float = 0.09
    tool: float = 0.09
    copy: float = 0.0
    repeat: float = 0.0
    prose_fraction: float = 0.3

    def __post_init__(self) -> None:
        if min(self.weights.values()) < 0 or sum(self.weights.values()) <= 0:
            raise ValueError("mixture weights must be non-negative and not all zero")
        if not 0 <= self.prose_fraction <= 1:
            raise ValueError("prose_fraction must be in [0, 1]")

    @property
    def weights(self) -> dict[str, float]:
        return {
            "text": self.text,
            "passkey": self.passkey,
            "multihop": self.multihop,
            "chain": self.chain,
            "extract": self.extract,
            "tool": self.tool,
            "copy": self.copy,
            "repeat": self.repeat,
        }


@dataclass(frozen=True)
class Paths:
    """Which forward paths carry loss in a step (architecture §6, §13).

    full: weight of the full path (every layer over every row). decoder_replay: weight of the
    follow-up under decoder replay (decoder layers over the last W prompt rows and the answer).
    bounded_prob: probability that a step's follow-up also uses encoder bounded replay at a
    random cut (snapshot missing; the global KV of [0, cut) from the full forward).
    boundary_prob: probability that a task row puts its evidence just before the replay boundary
    s = cut - W (only in steps with a cut).
    """

    full: float = 1.0
    decoder_replay: float = 0.0
    bounded_prob: float = 0.0
    boundary_prob: float = 0.0

    def __post_init__(self) -> None:
        if self.full < 0 or self.decoder_replay < 0 or self.full + self.decoder_replay <= 0:
            raise ValueError("path weights must be non-negative and not both zero")
        if self.bounded_prob > 0 and self.decoder_replay <= 0:
            raise ValueError("bounded_prob needs decoder_replay > 0 (the follow-up carries the loss)")


@dataclass(frozen=True)
class Phase:
    """`steps` optimiser steps of `batch` sequences of `seq_len` tokens, accumulated over
    micro-batches of `micro_batch` sequences (memory only: the gradient is the same up to float
    summation order; None: the whole batch at once). `answer_weight`: the loss weight of a task's
    answer (and train-span) tokens relative to a text token; a batch of 8 × 1,024 holds about
    5,000 text targets and 100 answer tokens, so at 1 the tasks are about 2% of the loss.
    `copy_weight`: the loss weight of a copy row's repeated bytes (after each repeat's first).
    `cycle`: row shapes (seq_len, batch, micro_batch) taken in turn, one per step (step k of the
    phase uses entry k mod len(cycle)), so that one phase keeps short rows beside long ones and a
    model trained on long rows still sees many short prompts; empty: every step is seq_len ×
    batch. `prompt_from`: the shortest prompt as a share of the row (at least W + 1 tokens; the
    longest leaves the answer budget). `index_topk`: how many compressed entries each indexer
    selects during the phase (None: the preset's; it shapes no parameter, and a stage checkpoint
    written in the phase records it in its config)."""

    name: str
    steps: int
    seq_len: int
    batch: int
    mixture: Mixture = field(default_factory=Mixture)
    paths: Paths = field(default_factory=Paths)
    micro_batch: int | None = None
    answer_weight: float = 1.0
    copy_weight: float = 1.0
    cycle: tuple[tuple[int, int, int | None], ...] = ()
    prompt_from: float = 0.5
    index_topk: int | None = None

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch < 1:
            raise ValueError(f"phase {self.name}: steps and batch must be positive")
        if any(n < 1 or b < 1 or (m is not None and m < 1) for n, b, m in self.cycle):
            raise ValueError(f"phase {self.name}: every shape of the cycle needs positive sizes")
        if not 0 < self.prompt_from <= 1:
            raise ValueError(f"phase {self.name}: prompt_from must be in (0, 1]")
        if self.index_topk is not None and self.index_topk < 1:
            raise ValueError(f"phase {self.name}: index_topk must be positive")
        if not self.answer_weight > 0:
            raise ValueError(f"phase {self.name}: answer_weight must be positive")
        if not self.copy_weight > 0:
            raise ValueError(f"phase {self.name}: copy_weight must be positive")

    def at(self, k: int) -> Phase:
        """The shape of the phase's step k (0-based within the phase): itself without a cycle,
        else the cycle's entry k mod its length, as a phase without a cycle."""
        if not self.cycle:
            return self
        seq_len, batch, micro = self.cycle[k % len(self.cycle)]
        return replace(self, seq_len=seq_len, batch=batch, micro_batch=micro, cycle=())

    @property
    def tokens(self) -> int:
        """Tokens over all the phase's steps."""
        if not self.cycle:
            return self.steps * self.batch * self.seq_len
        return sum(self.at(k).batch * self.at(k).seq_len for k in range(self.steps))

    def describe(self) -> str:
        """The row shapes in words: '8 × 512' or '8 × 1,024 / 4 × 2,048 in turn'."""
        shapes = [(n, b) for n, b, _ in self.cycle] or [(self.seq_len, self.batch)]
        return " / ".join(f"{b} × {n:,}" for n, b in shapes) + (" in turn" if self.cycle else "")


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
    as (label, tokens); a tokens value above W puts it before the question's window."""

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

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Recipe:
    name: str
    preset: str
    phases: tuple[Phase, ...]
    lr: float
    min_lr: float
    warmup: int
    weight_decay: float = 0.1
    # Learning-rate factor of the mHC mixing parameters (no weight decay). Each post-mix logit is
    # a dot product over hc_mult × hidden inputs, so at the full rate Adam can move it by ~2 per
    # step: at 1.0 the `small` run had shut 11 of its 24 branches (post mix 2·sigmoid < 0.12)
    # by step 700.
    hc_lr_scale: float = 0.1
    # Standard deviation of a fresh model's token embeddings (other matrices keep 0.02): at 0.02
    # a V4.1 stack did not learn to copy in context; why 1.0, in docs/training.md.
    embed_std: float = 1.0
    # Draw both halves of each attention's grouped output projection (`o_a_proj`, `o_b_proj`)
    # at 1/sqrt(fan-in) instead of 0.02: at 0.02 a V4.1 attention did not learn to copy in
    # context; why, in docs/training.md.
    o_proj_fan_in: bool = True
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 1234
    indexer_loss: float = 1.0  # KL of the indexer scores to the main attention (DSA-style)
    indexer_rows: int = 64  # query rows per index layer and call that the KL is computed on
    router_bias_rate: float = 1e-3  # aux-loss-free balancing: bias step per optimiser step
    answer_budget: int = 96  # tokens kept after a task prompt for the answer
    eval_every: int = 250
    checkpoint_every: int = 50
    log_every: int = 10
    quick_eval: EvalSpec | None = None
    final_eval: EvalSpec | None = None
    bar: BarSpec | None = None  # the shipping bar (see replaykv.train.bar); None: no rung
    corpus_files: int | None = None  # None: every stdlib file
    init_from: str | None = None  # recipe whose export initialises this one (--init DIR)
    # Global steps at which the stages end (increasing, the last one `total_steps`; empty: one
    # stage). At a stage's end the loop writes a stage checkpoint (bf16 export + stage.json),
    # the unit that is committed and from which a machine without the full state continues.
    stages: tuple[int, ...] = ()
    # After a cold resume (weights from a stage checkpoint, fresh AdamW moments) the schedule's
    # rate is ramped linearly over this many steps, so the empty moments do not take full steps.
    rewarmup: int = 25
    # The step at which the cosine reaches `min_lr` (None, or past the last step: the last step);
    # later steps keep `min_lr`, so a recipe extended past its first plan keeps the rates of its
    # earlier steps.
    decay_end: int | None = None
    # Package directory (under replaykv/weights/) that this recipe's stage checkpoints go to.
    ship_as: str | None = None

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("a recipe needs at least one phase")
        if not 0 <= self.warmup < self.total_steps:
            raise ValueError("warmup must be shorter than the recipe")
        if self.min_lr > self.lr:
            raise ValueError("min_lr must not exceed lr")
        if not self.hc_lr_scale > 0:
            raise ValueError("hc_lr_scale must be positive")
        if not self.embed_std > 0:
            raise ValueError("embed_std must be positive")
        ends = self.stage_ends
        if any(b <= a for a, b in zip((0, *ends), ends, strict=False)) or ends[-1] != self.total_steps:
            raise ValueError("stages must be increasing step numbers ending at the recipe's last step")
        if self.rewarmup < 0:
            raise ValueError("rewarmup must not be negative")
        if self.decay_end is not None and not self.decay_end > self.warmup:
            raise ValueError("decay_end must lie after the warmup")

    @property
    def stage_ends(self) -> tuple[int, ...]:
        """The global step at which each stage ends (one stage when `stages` is empty)."""
        return self.stages or (self.total_steps,)

    def stage_at(self, step: int) -> int:
        """The 1-based stage that optimiser step `step` (0-based) belongs to."""
        for i, end in enumerate(self.stage_ends):
            if step < end:
                return i + 1
        return len(self.stage_ends)

    @property
    def total_steps(self) -> int:
        return sum(p.steps for p in self.phases)

    @property
    def total_tokens(self) -> int:
        return sum(p.tokens for p in self.phases)

    def phase_at(self, step: int) -> Phase:
        """The phase that optimiser step `step` (0-based) belongs to, with that step's row shape
        (see `Phase.cycle`)."""
        for p in self.phases:
            if step < p.steps:
                return p.at(step)
            step -= p.steps
        last = self.phases[-1]
        return last.at(last.steps - 1)

    def lr_at(self, step: int) -> float:
        """Linear warmup to `lr`, then cosine to `min_lr` at the last step (or `decay_end`, then
        constant)."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        end = min(self.total_steps, self.decay_end or self.total_steps)
        t = (step - self.warmup) / max(1, end - 1 - self.warmup)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * min(1.0, t)))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


# 4,000-token prompts cost about 1.2 s per case and path on 2 cores, so the final evaluation
# (180 cases on the full path and at three cut offsets) takes about 15 minutes there.
_SMALL_EVAL = EvalSpec(
    prompt_len=4000,
    cases=20,
    passkey_depths=(0.0, 0.25, 0.5, 0.75, 1.0),
    passkey_per_depth=20,
    offsets=(0, 128, 256),
    text_sequences=32,
    text_len=1024,
)
_SMALL_QUICK = EvalSpec(
    prompt_len=896,
    cases=8,
    passkey_depths=(0.0, 0.5, 1.0),
    passkey_per_depth=3,
    offsets=(),
    text_sequences=4,
    text_len=1024,
)


def tiny() -> Recipe:
    """A few seconds on a CPU: the test-suite recipe (tiny preset, short sequences)."""
    mix = Mixture(text=0.4, passkey=0.2, multihop=0.15, chain=0.15, extract=0.0, tool=0.0, copy=0.1)
    spec = EvalSpec(
        prompt_len=144,
        cases=2,
        passkey_depths=(0.0, 1.0),
        passkey_per_depth=1,
        offsets=(0, 8),
        text_sequences=2,
        text_len=64,
        batch=2,
    )
    return Recipe(
        name="tiny",
        preset="v41-tiny",
        phases=(Phase("base", steps=12, seq_len=128, batch=4, mixture=mix),),
        lr=3e-3,
        min_lr=3e-4,
        warmup=2,
        seed=0,
        indexer_rows=8,
        answer_budget=16,
        eval_every=6,
        checkpoint_every=6,
        log_every=1,
        quick_eval=spec,
        final_eval=spec,
        corpus_files=60,
    )


TASK_ANSWER_WEIGHT = 50.0  # a task answer token weighs 50 text tokens (Phase.answer_weight)
COPY_WEIGHT = 5.0  # a copy row's repeated byte weighs 5 (Phase.copy_weight)
SMALL_MIXTURE = Mixture(
    text=0.20, passkey=0.35, multihop=0.15, chain=0.10, extract=0.03, tool=0.03, copy=0.14
)


# The first phase: repeat rows alone, 8 × 256 tokens. The whole `small` model, fresh, trained on
# a string repeated to fill the row fell from 3.3 nats per copied byte (chance for its 26
# letters) to 2.35 by step 300 at 2e-3 (50 warmup steps); in the mixture, where copy targets
# are ~2% of the tokens, copying had not started by step 300 (see docs/training.md).
INDUCTION_STEPS = 400
INDUCTION_MIXTURE = Mixture(
    text=0.0, passkey=0.0, multihop=0.0, chain=0.0, extract=0.0, tool=0.0, copy=0.0, repeat=1.0
)


def _mixed(
    name: str,
    steps: int,
    seq_len: int,
    batch: int,
    micro_batch: int | None = None,
    paths: Paths | None = None,
    cycle: tuple[tuple[int, int, int | None], ...] = (),
    prompt_from: float = 0.5,
    index_topk: int | None = None,
    mixture: Mixture = SMALL_MIXTURE,
) -> Phase:
    """A phase of a `small` mixture with the task-answer and copy weights."""
    return Phase(
        name,
        steps=steps,
        seq_len=seq_len,
        batch=batch,
        micro_batch=micro_batch,
        paths=paths or Paths(),
        cycle=cycle,
        prompt_from=prompt_from,
        index_topk=index_topk,
        mixture=mixture,
        answer_weight=TASK_ANSWER_WEIGHT,
        copy_weight=COPY_WEIGHT,
    )


# Stage boundaries of `small`, each sized for at most 100 minutes of 2 CPU cores (measured step
# times: 8 × 256 about 2.5 s, 8 × 512 about 4.5 s, 8 × 1,024 about 10.5 s, 4 × 2,048 and
# 2 × 4,096 about 11-12 s; docs/training.md has the times each stage took).
SMALL_STAGES = (700, 1800, 2600, 3050, 3500, 3950, 4250, 4550, 4850, 5150, 5450, 5750, 6050, 6350)
# The cosine ends here, where the first plan of `small` ended; the task phase after it keeps
# `min_lr`.
SMALL_DECAY_END = 4550
# The task phase: at step 3950 pass keys were retrieved at every depth of 1K and 2K prompts while
# multi-hop lookups and variable chains stayed at chance, so multi-hop and chain rows go from a
# quarter of the mixture to almost half, taken from passkey, text and copy rows.
TASK_MIXTURE = Mixture(
    text=0.15, passkey=0.25, multihop=0.25, chain=0.20, extract=0.03, tool=0.03, copy=0.09
)
# The last phase's rows, one shape per step in turn (8,192 tokens each): after 4K rows alone
# (2 a step, so 0.7 pass-key cases a step against 2.8 at 8 × 1,024) held-out keys beyond the
# window fell at 1,024 and 2,048 tokens between steps 3500 and 4250 (docs/training.md).
LENGTHS_CYCLE: tuple[tuple[int, int, int | None], ...] = ((1024, 8, 4), (2048, 4, 2), (4096, 2, 1))
# Steps 0-3500 selected the top-64 compressed entries per query; from the last phase on, the
# preset's 512 (see presets_v41.v41_small: with 64 the selection, not the attention, lost keys).
SMALL_EARLY_TOPK = 64


def small() -> Recipe:
    """The shipped base model, trained in stages of at most 100 minutes on 2 CPU cores, each
    ending in a committed checkpoint that the next stage continues from (on another machine too):

    =====  ==================================================  ====================
    stage  steps                                               rows
    =====  ==================================================  ====================
    1      400 repeat rows (the copying circuit), 300 mixture  8 × 256, 8 × 512
    2      1,100 mixture                                       8 × 512
    3      500 + 300 mixture                                   8 × 512, 8 × 1,024
    4      150 + 300 mixture                                   8 × 1,024, 4 × 2,048
    5      150 + 300 mixture                                   4 × 2,048, 2 × 4,096
    6-8    450, 300 and 300 mixture                            8 × 1,024 / 4 × 2,048 /
                                                               2 × 4,096 in turn
    9-14   300 each of the task mixture at `min_lr`            the same in turn
    =====  ==================================================  ====================

    Rung 1 (pass keys at every depth of 1K and 2K contexts) is within reach after stage 4, rung 2
    (4K) after the later ones. A third of the rows are passkey cases and task answers weigh 50
    times a text token: in a run with passkey rows at 18% of the mixture every task still scored
    0 after 364 mixture steps, and from that state a mixture with 45% passkey rows reached 12 of
    16 held-out keys at 400 tokens within 225 steps (docs/training.md). One row in seven is a
    copy row from the first mixture step: a run without copy rows, with task answers at weight 1
    for its first 550 steps and the mHC mixes at the full learning rate, could not yet copy a
    repeated digit string inside its window at step 700. A run with them but its embeddings and
    output projections at 0.02 (see `Recipe.embed_std`, `Recipe.o_proj_fan_in`) could not copy
    inside its window at step 800."""
    return Recipe(
        name="small",
        preset="v41-small",
        phases=(
            Phase(
                "induction",
                steps=INDUCTION_STEPS,
                seq_len=256,
                batch=8,
                mixture=INDUCTION_MIXTURE,
                copy_weight=COPY_WEIGHT,
                index_topk=SMALL_EARLY_TOPK,
            ),
            _mixed("base", steps=1900, seq_len=512, batch=8, index_topk=SMALL_EARLY_TOPK),
            _mixed("1k", steps=450, seq_len=1024, batch=8, micro_batch=4, index_topk=SMALL_EARLY_TOPK),
            _mixed("2k", steps=450, seq_len=2048, batch=4, micro_batch=2, index_topk=SMALL_EARLY_TOPK),
            _mixed("4k", steps=300, seq_len=4096, batch=2, micro_batch=1, index_topk=SMALL_EARLY_TOPK),
            _mixed(
                "lengths",
                steps=1050,
                seq_len=4096,
                batch=2,
                cycle=LENGTHS_CYCLE,
                prompt_from=0.25,
                index_topk=None,
            ),
            _mixed(
                "tasks",
                steps=1800,
                seq_len=4096,
                batch=2,
                cycle=LENGTHS_CYCLE,
                prompt_from=0.25,
                mixture=TASK_MIXTURE,
            ),
        ),
        lr=2e-3,
        min_lr=2e-4,
        warmup=100,
        decay_end=SMALL_DECAY_END,
        quick_eval=_SMALL_QUICK,
        final_eval=_SMALL_EVAL,
        stages=SMALL_STAGES,
        ship_as="small",
        bar=BarSpec(extra_lengths=(8192, 16384)),
    )


def adapt() -> Recipe:
    """Replay adaptation from `small`'s export: 120 steps of 8 × 512 tokens where every step
    trains the full path (weight 0.5) and the follow-up under decoder replay, half of them also
    with encoder bounded replay at a random cut (evidence just before the boundary 30% of the
    time), as DeepSeek did in post-training."""
    paths = Paths(full=0.5, decoder_replay=1.0, bounded_prob=0.5, boundary_prob=0.3)
    return Recipe(
        name="adapt",
        preset="v41-small",
        phases=(_mixed("adapt", steps=120, seq_len=512, batch=8, paths=paths),),
        lr=3e-4,
        min_lr=3e-5,
        warmup=10,
        seed=4321,
        quick_eval=_SMALL_QUICK,
        final_eval=_SMALL_EVAL,
        init_from="small",
        ship_as="small-adapted",
        bar=BarSpec(),
    )


RECIPES = {"tiny": tiny, "small": small, "adapt": adapt}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {sorted(RECIPES)}")
    return RECIPES[name]()
