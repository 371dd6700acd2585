"""Building blocks of the generated tasks' prompts: the sample type, filler with inserts placed at
chosen offsets or depths, chat formatting with the tokenizer's specials, and link codes.

A task (:mod:`replaykv.train.tasks`, :mod:`replaykv.train.structured`) draws its evidence, places
it in a haystack of filler text (:func:`haystack`, :func:`place`, :func:`scatter`) and wraps body
and question in one user turn (:func:`chat_user`, or :func:`one_insert_prompt` for a single
insert). Not for: what a task asks or how it is scored (see :mod:`replaykv.train.tasks`).
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from replaykv.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()


class Filler(Protocol):
    """Haystack text: `n` bytes of one split's corpus, drawn with `rng`."""

    def filler(self, rng: np.random.Generator, n: int, prose: bool = True) -> bytes: ...


@dataclass(frozen=True)
class TaskSample:
    """One chat-formatted task instance.

    prompt: token ids [P] ending in <|assistant|>. answer: ids the model must produce next
    (answer bytes + <|end|>). evidence: [start, end) token positions of the span the answer
    depends on. train_spans: other assistant spans inside the prompt that carry loss (tool calls).
    """

    task: str
    prompt: tuple[int, ...]
    answer: tuple[int, ...]
    answer_text: str
    evidence: tuple[int, int]
    chance: float
    train_spans: tuple[tuple[int, int], ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)


def ids_of(text: str | bytes) -> list[int]:
    return list(text.encode("utf-8") if isinstance(text, str) else text)


def special(name: str) -> int:
    return TOKENIZER.special_ids[f"<|{name}|>"]


def answer_ids(text: str) -> tuple[int, ...]:
    return (*ids_of(text), special("end"))


def haystack(
    filler: Filler,
    rng: np.random.Generator,
    length: int,
    inserts: list[tuple[int, bytes]],
    prose: bool = True,
) -> tuple[list[int], list[tuple[int, int]]] | None:
    """`length` bytes of filler with each insert placed at its offset (offsets in the result).

    Returns the ids and each insert's [start, end) in the same order as `inserts`, or None when
    the inserts overlap or do not fit.
    """
    order = sorted(range(len(inserts)), key=lambda i: inserts[i][0])
    out: list[int] = []
    spans: list[tuple[int, int]] = [(0, 0)] * len(inserts)
    for i in order:
        pos, text = inserts[i]
        gap = pos - len(out)
        if gap < 0:
            return None
        out += list(filler.filler(rng, gap, prose)) if gap else []
        spans[i] = (len(out), len(out) + len(text))
        out += list(text)
    tail = length - len(out)
    if tail < 0:
        return None
    out += list(filler.filler(rng, tail, prose)) if tail else []
    return out, spans


def place(
    rng: np.random.Generator,
    room: int,
    size: int,
    base: int,
    depth: float | None,
    evidence_end: int | None,
    inner_end: int | None = None,
) -> int | None:
    """Offset inside a haystack of `room` bytes for an insert of `size` bytes that starts at
    absolute position `base` + offset. With `evidence_end` the insert's byte `inner_end` (default:
    its end) lands there; else at `depth` (uniform when None). None when it cannot fit."""
    span = room - size
    if span < 0:
        return None
    if evidence_end is not None:
        off = evidence_end - base - (size if inner_end is None else inner_end)
        if 0 <= off <= span:
            return off
    d = float(rng.uniform()) if depth is None else min(max(depth, 0.0), 1.0)
    return round(d * span)


def link_code(rng: np.random.Generator, used: set[str], n: int = 4) -> str:
    """A code of `n` upper-case letters or digits (not all digits) not in `used`, added to it."""
    alphabet = string.ascii_uppercase + string.digits
    while True:
        c = "".join(alphabet[i] for i in rng.integers(0, len(alphabet), n))
        if c not in used and not c.isdigit():
            used.add(c)
            return c


def chat_user(body: list[int], question: str) -> tuple[list[int], int]:
    """<|bos|><|user|> body question <|end|><|assistant|>; returns ids and where body starts."""
    head = [TOKENIZER.bos_id, special("user")]
    return [*head, *body, *ids_of(question), special("end"), special("assistant")], len(head)


USER_OVERHEAD = 4  # bos, user, end, assistant


def one_insert_prompt(
    rng: np.random.Generator,
    filler: Filler,
    prompt_len: int,
    intro: bytes,
    question: str,
    insert: bytes,
    depth: float | None = None,
    evidence_end: int | None = None,
    prose: bool = True,
) -> tuple[list[int], tuple[int, int], int, int] | None:
    """A one-turn prompt of exactly `prompt_len` tokens: `intro`, filler holding `insert` (placed
    by :func:`place`), then `question`. Returns the ids, the insert's [start, end) in them, its
    offset in the filler and the filler's length; None when it does not fit."""
    room = prompt_len - USER_OVERHEAD - len(intro) - len(question)
    off = place(rng, room, len(insert), 2 + len(intro), depth, evidence_end)
    if off is None:
        return None
    hay = haystack(filler, rng, room, [(off, insert)], prose)
    if hay is None:
        return None
    body, (span,) = hay
    ids, start = chat_user([*intro, *body], question)
    return ids, (start + len(intro) + span[0], start + len(intro) + span[1]), off, room


def scatter(rng: np.random.Generator, length: int, texts: list[bytes]) -> list[int]:
    """Random non-overlapping offsets, in order, for `texts` inside `length` bytes."""
    total = sum(len(t) for t in texts)
    gaps = np.sort(rng.integers(0, length - total + 1, len(texts)))
    return [int(g) + sum(len(t) for t in texts[:i]) for i, g in enumerate(gaps)]


class CommentFiller:
    """Filler turned into `# ...` comment lines, so it can never assign a variable."""

    def __init__(self, inner: Filler) -> None:
        self.inner = inner

    def filler(self, rng: np.random.Generator, n: int, prose: bool = True) -> bytes:
        raw = self.inner.filler(rng, n, True).replace(b"\n", b" ").replace(b"\r", b" ")
        out = bytearray()
        pos = 0
        while len(out) < n:
            width = int(rng.integers(20, 60))
            out += b"\n# " + raw[pos : pos + width]
            pos += width
        return bytes(out[:n])
