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
None when the requested length cannot hold the task. Not for: mixing with text or batching (see
:mod:`replaykv.train.data`), running the model (see :mod:`replaykv.train.evaluate`).
"""

from __future__ import annotations

import itertools
import json
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from replaykv.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
TASKS = ("passkey", "multihop", "chain", "extract", "tool")


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


def score(sample: TaskSample, generated: str) -> bool:
    """Exact match of a generated answer (text before <|end|>); JSON compares parsed values."""
    text = generated.strip()
    if sample.task == "extract":
        try:
            return bool(json.loads(text) == json.loads(sample.answer_text))
        except ValueError:
            return False
    return text == sample.answer_text


# ---------------------------------------------------------------------------- assembling prompts
def _ids(text: str | bytes) -> list[int]:
    return list(text.encode("utf-8") if isinstance(text, str) else text)


def _special(name: str) -> int:
    return TOKENIZER.special_ids[f"<|{name}|>"]


def _answer(text: str) -> tuple[int, ...]:
    return (*_ids(text), _special("end"))


def _haystack(
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


def _place(
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


def _chat_user(body: list[int], question: str) -> tuple[list[int], int]:
    """<|bos|><|user|> body question <|end|><|assistant|>; returns ids and where body starts."""
    head = [TOKENIZER.bos_id, _special("user")]
    return [*head, *body, *_ids(question), _special("end"), _special("assistant")], len(head)


_USER_OVERHEAD = 4  # bos, user, end, assistant


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
    by :func:`_place`), then `question`. Returns the ids, the insert's [start, end) in them, its
    offset in the filler and the filler's length; None when it does not fit."""
    room = prompt_len - _USER_OVERHEAD - len(intro) - len(question)
    off = _place(rng, room, len(insert), 2 + len(intro), depth, evidence_end)
    if off is None:
        return None
    hay = _haystack(filler, rng, room, [(off, insert)], prose)
    if hay is None:
        return None
    body, (span,) = hay
    ids, start = _chat_user([*intro, *body], question)
    return ids, (start + len(intro) + span[0], start + len(intro) + span[1]), off, room


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
        "passkey", tuple(ids), _answer(key), key, ev, 1 / 90000, meta={"depth": round(depth_used, 3)}
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
    `trace`, every code reached in order, `B -> C` for two links (each hop one lookup by a code
    the answer has just written; a one-link answer is the same either way). `meta["links"]`: the
    records of the chain's links in order, as prompt positions without their newlines.
    """
    hops = int(rng.integers(1, 4)) if hops is None else hops
    distractors = int(rng.integers(2, 7)) if distractors is None else distractors
    used: set[str] = set()
    chain = [link_code(rng, used) for _ in range(hops + 1)]
    records = [f"\n{a} -> {b}\n".encode() for a, b in itertools.pairwise(chain)]
    records += [f"\n{link_code(rng, used)} -> {link_code(rng, used)}\n".encode() for _ in range(distractors)]
    intro = b"Code links:\n"
    question = f"\nFollow {hops} links from {chain[0]}:"
    room = prompt_len - _USER_OVERHEAD - len(intro) - len(question)
    base = 2 + len(intro)
    total = sum(len(r) for r in records)
    if room < total:
        return None
    last = records[hops - 1]
    off = _place(rng, room, len(last), base, depth, evidence_end)
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
    inserts = [(o, t) for o, t in zip(_scatter(rng, before_room, before), before, strict=True)]
    inserts += [
        (off + len(last) + o, t) for o, t in zip(_scatter(rng, after_room, after), after, strict=True)
    ]
    inserts.append((off, last))
    hay = _haystack(filler, rng, room, inserts)
    if hay is None:
        return None
    body, spans = hay
    ids, start = _chat_user([*intro, *body], question)
    ev_span = spans[-1]
    ev = (start + len(intro) + ev_span[0], start + len(intro) + ev_span[1])
    # every record's `A -> B` in the prompt (without its newlines): the evidence loss's rivals
    in_prompt = [(start + len(intro) + s0 + 1, start + len(intro) + s1 - 1) for s0, s1 in spans]
    # records are distinct (their codes are), so a link's text names its insert
    at = {text: span for (_, text), span in zip(inserts, in_prompt, strict=True)}
    links = tuple(at[r] for r in records[:hops])
    answer = " -> ".join(chain[1:]) if trace else chain[-1]
    # each code of the answer, at its offset, with the record that gives it
    questions = (
        tuple((i * len("ABCD -> "), link) for i, link in enumerate(links)) if trace else ((0, links[-1]),)
    )
    return TaskSample(
        "multihop",
        tuple(ids),
        _answer(answer),
        answer,
        ev,
        1 / (hops + distractors),
        meta={
            "hops": hops,
            "distractors": distractors,
            "records": tuple(sorted(in_prompt)),
            "links": links,
            "questions": questions,
        },
    )


def _scatter(rng: np.random.Generator, length: int, texts: list[bytes]) -> list[int]:
    """Random non-overlapping offsets, in order, for `texts` inside `length` bytes."""
    total = sum(len(t) for t in texts)
    gaps = np.sort(rng.integers(0, length - total + 1, len(texts)))
    return [int(g) + sum(len(t) for t in texts[:i]) for i, g in enumerate(gaps)]


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
    the answer, with the line that gives it (prompt positions without newlines);
    `meta["records"]`: every statement's.
    """
    n_vars = int(rng.integers(3, 5)) if n_vars is None else n_vars
    steps = int(rng.integers(2, 11)) if steps is None else steps
    names = [string.ascii_lowercase[i] for i in rng.choice(26, n_vars, replace=False)]
    values = [int(v) for v in rng.choice(np.arange(100, 1000), n_vars, replace=False)]
    for _ in range(100):
        state = dict(zip(names, values, strict=True))
        lines = [f"{n} = {v}" for n, v in state.items()]
        for _ in range(steps):
            dst, src = (str(x) for x in rng.choice(names, 2, replace=False))
            state[dst] = state[src]
            lines.append(f"{dst} = {src}")
        moved = [n for n in names if state[n] != values[names.index(n)]]
        if moved:
            break
    else:
        return None
    q = str(rng.choice(moved))
    answer = state[q]
    intro, question = b"What does this program print?\n", f"\nprint({q})"
    stmts = [f"\n{line}\n".encode() for line in lines]
    room = prompt_len - _USER_OVERHEAD - len(intro) - len(question)
    total = sum(len(s) for s in stmts)
    if room < total:
        return None
    span = min(room, max(total, span if span is not None else int(rng.integers(total, 4 * total + 1))))
    # The program occupies `span` bytes: statements in order at random offsets, comments between.
    rel = _scatter(rng, span, stmts)
    lit = names.index(next(n for n, v in zip(names, values, strict=True) if v == answer))
    ev_rel0, ev_rel1 = rel[lit], rel[lit] + len(stmts[lit])
    base = 2 + len(intro)
    block_off = _place(rng, room, span, base, depth, evidence_end, inner_end=ev_rel1)
    if block_off is None:
        return None
    inserts = [(block_off + r, s) for r, s in zip(rel, stmts, strict=True)]
    hay = _haystack(_CommentFiller(filler), rng, room, inserts, prose=False)
    if hay is None:
        return None
    body, spans = hay
    ids, start = _chat_user([*intro, *body], question)
    ev = (start + len(intro) + block_off + ev_rel0, start + len(intro) + block_off + ev_rel1)
    records = tuple((start + len(intro) + s0 + 1, start + len(intro) + s1 - 1) for s0, s1 in spans)
    found = _lines_behind(lines, q)
    names = [q] + [lines[i].split(" = ")[1] for i in found]
    text = " = ".join(names) if trace else str(answer)
    offsets = np.cumsum([len(n) + len(" = ") for n in names[:-1]])
    questions = tuple((int(o), records[i]) for o, i in zip(offsets, found, strict=True)) if trace else ()
    return TaskSample(
        "chain",
        tuple(ids),
        _answer(text),
        text,
        ev,
        1 / n_vars,
        meta={"n_vars": n_vars, "steps": steps, "span": span, "records": records, "questions": questions},
    )


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


