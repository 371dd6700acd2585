"""The continuation stages of `small` (stages 15 on; :class:`replaykv.train.recipe_spec.Continuation`):
after its task phase, each stage is one phase from the previous stage's checkpoint, at a
constant 5e-4 or cooling down on a cosine (stages 25 on), on a mixture aimed at what the bar
still missed (why each, and what it scored, in docs/training.md, "Continuation stages"). Each
was first run as an arm of
scripts/pilot_lookups.py, which builds the same one-phase recipe (`Recipe.continued`), with the
seed given here. Not for: the recipe's own stages (:mod:`replaykv.train.recipes`).
"""

from __future__ import annotations

from typing import Any

from replaykv.train.recipe_spec import Continuation, Mixture, Phase

# Every continuation's settings that do not change from stage to stage.
CONTINUATION_LR = 5e-4
CONTINUATION_WARMUP = 10
# The rows of the first continuations (8 × 512 a step), then short and long rows in turn.
SHORT_ROWS: tuple[tuple[int, int, int | None], ...] = ((512, 8, 8),)
TWO_SHAPES: tuple[tuple[int, int, int | None], ...] = ((512, 8, 8), (1024, 4, 4))
THREE_SHAPES: tuple[tuple[int, int, int | None], ...] = ((512, 8, 8), (1024, 4, 4), (2048, 2, 2))
LONG_ROWS: tuple[tuple[int, int, int | None], ...] = ((1024, 4, 4), (2048, 2, 2))
# The evidence-attention loss's rows: lookups in programs, latest assignments, chain statements,
# then the traced multi-hop answers' records and recall blocks as well.
STATEMENT_ROWS = ("program", "recency", "chain")
KEYED_ROWS = ("multihop", "recall", "program", "recency", "chain")


def _stage(
    name: str,
    steps: int,
    seed: int,
    mixture: Mixture,
    cycle: tuple[tuple[int, int, int | None], ...] = SHORT_ROWS,
    evidence_rows: tuple[str, ...] = STATEMENT_ROWS,
    evidence_layers: tuple[int, ...] = (3,),
    evidence: bool = True,
    min_lr: float | None = None,
    lr: float = CONTINUATION_LR,
) -> Continuation:
    """A continuation with the task phase's answer and copy weights (50 and 5), prompts from a
    quarter of the row, top-512 selection and, with `evidence`, the contrastive evidence loss
    at weight 5 on the last 4 bytes of each record (the value or code an answer copies); with
    `min_lr`, the rate (`lr`) cools down to it on a cosine."""
    phase = Phase(
        name,
        steps=steps,
        seq_len=cycle[0][0],
        batch=cycle[0][1],
        cycle=cycle,
        mixture=mixture,
        answer_weight=50.0,
        copy_weight=5.0,
        prompt_from=0.25,
        index_topk=512,
        evidence_loss=5.0 if evidence else 0.0,
        evidence_contrast=evidence,
        evidence_rows=evidence_rows if evidence else ("lookup",),
        evidence_tail=4 if evidence else 0,
        evidence_layers=evidence_layers if evidence else (),
    )
    return Continuation(phase, lr, seed, CONTINUATION_WARMUP, min_lr)


def _mix(alphabet: str = "letters", hops: bool = False, chains: bool = False, **weights: float) -> Mixture:
    """A mixture of the named row kinds alone (the others at 0)."""
    kinds: dict[str, Any] = {k: 0.0 for k in Mixture().weights}
    kinds.update(weights)
    return Mixture(**kinds, trace_hops=hops, trace_chains=chains, copy_alphabet=alphabet)


