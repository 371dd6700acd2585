"""What a training recipe is, as frozen dataclasses: the data mixture, the forward paths that carry
loss, the phases, the held-out evaluation, the shipping bar and the recipe itself (the named
recipes are in :mod:`replaykv.train.recipes`).

A recipe is a list of phases (data shape, mixture, which forward paths carry loss) under one
learning-rate schedule (linear warmup, cosine to `min_lr`), plus the optimiser,
the auxiliary losses, and the held-out evaluation the model card reports (its specs in
:mod:`replaykv.train.eval_spec`). After its own stages a recipe may go on in continuation
stages (`Continuation`): each one a phase of its own, run from the previous stage's checkpoint
as a one-phase recipe (`Recipe.continued`). Not for: running anything (see
:mod:`replaykv.train.loop` and :mod:`replaykv.train.continuation`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, replace

from replaykv.train.eval_spec import BarSpec, EvalSpec

# `Mixture.copy_alphabet`'s choices: the keys of replaykv.train.rows.COPY_ALPHABETS.
COPY_ALPHABET_NAMES = ("codes", "letters", "lower")


@dataclass(frozen=True)
class Mixture:
    """Sampling weights of the row kinds (normalised when sampled) and, for text rows, the share
    of prose (docstrings) versus code. `copy` rows are text with random strings repeated later in
    the row (see :func:`replaykv.train.rows.copy_row`): dense copy targets at distances inside
    and beyond the window, the skill every retrieval task is built on. `repeat` rows are one
    random string repeated to fill the row (see :func:`replaykv.train.rows.repeat_row`):
    nothing but in-window copying, for a first phase that forms the copying circuit. `lookup` rows
    hold link records and, after them, questions in the multi-hop task's words with their answers
    (see :func:`replaykv.train.rows.lookup_row`): many lookups by a random key per row. `recall`
    rows hold blocks of records each followed by one- and two-link questions inside one window
    (see :func:`replaykv.train.rows.recall_row`). `program` rows hold blocks of short chain
    programs each followed by one question with its traced answer inside one window (see
    :func:`replaykv.train.rows.program_row`); `recency` rows the same with programs that assign
    names again and again, the question the latest assignment (its `recency` form)."""

    text: float = 0.45
    passkey: float = 0.15
    multihop: float = 0.12
    chain: float = 0.10
    extract: float = 0.09
    tool: float = 0.09
    copy: float = 0.0
    repeat: float = 0.0
    lookup: float = 0.0
    recall: float = 0.0
    program: float = 0.0
    recency: float = 0.0
    prose_fraction: float = 0.3
    # Lookup rows in segments of this many bytes, one chain each (0: records in the row's first
    # half, questions after; see replaykv.train.rows.lookup_row).
    lookup_segment: int = 0
    # Multi-hop task rows answer with every code reached, `2: B (1) -> C (0)` (tasks.multihop's
    # `trace`): one lookup per hop instead of two composed in one forward pass; recall rows
    # answer the same way (replaykv.train.rows.traced_recall_row).
    trace_hops: bool = False
    # Chain task rows answer with the lines behind the value, `q = y = x = 123`
    # (replaykv.train.tasks.chain's `trace`).
    trace_chains: bool = False
    # The copy and repeat rows' strings: "codes" (upper case and digits), "letters" (lower case
    # too) or "lower" (lower case alone; replaykv.train.rows.COPY_ALPHABETS).
    copy_alphabet: str = "codes"

    def __post_init__(self) -> None:
        if min(self.weights.values()) < 0 or sum(self.weights.values()) <= 0:
            raise ValueError("mixture weights must be non-negative and not all zero")
        if not 0 <= self.prose_fraction <= 1:
            raise ValueError("prose_fraction must be in [0, 1]")
        if self.lookup_segment < 0:
            raise ValueError("lookup_segment must not be negative")
        if self.copy_alphabet not in COPY_ALPHABET_NAMES:
            raise ValueError(
                f"copy_alphabet must be one of {COPY_ALPHABET_NAMES}, not {self.copy_alphabet!r}"
            )

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
            "lookup": self.lookup,
            # last: zero weights at the end leave earlier phases' draws as they were
            "recall": self.recall,
            "program": self.program,
            "recency": self.recency,
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
    `copy_weight`: the loss weight of a copy row's repeated bytes (after each repeat's first)
    and of a lookup row's answers.
    `cycle`: row shapes (seq_len, batch, micro_batch) taken in turn, one per step (step k of the
    phase uses entry k mod len(cycle)), so that one phase keeps short rows beside long ones and a
    model trained on long rows still sees many short prompts; empty: every step is seq_len ×
    batch. `prompt_from`: the shortest prompt as a share of the row (at least W + 1 tokens; the
    longest leaves the answer budget). `index_topk`: how many compressed entries each indexer
    selects during the phase (None: the preset's; it shapes no parameter, and a stage checkpoint
    written in the phase records it in its config). `evidence_loss`: the weight of the
    evidence-attention loss on lookup rows' one-link questions (0: off; see
    :mod:`replaykv.train.evidence`); `evidence_contrast`: its contrastive form, the asked record
    against the row's other records instead of against every entry; `evidence_rows`: the row
    kinds whose questions it reads (`lookup`: a lookup row's one-link questions; `multihop`: a
    multi-hop task row's question, its evidence the record of the last link, every record of
    the prompt its rivals (with `Mixture.trace_hops`, each hop's code in the answer, its
    evidence that hop's record); `chain`: with `Mixture.trace_chains`, each name or value of a
    chain row's answer, its evidence the value of the line that gives it (`v` of `x = v`), every
    statement's value its rivals; `recall`: a recall row's one-link questions; `program` /
    `recency`: each name or value of a program (recency) row's answers, its evidence the value
    of the line that gives it, the block's lines' values its rivals);
    `evidence_tail`: 0, each record counts whole; n > 0, by its last n bytes only (4: a record `A -> B`'s answer
    code B); `evidence_layers`: the layers it teaches
    (empty: every layer that reads compressed entries); `evidence_keyed_layers`: the layers it
    teaches on the questions whose records are keyed by a code (`lookup`, `multihop`, `recall`
    records `A -> B`), the other questions (a chain's statements, a traced answer's counts)
    keeping `evidence_layers` (None: `evidence_layers` for all; empty: every layer that reads
    compressed entries); `evidence_clip`: 0, its gradient joins the
    rest under the one `Recipe.grad_clip`; > 0, it is clipped apart to this norm and added to the
    rest clipped to `Recipe.grad_clip` (see :mod:`replaykv.train.step`). `record_keys`: the weight
    of the record-key loss on the same rows' records (0: off; see :mod:`replaykv.train.keys`);
    `record_key_layers`: the KV sources it reads (empty: every one). `lr`: a constant learning
    rate for the phase's steps, reached over the recipe's `rewarmup` steps from the rate before
    it (None: the recipe's schedule), for phases added after the schedule has ended."""

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
    evidence_loss: float = 0.0
    evidence_contrast: bool = False
    evidence_rows: tuple[str, ...] = ("lookup",)
    evidence_tail: int = 0
    evidence_layers: tuple[int, ...] = ()
    evidence_keyed_layers: tuple[int, ...] | None = None
    evidence_clip: float = 0.0
    record_keys: float = 0.0
    record_key_layers: tuple[int, ...] = ()
    lr: float | None = None

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
        if not self.evidence_loss >= 0:
            raise ValueError(f"phase {self.name}: evidence_loss must not be negative")
        if not set(self.evidence_rows) <= {"lookup", "multihop", "recall", "chain", "program", "recency"}:
            raise ValueError(
                f"phase {self.name}: evidence_rows are lookup, multihop, recall, chain, program and/or recency rows"
            )
        if self.evidence_tail < 0:
            raise ValueError(f"phase {self.name}: evidence_tail must not be negative")
        if any(i < 0 for i in self.evidence_layers + (self.evidence_keyed_layers or ())):
            raise ValueError(f"phase {self.name}: evidence_layers are layer indices")
        if not self.evidence_clip >= 0:
            raise ValueError(f"phase {self.name}: evidence_clip must not be negative")
        if not self.record_keys >= 0:
            raise ValueError(f"phase {self.name}: record_keys must not be negative")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"phase {self.name}: lr must be positive")

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
class Continuation:
    """A stage after a recipe's own (`Recipe.continuations`): `phase`, trained from the previous
    stage's checkpoint (its bf16 export, router biases as exported) with fresh AdamW moments, the
    rate warmed up linearly over `warmup` steps to `lr` and kept there (with `min_lr`: then a
    cosine down to `min_lr` at the phase's last step, a cool-down), its rows drawn with
    `seed` from the phase's step 0 (a seed of its own: rows the earlier stages did not read). A
    machine with no state thus runs exactly what a machine with the previous stage's state
    runs: a continuation stage always starts cold. `seed` also seeds torch's generator."""

    phase: Phase
    lr: float
    seed: int
    warmup: int = 10
    min_lr: float | None = None

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"continuation {self.phase.name}: lr must be positive")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"continuation {self.phase.name}: min_lr must lie in [0, lr]")
        if not 0 <= self.warmup < self.phase.steps:
            raise ValueError(f"continuation {self.phase.name}: warmup must be shorter than the phase")
        if self.phase.lr is not None:
            raise ValueError(f"continuation {self.phase.name}: its rate is `lr`, not Phase.lr")


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
    # Stages after the recipe's own, each run as a recipe of its own (`continued`) from the
    # previous stage's checkpoint; stage numbers go on from the last of `stage_ends`.
    continuations: tuple[Continuation, ...] = ()

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
    def stage_count(self) -> int:
        """Stages in all: the recipe's own and its continuations."""
        return len(self.stage_ends) + len(self.continuations)

    @property
    def final_step(self) -> int:
        """The global step at the end of the last stage, continuations included."""
        return self.total_steps + sum(c.phase.steps for c in self.continuations)

    def continued(self, index: int) -> Recipe:
        """Continuation `index` (0-based; stage ``len(stage_ends) + index + 1``) as a one-phase
        recipe of its own: this recipe's optimiser, losses and settings, the continuation's
        phase, rate, warmup, seed and decay (none without `min_lr`), no evaluation, bar or package directory of its
        own. `replaykv.train.loop.train` runs it from the previous stage's checkpoint (`init`)."""
        c = self.continuations[index]
        return replace(
            self,
            name=f"{self.name}-stage{len(self.stage_ends) + index + 1}",
            phases=(c.phase,),
            lr=c.lr,
            min_lr=c.lr if c.min_lr is None else c.min_lr,
            warmup=c.warmup,
            decay_end=None,
            stages=(),
            quick_eval=None,
            final_eval=None,
            bar=None,
            init_from=self.name,
            ship_as=None,
            eval_every=0,
            seed=c.seed,
            continuations=(),
        )

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
        constant); in a phase with its own `Phase.lr`, that rate, ramped linearly over `rewarmup`
        steps from the rate of the step before the phase."""
        start = 0
        for p in self.phases:
            if step < start + p.steps or p is self.phases[-1]:
                break
            start += p.steps
        if p.lr is not None:
            if start == 0:  # a first phase: the recipe's warmup to its own rate
                return p.lr * min(1.0, (step + 1) / max(1, self.warmup))
            if step - start >= self.rewarmup:
                return p.lr
            before = self.lr_at(start - 1)
            return before + (p.lr - before) * (step - start + 1) / (self.rewarmup + 1)
        return self._scheduled(step)

    def _scheduled(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        end = min(self.total_steps, self.decay_end or self.total_steps)
        t = (step - self.warmup) / max(1, end - 1 - self.warmup)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * min(1.0, t)))

    def digest(self) -> str:
        """The recipe's own stages (a continuation stage records `continued(i).digest()`)."""
        fields = asdict(self)
        del fields["continuations"]
        for phase in fields["phases"]:  # a phase without keyed layers keeps its earlier digest
            if phase["evidence_keyed_layers"] is None:
                del phase["evidence_keyed_layers"]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