class _CommentFiller:
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


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_FIRST = _words(
    "Ada Boris Chen Dara Emil Farah Goran Hana Ivo Jana Kofi Lena Mateo Nia Omar Pia Quinn Rosa Sami Tomas Una Vera Wim Xenia Yusuf Zora"
)
_LAST = _words(
    "Abe Brandt Costa Diallo Eriksen Fontaine Garcia Haddad Ito Jensen Kowalski Lindqvist Moreau Novak Okafor Petrov Quispe Rossi Sato Tanaka Ueda Varga Weber Young Zhou"
)
_CITIES = _words(
    "Accra Bergen Cusco Dakar Essen Fez Graz Hanoi Izmir Jaipur Kyoto Lagos Lima Lyon Malmo Nagoya Oslo Porto Quito Riga Sofia Turin Utrecht Vigo Warsaw Zagreb"
)
_JOBS = _words(
    "baker pilot nurse carpenter chemist librarian plumber teacher welder architect farmer editor geologist jeweler mechanic surveyor tailor translator"
)
_TEMPLATES = (
    "{name} was born in {year} in {city} and works as a {job}.",
    "Born in {city} in {year}, {name} now works as a {job}.",
    "{name}, a {job} from {city}, was born in {year}.",
)


def extract(
    rng: np.random.Generator,
    filler: Filler,
    prompt_len: int,
    depth: float | None = None,
    evidence_end: int | None = None,
) -> TaskSample | None:
    """One sentence about a person in prose filler -> {"name", "year", "city", "job"} as JSON."""
    rec = {
        "name": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}",
        "year": int(rng.integers(1940, 2006)),
        "city": str(rng.choice(_CITIES)),
        "job": str(rng.choice(_JOBS)),
    }
    sentence = str(rng.choice(_TEMPLATES)).format(**rec)
    insert = f"\n{sentence}\n".encode()
    intro, question = b"Read the text.\n", "\nGive name, year, city and job as JSON."
    built = one_insert_prompt(rng, filler, prompt_len, intro, question, insert, depth, evidence_end)
    if built is None:
        return None
    ids, ev, _, _ = built
    text = json.dumps(rec, separators=(", ", ": "))
    return TaskSample("extract", tuple(ids), _answer(text), text, ev, 0.0)


