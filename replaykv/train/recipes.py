"""The named training recipes: `tiny` (seconds, for tests), `small` (the shipped base model) and
`adapt` (the replay-adaptation phase that starts from `small`'s export). Everything that changes
the numbers lives here or in the types of :mod:`replaykv.train.recipe_spec` (re-exported here), so
`replaykv train --recipe small` is the whole specification. Not for: running anything (see
:mod:`replaykv.train.loop`).
"""

from __future__ import annotations

from replaykv.train.eval_spec import BarSpec, EvalSpec
from replaykv.train.recipe_spec import Continuation, Mixture, Paths, Phase, Recipe
from replaykv.train.recipes_continued import SMALL_CONTINUATIONS

__all__ = [
    "RECIPES",
    "BarSpec",
    "Continuation",
    "EvalSpec",
    "Mixture",
    "Paths",
    "Phase",
    "Recipe",
    "adapt",
    "get_recipe",
    "small",
    "tiny",
]


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
# multi-hop lookups and variable chains stayed at chance, one-link lookups too (5 of 20 held-out
# cases with one link and four distractors, chance 4; a pass key is found by its fixed phrase, a
# link only by its random code). So lookup rows join (a dozen answered questions about links per
# row) and multi-hop and chain rows go from a quarter of the mixture to over a third, taken from
# passkey, text and copy rows.
TASK_MIXTURE = Mixture(
    text=0.12, passkey=0.22, multihop=0.2, chain=0.18, extract=0.03, tool=0.03, copy=0.07, lookup=0.15
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
    15-26  150-800 each, one continuation phase apiece         8 × 512, then with
           (:mod:`replaykv.train.recipes_continued`)           4 × 1,024 and 2 × 2,048
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
            # the last phase of the first plan, then the task phase (the same row shapes)
            _mixed("lengths", steps=1050, seq_len=4096, batch=2, cycle=LENGTHS_CYCLE, prompt_from=0.25),
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
        continuations=SMALL_CONTINUATIONS,
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
