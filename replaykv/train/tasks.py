"""Generated tasks that separate the two attention paths, with exact-match scorers.

Every generator returns a :class:`TaskSample` whose prompt is exactly `prompt_len` tokens long
(chat-formatted with the tokenizer's specials, ending in ``<|assistant|>``), the answer the model
must produce (bytes + ``<|end|>``) and the `evidence` span the answer depends on, so that cut
points can be placed relative to it. Filler text (the haystack) comes from a :class:`Filler`
(the byte corpus of one split).

    task      what it needs                                     chance of a blind guess
    passkey   one key anywhere in the context (global path)    1 / 90000
    multihop  2-3 record lookups scattered far apart            1 / number of record targets
    chain     variable copies spread over several windows       1 / number of variables
    extract   one sentence -> four JSON fields                  ~0
    tool      tool-call loop, results of varying length         1 / numbers in the last result

`evidence_end` places the evidence so that it ends at an absolute position (e.g. just before a
replay boundary s = cut - W); `depth` (0..1) places it inside the haystack. A generator returns
None when the requested length cannot hold the task. The structured tasks (extract, tool) are
in :mod:`replaykv.train.structured`, the prompts' building blocks in :mod:`replaykv.train.prompts`.
Not for: mixing with text or batching (see :mod:`replaykv.train.data`), running the model (see
:mod:`replaykv.train.evaluate`).
"""

from __future__ import annotations

import itertools
import json
import re
import string
from collections.abc import Callable
from typing import Any

import numpy as np

from replaykv.train.prompts import (
    TOKENIZER,
    USER_OVERHEAD,
    CommentFiller,
    Filler,
    TaskSample,
    answer_ids,
    chat_user,
    haystack,
    link_code,
    one_insert_prompt,
    place,
    scatter,
)
from replaykv.train.structured import extract, tool

# what the tasks' importers read from here
__all__ = [
    "GENERATORS",
    "TASKS",
    "TOKENIZER",
    "Filler",
    "TaskSample",
    "generate",
    "link_code",
    "one_insert_prompt",
    "score",
    "traced_hops",
]

TASKS = ("passkey", "multihop", "chain", "extract", "tool")
# A chain statement `x = v` (one-letter names): its value v, what an answer copies, starts here.
VALUE_AT = len("x = ")


def score(sample: TaskSample, generated: str) -> bool:
    """Exact match of a generated answer (text before <|end|>); JSON compares parsed values."""
    text = generated.strip()
    if sample.task == "extract":
        try:
            return bool(json.loads(text) == json.loads(sample.answer_text))
        except ValueError:
            return False
    return text == sample.answer_text


# ---------------------------------------------------------------------------- the generators
def passkey(
    rng: np.random.Generator,
    filler: Filler,
    prompt_len: int,
    depth: float | None = None,
    evidence_end: int | None = None,
) -> TaskSample | None:
    """A 5-digit key in prose filler; the question asks for it back."""
    key = str(int(rng.integers(10000, 100000)))
    intro, question = b"Remember the pass key.\n", "\nWhat is the pass key?"
    insert = f"\nThe pass key is {key}.\n".encode()
    built = one_insert_prompt(rng, filler, prompt_len, intro, question, insert, depth, evidence_end)
    if built is None:
        return None
    ids, ev, off, room = built
    depth_used = off / max(1, room - len(insert))
    return TaskSample(
        "passkey", tuple(ids), answer_ids(key), key, ev, 1 / 90000, meta={"depth": round(depth_used, 3)}
    )


