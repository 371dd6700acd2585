"""The matrix as concrete prompts: cells, and per cell the cases with their cut points.

A :class:`Cell` is one combination of task, cut position, context length, uncached suffix and
output length. A :class:`Case` is one prompt of a cell: the token ids a request sends (and its
images), the cut H (the cached prefix [0, H) an earlier request leaves), the shifted cuts of the
"shift" state, the answer and how to score it. Prompts come from the held-out generators of
:mod:`replaykv.train.tasks` (filler from the held-out split of the corpus), seeded from the
contract's seed and the cell, so a contract always runs the same prompts.

The image suffix: the task's turn with its reference answer, then a user turn holding a
generated picture (:mod:`replaykv.pictures`) and its question::

    task prompt ... <|assistant|> answer <|end|> <|user|> [image] × span question <|end|> <|assistant|>
    [0, turn_end) first turn                      [turn_end, S) the image turn (uncached at cut "end")

The span's positions carry the model's ``image_token_id`` and the request carries the prepared
image (:class:`~replaykv.images.PromptImage`). No trained model reads images, so image cases
are not scored for task success (their outcome is None); the harness compares them with the
baseline's cold path (KL, top-1 agreement, exact outputs) like every other case. A cut or a
shifted cut never falls inside an image span (an earlier request cannot have ended there).

Cut positions (W = the model's sliding window, S = the prompt length, e = evidence end):
    end            S minus the suffix (short: the question turn; empty: the last token only,
                   which is always computed; long: a tool-result-sized tail); for multi_turn
                   and the image suffix, the end of the first turn
    start          64 (the replay span reaches the beginning of the prompt)
    window_before  W - 1;  window_after  W + 1 (either side of the span's clamp at 0)
    boundary       e + W: the evidence ends exactly where the bounded-replay span begins

Not for: running the prompts (see :mod:`replaykv.accept.run`).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from replaykv.accept.contract import Contract, ContractError, Matrix
from replaykv.images import PromptImage, prepare_image
from replaykv.pictures import Picture, draw_picture
from replaykv.train.evaluate import eval_controls
from replaykv.train.tasks import TASKS, TOKENIZER, Filler, TaskSample, generate, one_insert_prompt, score

END_ID = TOKENIZER.special_ids["<|end|>"]
STOP_IDS = (END_ID, TOKENIZER.eos_id)
FOLLOW_UP = [
    TOKENIZER.special_ids["<|user|>"],
    *b"Say the answer again.",
    END_ID,
    TOKENIZER.special_ids["<|assistant|>"],
]


_WORDS = ("alpha", "bravo", "delta", "limit", "quota", "depth", "ratio", "offset", "budget", "window")


def code_edit(
    rng: np.random.Generator, filler: Filler, prompt_len: int, evidence_end: int | None = None
) -> TaskSample | None:
    """Code modification: a function with a constant sits in held-out code; the question asks to
    change the constant and write the changed line (exact match; chance ~1/9000). The shipped
    model is not trained on this task: it measures whether replay changes what a model does with
    code it must find and edit, for a model that can."""
    fn = f"{_WORDS[int(rng.integers(len(_WORDS)))]}_{int(rng.integers(100, 1000))}"
    var = _WORDS[int(rng.integers(len(_WORDS)))] + "_max"
    old, new = (int(v) for v in rng.choice(np.arange(1000, 10000), size=2, replace=False))
    snippet = f"\ndef {fn}(items):\n    {var} = {old}\n    return [x for x in items if x < {var}]\n".encode()
    intro = b"Here is some code.\n"
    question = f"\nIn {fn}, change {var} from {old} to {new}. Write the changed line."
    built = one_insert_prompt(
        rng, filler, prompt_len, intro, question, snippet, None, evidence_end, prose=False
    )
    if built is None:
        return None
    ids, evidence, _, _ = built
    answer_text = f"{var} = {new}"
    return TaskSample(
        "code_edit", tuple(ids), (*answer_text.encode(), END_ID), answer_text, evidence, 1 / 9000
    )


ACCEPT_TASKS = (*TASKS, "code_edit")
"""The training tasks plus code modification (generated here only: not in the training mixture)."""


@dataclass(frozen=True)
class Cell:
    task: str
    cut: str
    length: int
    suffix: str
    output: str

    @property
    def key(self) -> str:
        return f"{self.task}/{self.cut}/{self.length}/{self.suffix}/{self.output}"

    @property
    def scored(self) -> bool:
        """Whether task success is measured (image cells: agreement with the baseline only)."""
        return self.suffix != "image"


@dataclass(frozen=True)
class ImageSetup:
    """What the image suffix needs from the model: its image path's settings and the token id
    every span position carries."""

    vision: Any  # replaykv.model.vision.DeepseekV41VisionConfig
    image_token_id: int

    @classmethod
    def from_config(cls, config: Any) -> ImageSetup | None:
        """The setup of a model config; None when the model has no vision tower."""
        vision = getattr(config, "vision_config", None)
        if vision is None:
            return None
        return cls(vision, int(config.image_token_id))


@dataclass(frozen=True)
class Case:
    cell: Cell
    index: int
    prompt: tuple[int, ...]
    cut: int
    shifts: tuple[tuple[str, int], ...]
    sample: TaskSample
    max_tokens: int
    ignore_eos: bool
    evidence: tuple[int, int]
    images: tuple[PromptImage, ...] = ()
    picture: Picture | None = None  # the image suffix's picture (question and expected answer)

    @property
    def id(self) -> str:
        return f"{self.cell.key}#{self.index}"

    @property
    def offset(self) -> int:
        """Tokens from the end of the evidence to the cut (negative: the cut is before it)."""
        return self.cut - self.evidence[1]

    def images_before(self, cut: int) -> tuple[PromptImage, ...]:
        """The images of the prefix [0, cut) (a cut never splits a span)."""
        return tuple(im for im in self.images if im.end <= cut)


def cells(matrix: Matrix) -> list[Cell]:
    """Every cell of the matrix, in a fixed order."""
    dims: tuple[tuple[Any, ...], ...] = (matrix.cuts, matrix.lengths, matrix.suffixes, matrix.outputs)
    out: list[Cell] = []
    for task in matrix.tasks:
        if matrix.design == "factorial":
            combos: list[tuple[Any, ...]] = list(itertools.product(*dims))
        else:
            base = tuple(d[0] for d in dims)
            combos = [base]
            for i, d in enumerate(dims):
                for v in d[1:]:
                    combos.append((*base[:i], v, *base[i + 1 :]))
        out += [Cell(task, c, n, s, o) for c, n, s, o in combos]
    return out


def _suffix_len(cell: Cell, m: Matrix) -> int:
    # "empty": everything but the last prompt token, which every engine computes (its logits
    # start decoding), so a fully cached prompt is a hit at S - 1
    return {"short": m.short_suffix, "empty": 1, "long": m.long_suffix}.get(cell.suffix, 0)


def _cut(cell: Cell, m: Matrix, s_len: int, evidence_end: int, turn_end: int | None, window: int) -> int:
    if cell.cut == "end":
        h = turn_end if turn_end is not None else s_len - _suffix_len(cell, m)
    elif cell.cut == "start":
        h = 64
    elif cell.cut == "window_before":
        h = window - 1
    elif cell.cut == "window_after":
        h = window + 1
    else:  # boundary
        h = evidence_end + window
    return int(min(max(h, 1), s_len))


def _inside(h: int, spans: tuple[tuple[int, int], ...]) -> tuple[int, int] | None:
    """The span (start, end) that a cut at h would split, if any."""
    return next(((a, b) for a, b in spans if a < h < b), None)


def _shifts(
    cut: int, s_len: int, m: Matrix, chunk: int, spans: tuple[tuple[int, int], ...] = ()
) -> tuple[tuple[str, int], ...]:
    out: dict[int, str] = {}
    for d in m.shifts:
        h = cut + d
        if 1 <= h <= s_len and h != cut and _inside(h, spans) is None:
            out.setdefault(h, f"{d:+d}")
    if m.chunk_shifts:
        up = (cut // chunk + 1) * chunk + 1
        down = (cut // chunk) * chunk - 1
        for h, label in ((up, "chunk+1"), (down, "chunk-1")):
            if 1 <= h <= s_len and h != cut and _inside(h, spans) is None:
                out.setdefault(h, label)
    return tuple((label, h) for h, label in sorted(out.items()))


def build_cases(
    contract: Contract, filler: Filler, window: int, images: ImageSetup | None = None
) -> list[Case]:
    """The cases of every cell (prompts that cannot be built at a length are skipped with the
    generator's own rule; the report counts cases per cell). `images`: the model's image setup,
    required when the matrix has the image suffix."""
    m = contract.matrix
    if "image" in m.suffixes and images is None:
        raise ContractError(
            "matrix.suffixes has 'image' but the model has no vision tower (its config has no "
            "vision_config); run image cases on a vision model or remove 'image' from matrix.suffixes"
        )
    out: list[Case] = []
    for ci, cell in enumerate(cells(m)):
        for i in range(m.prompts_per_cell):
            case = _build_case(contract, cell, ci, i, filler, window, images)
            if case is not None:
                out.append(case)
    return out


def image_turn(picture: Picture, setup: ImageSetup) -> tuple[list[int], PromptImage]:
    """``<|user|> [image] × span question <|end|> <|assistant|>`` and the image placed at offset
    1 of it (the caller moves it to where the turn starts)."""
    prepared = prepare_image(picture.pixels, setup.vision)
    ids = [
        TOKENIZER.special_ids["<|user|>"],
        *([setup.image_token_id] * prepared.span_length),
        *picture.question.encode(),
        END_ID,
        TOKENIZER.special_ids["<|assistant|>"],
    ]
    return ids, PromptImage(1, prepared)


def _build_case(contract: Contract, cell: Cell, ci: int, i: int, filler: Filler, window: int,
                setup: ImageSetup | None = None) -> Case | None:  # fmt: skip
    m = contract.matrix
    multi = cell.output == "multi_turn"
    picture: Picture | None = None
    turn: list[int] = []
    placed: PromptImage | None = None
    if cell.suffix == "image":
        if setup is None:
            raise ContractError("the image suffix needs a model with a vision tower")
        picture = draw_picture(np.random.default_rng([contract.sampling.seed, ci, i, 1 << 20]))
        turn, placed = image_turn(picture, setup)
    controls: dict[str, Any] = dict(eval_controls(cell.task, window))
    length = cell.length
    for attempt in range(8):
        rng = np.random.default_rng([contract.sampling.seed, ci, i, attempt])
        n = length
        if picture is not None:
            n -= len(turn) + m.max_answer_tokens  # room for the answer and the image turn
        elif multi:
            n -= len(FOLLOW_UP) + m.max_answer_tokens  # room for the answer and the follow-up
        if cell.cut == "boundary" and cell.task in ("passkey", "multihop", "chain", "extract", "code_edit"):
            # put the evidence so that the cut e + W lands before the question
            controls["evidence_end"] = max(window, n - m.short_suffix - window - 8)
        if cell.task == "code_edit":
            sample = code_edit(rng, filler, n, controls.get("evidence_end"))
        else:
            sample = generate(cell.task, rng, filler, n, **controls)
        if sample is None or len(sample.answer) > m.max_answer_tokens:
            controls.pop("evidence_end", None)
            continue
        prompt = list(sample.prompt)
        turn_end = None
        images: tuple[PromptImage, ...] = ()
        if placed is not None:
            prompt += list(sample.answer)
            turn_end = len(prompt)
            images = (PromptImage(turn_end + placed.start, placed.image),)
            prompt += turn
        elif multi:
            prompt += list(sample.answer)
            turn_end = len(prompt)
            prompt += FOLLOW_UP
        s_len = len(prompt)
        spans = tuple((im.start, im.end) for im in images)
        cut = _cut(cell, m, s_len, sample.evidence[1], turn_end, window)
        split = _inside(cut, spans)
        if split is not None:
            cut = split[0]  # an earlier request ends before the image, not inside it
        if cell.output == "long":
            max_tokens, ignore_eos = m.long_tokens, True
        else:
            expected = len(picture.answer) + 1 if picture is not None else len(sample.answer)
            max_tokens, ignore_eos = min(m.max_answer_tokens, expected + 2), False
        return Case(
            cell=cell,
            index=i,
            prompt=tuple(prompt),
            cut=cut,
            shifts=_shifts(cut, s_len, m, contract.chunk_size, spans),
            sample=sample,
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
            evidence=sample.evidence,
            images=images,
            picture=picture,
        )
    return None


def answer_text(ids: list[int]) -> str:
    """The generated answer: the text before the first end-of-turn or end-of-text token."""
    end = next((k for k, t in enumerate(ids) if t in STOP_IDS), len(ids))
    return TOKENIZER.decode(ids[:end])


def outcome(case: Case, ids: list[int]) -> dict[str, Any]:
    """Task success, and for structured extraction whether the output is a valid JSON object
    with the expected fields (None for other tasks); tool correctness is success on tool.
    Image cases are not scored (both None): only their agreement with the baseline counts."""
    if not case.cell.scored:
        return {"success": None, "valid": None}
    text = answer_text(ids)
    out: dict[str, Any] = {"success": bool(score(case.sample, text))}
    if case.cell.task == "extract":
        try:
            obj = json.loads(text.strip())
            want = json.loads(case.sample.answer_text)
            out["valid"] = isinstance(obj, dict) and set(obj) == set(want)
        except ValueError:
            out["valid"] = False
    else:
        out["valid"] = None
    return out