def tool(
    rng: np.random.Generator,
    filler: Filler,
    prompt_len: int,
    rounds: int | None = None,
    depth: float | None = None,
    evidence_end: int | None = None,
) -> TaskSample | None:
    """A tool-call loop: lookup results either point to another key or hold the value.

    Each round is an assistant tool call (carrying loss) and a tool result padded with other
    entries to a random length; the final answer copies the value from the last result.
    `depth` / `evidence_end` are accepted for a uniform interface but the entry's place inside
    the last result is random.
    """
    del depth, evidence_end
    if rounds is None:
        rounds = int(rng.integers(1, 4))
        while rounds > 1 and prompt_len < 90 * rounds + 80:  # about what a round needs
            rounds -= 1
    used: set[str] = set()
    keys = [link_code(rng, used).lower() for _ in range(rounds)]
    value = str(int(rng.integers(1000, 10000)))
    system = 'Tools: lookup(key) returns JSON. Call it as {"tool": "lookup", "key": K}.'
    ids = [TOKENIZER.bos_id, _special("system"), *_ids(system), _special("end")]
    ids += [_special("user"), *_ids(f"What is the value of {keys[0]}?"), _special("end")]
    calls = [f'{{"tool": "lookup", "key": "{k}"}}' for k in keys]
    targets = [f'"see {keys[i + 1]}"' if i + 1 < rounds else value for i in range(rounds)]
    fixed = len(ids) + 1  # + the final <|assistant|>
    for c, t in zip(calls, targets, strict=True):
        fixed += (
            2 + len(c) + 2 + len(f'{{"{keys[0]}": {t}}}')
        )  # <|assistant|> c <|end|> <|tool|> {..} <|end|>
    room = prompt_len - fixed
    if room < 0:
        return None
    split = np.sort(rng.integers(0, room + 1, rounds - 1)) if rounds > 1 else np.zeros(0, dtype=int)
    extra = np.diff(np.concatenate([[0], split, [room]])).astype(int)
    spans: list[tuple[int, int]] = []
    evidence = (0, 0)
    for i in range(rounds):
        a0 = len(ids) + 1
        ids += [_special("assistant"), *_ids(calls[i]), _special("end")]
        spans.append((a0, len(ids)))
        entry = f'"{keys[i]}": {targets[i]}'
        result, at = _padded_result(rng, used, entry, int(extra[i]))
        ids += [_special("tool")]
        if i == rounds - 1:
            evidence = (len(ids) + at, len(ids) + at + len(entry))
        ids += [*_ids(result), _special("end")]
    ids.append(_special("assistant"))
    if len(ids) != prompt_len:
        return None
    return TaskSample(
        "tool",
        tuple(ids),
        _answer(value),
        value,
        evidence,
        0.0,
        train_spans=tuple(spans),
        meta={"rounds": rounds},
    )


def _padded_result(rng: np.random.Generator, used: set[str], entry: str, extra: int) -> tuple[str, int]:
    """A JSON object holding `entry` among other entries, exactly len(entry) + 2 + extra bytes long.

    Returns the text and the offset of `entry` inside it."""
    others: list[str] = []
    size = len(entry) + 2
    while True:
        e = f'"{link_code(rng, used).lower()}": {int(rng.integers(1000, 10000))}'
        if size + len(e) + 2 > len(entry) + 2 + extra:
            break
        others.append(e)
        size += len(e) + 2
    at = int(rng.integers(0, len(others) + 1))
    parts = [*others[:at], entry, *others[at:]]
    body = "{" + ", ".join(parts)
    text = body + " " * (len(entry) + 2 + extra - len(body) - 1) + "}"
    offset = 1 + sum(len(p) + 2 for p in parts[:at])
    return text, offset


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