def multihop(
    rng: np.random.Generator,
    filler: Filler,
    prompt_len: int,
    hops: int | None = None,
    distractors: int | None = None,
    depth: float | None = None,
    evidence_end: int | None = None,
    trace: bool = False,
) -> TaskSample | None:
    """Records `A -> B` scattered in filler; follow `hops` links from a start code.

    The evidence is the record holding the answer (the last link); the other records sit at
    random places, so every hop is a lookup across the context. The answer is the last code; with
    `trace`, the question's number and then every code reached in order, each with the number of
    links left after it (:func:`traced_hops`). `meta["links"]`: the records of the chain's links
    in order, as prompt positions without their newlines.
    """
    hops = int(rng.integers(1, 4)) if hops is None else hops
    distractors = int(rng.integers(2, 7)) if distractors is None else distractors
    used: set[str] = set()
    chain = [link_code(rng, used) for _ in range(hops + 1)]
    records = [f"\n{a} -> {b}\n".encode() for a, b in itertools.pairwise(chain)]
    records += [f"\n{link_code(rng, used)} -> {link_code(rng, used)}\n".encode() for _ in range(distractors)]
    intro = b"Code links:\n"
    question = f"\nFollow {hops} links from {chain[0]}:"
    room = prompt_len - USER_OVERHEAD - len(intro) - len(question)
    base = 2 + len(intro)
    total = sum(len(r) for r in records)
    if room < total:
        return None
    last = records[hops - 1]
    off = place(rng, room, len(last), base, depth, evidence_end)
    if off is None:
        return None
    # The other records go at random places before or after the evidence record.
    others = [r for i, r in enumerate(records) if i != hops - 1]
    rng.shuffle(others)
    before_room, after_room = off, room - off - len(last)
    before: list[bytes] = []
    after: list[bytes] = []
    for rec in others:
        used_b, used_a = sum(map(len, before)), sum(map(len, after))
        fits_b, fits_a = used_b + len(rec) <= before_room, used_a + len(rec) <= after_room
        if not (fits_b or fits_a):
            return None
        go_before = fits_b and (not fits_a or rng.uniform() * (before_room + after_room) < before_room)
        (before if go_before else after).append(rec)
    inserts = [(o, t) for o, t in zip(scatter(rng, before_room, before), before, strict=True)]
    inserts += [(off + len(last) + o, t) for o, t in zip(scatter(rng, after_room, after), after, strict=True)]
    inserts.append((off, last))
    hay = haystack(filler, rng, room, inserts)
    if hay is None:
        return None
    body, spans = hay
    ids, start = chat_user([*intro, *body], question)
    ev_span = spans[-1]
    ev = (start + len(intro) + ev_span[0], start + len(intro) + ev_span[1])
    # every record's `A -> B` in the prompt (without its newlines): the evidence loss's rivals
    in_prompt = [(start + len(intro) + s0 + 1, start + len(intro) + s1 - 1) for s0, s1 in spans]
    # records are distinct (their codes are), so a link's text names its insert
    at = {text: span for (_, text), span in zip(inserts, in_prompt, strict=True)}
    links = tuple(at[r] for r in records[:hops])
    answer = traced_hops(chain[1:]) if trace else chain[-1]
    # each code of the answer, at its offset, with the record that gives it
    questions = (
        tuple((answer.index(code), link) for code, link in zip(chain[1:], links, strict=True))
        if trace
        else ((0, links[-1]),)
    )
    # the row position of the question's number, which the numbers of a traced answer read
    # (the question ends two tokens before the prompt does: <|end|><|assistant|> follow it)
    number = len(ids) - 2 - len(question) + question.index(f" {hops} ") + 1
    return TaskSample(
        "multihop",
        tuple(ids),
        answer_ids(answer),
        answer,
        ev,
        1 / (hops + distractors),
        meta={
            "hops": hops,
            "distractors": distractors,
            "records": tuple(sorted(in_prompt)),
            "links": links,
            "questions": questions,
            "counts": count_reads(answer, number, len(ids)) if trace else (),
            "count_rivals": count_rivals(answer, number, len(ids), chain[0]) if trace else (),
        },
    )


def count_reads(answer: str, number: int, at: int) -> tuple[tuple[int, int], ...]:
    """Where each number of a traced multi-hop answer (`2: B (1) -> C (0)`, starting at row
    position `at`) reads from: (its offset in the answer, the row position of the number it is
    made from), the first the question's number at `number`, each count the number written
    before it."""
    offsets = _number_offsets(answer)
    reads = [number] + [at + o for o in offsets[:-1]]
    return tuple(zip(offsets, reads, strict=True))