SMALL_CONTINUATIONS: tuple[Continuation, ...] = (
    # 15: repeat and copy rows in both alphabets (stage 14 copied lower case at chance)
    _stage(
        "lower_repeat",
        600,
        2023,
        _mix(repeat=0.35, copy=0.25, passkey=0.15, multihop=0.1, text=0.15),
        evidence=False,
    ),
    # 16: chains answered with the lines behind the value, evidence on the statements
    _stage(
        "lower_chains",
        800,
        2024,
        _mix(
            "lower",
            chains=True,
            repeat=0.25,
            copy=0.1,
            chain=0.2,
            recency=0.15,
            program=0.1,
            passkey=0.1,
            text=0.1,
        ),
        evidence_layers=(),
    ),
    # 17-20: the evidence loss in layer 3 alone, chains weighted up, then 1K rows beside 512
    _stage(
        "layer3_w5",
        150,
        2025,
        _mix("lower", chains=True, chain=0.3, recency=0.2, program=0.15, copy=0.1, passkey=0.1, text=0.15),
    ),
    _stage(
        "chain_focus",
        400,
        2027,
        _mix("lower", chains=True, chain=0.35, recency=0.15, program=0.1, copy=0.05, passkey=0.15, text=0.2),
    ),
    _stage(
        "chain_focus2",
        600,
        2028,
        _mix("lower", chains=True, chain=0.35, recency=0.15, program=0.1, copy=0.1, passkey=0.15, text=0.15),
    ),
    _stage(
        "chain_focus3",
        450,
        2029,
        _mix("lower", chains=True, chain=0.35, recency=0.15, program=0.1, copy=0.1, passkey=0.15, text=0.15),
        cycle=TWO_SHAPES,
    ),
    # 21: traced multi-hop and recall rows beside the chains, rows up to 2K
    _stage(
        "chain_hops",
        700,
        2030,
        _mix(
            "lower",
            hops=True,
            chains=True,
            chain=0.25,
            recency=0.1,
            program=0.05,
            copy=0.05,
            multihop=0.2,
            recall=0.05,
            passkey=0.15,
            text=0.15,
        ),
        cycle=THREE_SHAPES,
        evidence_rows=KEYED_ROWS,
    ),
    # 22: copy rows in both alphabets again (the codes' copy had worn off)
    _stage(
        "codes_back",
        200,
        2032,
        _mix(
            hops=True,
            chains=True,
            copy=0.15,
            repeat=0.05,
            multihop=0.25,
            recall=0.05,
            chain=0.2,
            recency=0.05,
            passkey=0.15,
            text=0.1,
        ),
        cycle=THREE_SHAPES,
        evidence_rows=KEYED_ROWS,
    ),
    # 23: pass-key rows up to a quarter (keys had fallen to 14 of 18), no recency rows
    _stage(
        "keys_back",
        500,
        2033,
        _mix(
            hops=True,
            chains=True,
            copy=0.12,
            repeat=0.03,
            multihop=0.25,
            recall=0.05,
            chain=0.2,
            passkey=0.25,
            text=0.1,
        ),
        cycle=THREE_SHAPES,
        evidence_rows=KEYED_ROWS,
    ),
    # 24: pass keys at a third of the rows, and rows of 1K and 2K only (keys at 2K had fallen to 52%)
    _stage(
        "keys_long",
        500,
        2034,
        _mix(
            hops=True,
            chains=True,
            passkey=0.35,
            multihop=0.2,
            chain=0.15,
            copy=0.1,
            repeat=0.02,
            recall=0.05,
            text=0.13,
        ),
        cycle=LONG_ROWS,
        evidence_rows=KEYED_ROWS,
    ),
    # 25: the rate cooled down to a tenth over 300 steps, every row kind of the last stages at once
    _stage(
        "cool_down",
        300,
        2035,
        _mix(
            hops=True,
            chains=True,
            passkey=0.3,
            multihop=0.2,
            chain=0.2,
            copy=0.1,
            repeat=0.02,
            recall=0.05,
            text=0.13,
        ),
        cycle=THREE_SHAPES,
        evidence_rows=KEYED_ROWS,
        min_lr=5e-5,
    ),
    # 26: a second, shorter cool-down from a fifth of the rate, pass keys up, rows of 1K and 2K
    _stage(
        "keys_cool",
        150,
        2036,
        _mix(
            hops=True,
            chains=True,
            passkey=0.35,
            multihop=0.2,
            chain=0.2,
            copy=0.08,
            repeat=0.02,
            recall=0.05,
            text=0.1,
        ),
        cycle=LONG_ROWS,
        evidence_rows=KEYED_ROWS,
        min_lr=1e-5,
        lr=1e-4,
    ),
)