def _number_offsets(answer: str) -> list[int]:
    """The offsets of a traced multi-hop answer's numbers: its first byte, then each count."""
    return [0] + [i + 1 for i, ch in enumerate(answer) if ch == "(" and answer[i + 1].isdigit()]


def count_rivals(answer: str, number: int, at: int, start: str) -> tuple[tuple[int, int], ...]:
    """The spans a traced answer's numbers are read against: the question's number, the start
    code after it (`Follow N links from CODE:`), and every number and code the answer writes."""
    code = number + len(" links from ") + 1
    spans = [(number, number + 1), (code, code + len(start))]
    spans += [(at + o, at + o + 1) for o in _number_offsets(answer)]
    spans += [(at + m.start(), at + m.end()) for m in re.finditer(r"[A-Z0-9]{4}", answer)]  # link codes
    return tuple(sorted(spans))


def traced_hops(codes: list[str]) -> str:
    """A traced multi-hop answer: `2: B (1) -> C (0)` for the codes B, C of two links.

    The answer first copies the question's number (a fixed distance back), then after each code
    writes the links left, one less than the number before it (a fixed distance back too), and
    closes after `(0)`: every decision, the count and the stop, reads a token at a fixed offset
    instead of comparing a count with the question's number."""
    n = len(codes)
    return f"{n}: " + " -> ".join(f"{code} ({n - k})" for k, code in enumerate(codes, 1))


def chain(
    rng: np.random.Generator,
    filler: Filler,
    prompt_len: int,
    n_vars: int | None = None,
    steps: int | None = None,
    span: int | None = None,
    depth: float | None = None,
    evidence_end: int | None = None,
    trace: bool = False,
) -> TaskSample | None:
    """Variable tracking: `v = 123` for each variable, then copies `x = y`, spread over `span`
    bytes of comment lines; the question asks what `print(q)` shows.

    Names are reassigned, so a value can only be found by following the copies in order: the
    state propagates line by line (through stacked windows) rather than by a single lookup.
    The evidence is the literal assignment of the answer's value. With `trace` the answer
    writes the lines that give q its value, last first, joined where they share a name: `q = y
    = x = 123` for the lines `q = y`, `y = x` and `x = 123`, each the latest assignment of its
    name before the line found last (every step one lookup of a line by the name just
    written). `meta["questions"]`: each name or value of the answer after q, at its offset in
    the answer, with the value of the line that gives it (prompt positions);
    `meta["records"]`: every statement's; `meta["values"]`: every statement's value (the name or
    literal after `=`, :func:`values_of`), which a question's evidence asks for: the bytes the
    answer copies, whose keys follow the statement's name.
    """
    n_vars = int(rng.integers(3, 5)) if n_vars is None else n_vars
    steps = int(rng.integers(2, 11)) if steps is None else steps
    made = program(rng, n_vars, steps)
    if made is None:
        return None
    names, values, lines, state = made
    moved = [n for n in names if state[n] != values[names.index(n)]]
    q = str(rng.choice(moved))
    answer = state[q]
    intro, question = b"What does this program print?\n", f"\nprint({q})"
    stmts = [f"\n{line}\n".encode() for line in lines]
    room = prompt_len - USER_OVERHEAD - len(intro) - len(question)
    total = sum(len(s) for s in stmts)
    if room < total:
        return None
    span = min(room, max(total, span if span is not None else int(rng.integers(total, 4 * total + 1))))
    # The program occupies `span` bytes: statements in order at random offsets, comments between.
    rel = scatter(rng, span, stmts)
    lit = names.index(next(n for n, v in zip(names, values, strict=True) if v == answer))
    ev_rel0, ev_rel1 = rel[lit], rel[lit] + len(stmts[lit])
    base = 2 + len(intro)
    block_off = place(rng, room, span, base, depth, evidence_end, inner_end=ev_rel1)
    if block_off is None:
        return None
    inserts = [(block_off + r, s) for r, s in zip(rel, stmts, strict=True)]
    hay = haystack(CommentFiller(filler), rng, room, inserts, prose=False)
    if hay is None:
        return None
    body, spans = hay
    ids, start = chat_user([*intro, *body], question)
    ev = (start + len(intro) + block_off + ev_rel0, start + len(intro) + block_off + ev_rel1)
    records = tuple((start + len(intro) + s0 + 1, start + len(intro) + s1 - 1) for s0, s1 in spans)
    value_spans = values_of(records)
    found, names = traced_names(lines, q)
    text = " = ".join(names) if trace else str(answer)
    offsets = np.cumsum([len(n) + len(" = ") for n in names[:-1]])
    questions = tuple((int(o), value_spans[i]) for o, i in zip(offsets, found, strict=True)) if trace else ()
    return TaskSample(
        "chain",
        tuple(ids),
        answer_ids(text),
        text,
        ev,
        1 / n_vars,
        meta={
            "n_vars": n_vars,
            "steps": steps,
            "span": span,
            "records": records,
            "values": value_spans,
            "questions": questions,
        },
    )


def values_of(statements: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The [lo, hi) of each chain statement's value (`v` of `x = v`) from the statement's."""
    return tuple((lo + VALUE_AT, hi) for lo, hi in statements)


def program(
    rng: np.random.Generator, n_vars: int, steps: int
) -> tuple[list[str], list[int], list[str], dict[str, int]] | None:
    """A chain program: `n_vars` one-letter names each given a distinct three-digit literal
    (`v = 123`), then `steps` copies `x = y` between two different names, drawn again until at
    least one name ends with another's value (None after 100 draws). Returns the names, their
    literals, the lines and the final values."""
    names = [string.ascii_lowercase[i] for i in rng.choice(26, n_vars, replace=False)]
    values = [int(v) for v in rng.choice(np.arange(100, 1000), n_vars, replace=False)]
    for _ in range(100):
        state = dict(zip(names, values, strict=True))
        lines = [f"{n} = {v}" for n, v in state.items()]
        for _ in range(steps):
            dst, src = (str(x) for x in rng.choice(names, 2, replace=False))
            state[dst] = state[src]
            lines.append(f"{dst} = {src}")
        if any(state[n] != v for n, v in zip(names, values, strict=True)):
            return names, values, lines, state
    return None


def traced_names(lines: list[str], q: str) -> tuple[list[int], list[str]]:
    """The lines behind `q`'s final value (see :func:`_lines_behind`) and the names and value a
    traced answer writes, `q` first: `q = y = x = 123` is ``" = ".join(names)``."""
    found = _lines_behind(lines, q)
    return found, [q] + [lines[i].split(" = ")[1] for i in found]


def _lines_behind(lines: list[str], q: str) -> list[int]:
    """The lines `dst = src` that give `q` its value at the program's end, last first: each the
    latest assignment of the previous line's source before that line, down to a literal."""
    found: list[int] = []
    name, bound = q, len(lines)
    while True:
        i = max(k for k in range(bound) if lines[k].split(" = ")[0] == name)
        found.append(i)
        name, bound = lines[i].split(" = ")[1], i
        if name.isdigit():
            return found


GENERATORS: dict[str, Callable[..., TaskSample | None]] = {
    "passkey": passkey,
    "multihop": multihop,
    "chain": chain,
    "extract": extract,
    "tool": tool,
}


def generate(
    task: str, rng: np.random.Generator, filler: Filler, prompt_len: int, **controls: Any
) -> TaskSample | None:
    """One sample of `task` with a prompt of exactly `prompt_len` tokens (None: does not fit)."""
    if task not in GENERATORS:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    sample = GENERATORS[task](rng, filler, prompt_len, **controls)
    if sample is not None and len(sample.prompt) != prompt_len:
        raise AssertionError(f"{task}: prompt of {len(sample.prompt)} tokens, wanted {prompt_len}")
    return sample
