"""The row builders of the training mixture beyond plain text and task prompts: copy rows, lookup
rows, recall rows (plain and traced), program rows (and their recency form) and repeat rows
(ids, loss masks and, for lookups, where each answer's evidence is), each a pure function of a
random generator and a corpus window.

Not for: sampling a batch (see :class:`replaykv.train.data.MixtureSampler`) or the corpus itself
(:mod:`replaykv.train.data`).
"""

from __future__ import annotations

import itertools
import string
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from replaykv.train.tasks import (
    count_reads,
    count_rivals,
    link_code,
    program,
    traced_hops,
    traced_names,
    values_of,
)

if TYPE_CHECKING:
    from replaykv.train.data import Corpus


@dataclass(frozen=True)
class Evidence:
    """Where an answer's evidence is: the row `query` that predicts the answer's first byte and
    the positions [lo, hi) of the text it needs (a lookup's record `A -> B`), for the
    evidence-attention loss (:mod:`replaykv.train.evidence`); `records`: the [lo, hi) of every
    record of the row (the needed one among them), the rivals of its contrastive form; `keyed`:
    whether the records are `A -> B` with a four-byte code A, which the record-key loss reads
    (:mod:`replaykv.train.keys`; a chain's statements are not)."""

    query: int
    lo: int
    hi: int
    records: tuple[tuple[int, int], ...] = ()
    keyed: bool = True


# ---------------------------------------------------------------------------- copy rows
COPY_ALPHABET = np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", dtype=np.uint8)
# The copy and repeat rows' alphabets by `Mixture.copy_alphabet`: "codes", the link codes' (upper
# case and digits); "letters" adds lower case, the alphabet of a chain's names; "lower" is lower
# case alone, strings that read like words to a model trained on text. A model copies only what
# its copy rows drew: one trained on codes alone copies no lower-case string, even inside its
# window (docs/training.md, "Lower-case copies").
COPY_ALPHABETS = {
    "codes": COPY_ALPHABET,
    "letters": np.frombuffer(
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789", dtype=np.uint8
    ),
    "lower": np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8),
}


def copy_row(
    rng: np.random.Generator,
    corpus: Corpus,
    length: int,
    window: int,
    prose: bool = False,
    alphabet: np.ndarray = COPY_ALPHABET,
) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]]]:
    """A corpus window with random strings, each written twice: ids [length], a copy mask
    [length] (True on a repeat's bytes after its first, the only predictable ones) and the
    (first, repeat, size) of each string.

    About one string of 6-32 bytes (of `alphabet`, by default upper case and digits) per 64
    bytes; half of the repeats follow within the `window`, the others anywhere later in the row.
    A first occurrence and a repeat's first byte are random: the sampler gives them no loss."""
    ids = corpus.window(rng, length, prose)
    used = np.zeros(length, dtype=bool)
    copy = np.zeros(length, dtype=bool)
    pairs: list[tuple[int, int, int]] = []
    for _ in range(max(1, length // 64)):
        for _attempt in range(8):
            size = int(rng.integers(6, 33))
            room = length - 2 * size
            if room < 0:
                break
            near = rng.uniform() < 0.5
            gap = int(rng.integers(0, min(window, room) + 1)) if near else int(rng.integers(0, room + 1))
            first = int(rng.integers(0, room - gap + 1))
            repeat = first + size + gap
            if (
                used[max(0, first - 1) : first + size + 1].any()
                or used[max(0, repeat - 1) : repeat + size + 1].any()
            ):
                continue
            text = alphabet[rng.integers(0, len(alphabet), size)]
            ids[first : first + size] = text
            ids[repeat : repeat + size] = text
            used[first : first + size] = used[repeat : repeat + size] = True
            copy[repeat + 1 : repeat + size] = True
            pairs.append((first, repeat, size))
            break
    return ids, copy, sorted(pairs)


def lookup_row(
    rng: np.random.Generator, corpus: Corpus, length: int, prose: bool = False, segment: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Evidence]]:
    """Link records and questions about them in a corpus window: ids [length], an answer mask
    [length] (True on each answer's bytes), a mask of every inserted byte and, for each question
    about one link in the row's order, the row that predicts its answer's first byte with the
    span `A -> B` of the record it needs (the rest need records found through others; see
    `Evidence`).

    The first 40-60% of the row holds the records `A -> B` of one chain of 2-4 codes (four upper
    case letters or digits) per 256 bytes, in random order and places; the rest holds up to two
    different questions per chain in the multi-hop task's words, `Follow h links from A: Z`, each
    about links that all made it into the row. Answering is a lookup by a key drawn for this row:
    what the multi-hop and chain tasks need and a pass key's fixed phrase does not teach, here a
    dozen times a row instead of once.

    With `segment` > 0 the row is cut into segments of that many bytes, one chain each: its
    records in the segment's first 40%, its questions in its last 40%, so a question sits at most
    `segment` bytes after the records it needs (a distance the caller sets against the window)."""
    ids = corpus.window(rng, length, prose)
    answer = np.zeros(length, dtype=bool)
    used = np.zeros(length, dtype=bool)
    split = 0 if segment else int(length * rng.uniform(0.4, 0.6))

    def put(text: bytes, lo: int, hi: int) -> int | None:
        for _ in range(16):
            if hi - lo < len(text):
                return None
            at = int(rng.integers(lo, hi - len(text) + 1))
            if not used[max(0, at - 1) : at + len(text) + 1].any():
                ids[at : at + len(text)] = np.frombuffer(text, dtype=np.uint8)
                used[at : at + len(text)] = True
                return at
        return None

    codes: set[str] = set()
    chains = [
        [link_code(rng, codes) for _ in range(int(rng.integers(2, 5)))]
        for _ in range(max(1, length // (segment or 256)))
    ]

    def records_span(c: int) -> tuple[int, int]:
        return (c * segment, c * segment + segment * 2 // 5) if segment else (0, split)

    def questions_span(c: int) -> tuple[int, int]:
        return (c * segment + segment * 3 // 5, (c + 1) * segment) if segment else (split, length)

    links = [(c, a, b) for c, chain in enumerate(chains) for a, b in itertools.pairwise(chain)]
    placed: dict[tuple[str, str], int] = {}
    span = {(a, b): len(f"{a} -> {b}") for _, a, b in links}
    for c, a, b in (links[i] for i in rng.permutation(len(links))):
        at = put(f"\n{a} -> {b}\n".encode(), *records_span(c))
        if at is not None:
            placed[(a, b)] = at + 1  # the record's first byte, after its newline
    records = tuple(sorted((at, at + span[link]) for link, at in placed.items()))
    evidence: list[Evidence] = []
    for c, chain in enumerate(chains):
        pairs = [(i, h) for i in range(len(chain) - 1) for h in range(1, len(chain) - i)]
        for k in rng.permutation(len(pairs))[:2]:  # two different questions (a repeat is a copy)
            i, h = pairs[k]
            if not all(link in placed for link in itertools.pairwise(chain[i : i + h + 1])):
                continue
            question = f"\nFollow {h} links from {chain[i]}: "
            at = put(f"{question}{chain[i + h]}\n".encode(), *questions_span(c))
            if at is not None:
                answer[at + len(question) : at + len(question) + len(chain[i + h])] = True
                if h == 1:
                    link = (chain[i], chain[i + 1])
                    first = placed[link]
                    evidence.append(Evidence(at + len(question) - 1, first, first + span[link], records))
    return ids, answer, used, sorted(evidence, key=lambda e: e.query)


def record_block(links: list[tuple[str, str]], order: np.ndarray) -> tuple[bytes, list[tuple[int, int]]]:
    """The records `A -> B` of `links` written in `order`, each between newlines: the block and,
    per link (in the order of `links`), the [lo, hi) of its record in the block."""
    block = b""
    records: dict[int, tuple[int, int]] = {}
    for i in order:
        record = f"{links[i][0]} -> {links[i][1]}".encode()
        records[int(i)] = (len(block) + 1, len(block) + 1 + len(record))
        block += b"\n" + record + b"\n"
    return block, [records[i] for i in range(len(links))]


def recall_row(
    rng: np.random.Generator, corpus: Corpus, length: int, prose: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Evidence]]:
    """Blocks of four link records and two questions about them, each block inside one window:
    ids [length], an answer mask [length] (True on each answer's bytes), a mask of every
    inserted byte and, for each one-link question, the row that predicts its answer's first byte
    with the span `A -> B` of its record and the spans of the row's records (`Evidence`).

    A block holds one chain of three codes (two links) and two unrelated links, in random
    order, then, in random order, `Follow 2 links from` the chain's first code and `Follow 1
    links from` one of the four records' first codes, each with its answer (the multi-hop task's
    words). Blocks are 120 bytes with 0-47 bytes of corpus text between them, so every question
    sits less than 128 bytes after the records it needs: the match by a drawn code and the
    composition of two links with the window's full-resolution keys, four answers a window,
    before the same is asked across the compressed entries."""
    ids = corpus.window(rng, length, prose)
    answer = np.zeros(length, dtype=bool)
    used = np.zeros(length, dtype=bool)
    codes: set[str] = set()
    spans: list[tuple[int, int]] = []  # every record's `A -> B` in the row
    evidence: list[Evidence] = []  # filled once every record of the row is known
    at = int(rng.integers(0, 48))
    while True:
        chain = [link_code(rng, codes) for _ in range(3)]
        links = [(chain[0], chain[1]), (chain[1], chain[2])]
        links += [(link_code(rng, codes), link_code(rng, codes)) for _ in range(2)]
        order = rng.permutation(4)
        one = int(rng.integers(0, 4))
        block, records = record_block(links, order)
        asked = [(2, chain[0], chain[2]), (1, *links[one])]
        answers: list[tuple[int, int]] = []  # [lo, hi) of each answer in the block
        one_answer = 0  # where the one-link question's answer starts
        for i in rng.permutation(2):
            hops, start, end = asked[i]
            block += f"\nFollow {hops} links from {start}: ".encode()
            answers.append((len(block), len(block) + len(end)))
            one_answer = len(block) if hops == 1 else one_answer
            block += f"{end}\n".encode()
        if at + len(block) > length:
            return ids, answer, used, [replace(e, records=tuple(spans)) for e in evidence]
        ids[at : at + len(block)] = np.frombuffer(block, dtype=np.uint8)
        used[at : at + len(block)] = True
        spans += [(at + lo, at + hi) for lo, hi in sorted(records)]
        for lo, hi in answers:
            answer[at + lo : at + hi] = True
        lo, hi = records[one]
        evidence.append(Evidence(at + one_answer - 1, at + lo, at + hi))
        at += len(block) + int(rng.integers(0, 48))


def traced_recall_row(
    rng: np.random.Generator, corpus: Corpus, length: int, prose: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Evidence]]:
    """Recall rows whose answers are traced (:func:`replaykv.train.tasks.traced_hops`): blocks of
    four link records and one question, `Follow N links from A: N: B (N-1) -> ... (0)`, N one to
    three, each block inside one window: ids [length], an answer mask [length] (True on each
    answer's bytes), a mask of every inserted byte and, for every code of each answer, the row
    that predicts its first byte with its record and the row's records (`Evidence`), then for
    every number of each answer, the row that predicts it with the number it is made from
    (:func:`replaykv.train.tasks.count_reads`, :func:`~replaykv.train.tasks.count_rivals`).

    The four records hold the chain's N links and 4 - N unrelated ones, in random order; the
    answer copies the question's number, then writes each code with the links left after it.
    Blocks are at most 118 bytes with 0-47 bytes of corpus text between them: every number the
    answer writes and every record it needs within the window's full-resolution keys, so the
    count (copy the question's number, one less after each code, close after 0) is learnt
    where the lookups are easy, for the multi-hop task's traced answers across the context."""
    ids = corpus.window(rng, length, prose)
    answer = np.zeros(length, dtype=bool)
    used = np.zeros(length, dtype=bool)
    codes: set[str] = set()
    spans: list[tuple[int, int]] = []  # every record's `A -> B` in the row
    evidence: list[Evidence] = []  # filled once every record of the row is known
    counts: list[Evidence] = []  # each number of an answer and the number it is made from
    at = int(rng.integers(0, 48))
    while True:
        hops = int(rng.integers(1, 4))
        chain = [link_code(rng, codes) for _ in range(hops + 1)]
        links = list(itertools.pairwise(chain))
        links += [(link_code(rng, codes), link_code(rng, codes)) for _ in range(4 - hops)]
        block, records = record_block(links, rng.permutation(4))
        number = len(block) + len("\nFollow ")
        block += f"\nFollow {hops} links from {chain[0]}: ".encode()
        first = len(block)
        text = traced_hops(chain[1:])
        block += f"{text}\n".encode()
        if at + len(block) > length:
            return ids, answer, used, [replace(e, records=tuple(spans)) for e in evidence] + counts
        ids[at : at + len(block)] = np.frombuffer(block, dtype=np.uint8)
        used[at : at + len(block)] = True
        spans += [(at + lo, at + hi) for lo, hi in sorted(records)]
        answer[at + first : at + first + len(text)] = True
        for k, code in enumerate(chain[1:]):
            query = at + first + text.index(code) - 1
            evidence.append(Evidence(query, at + records[k][0], at + records[k][1]))
        rivals = count_rivals(text, at + number, at + first, chain[0])
        for o, read in count_reads(text, at + number, at + first):
            counts.append(Evidence(at + first + o - 1, read, read + 1, rivals, keyed=False))
        at += len(block) + int(rng.integers(0, 48))


PROGRAM_BLOCK = 120  # bytes: a program with its question and answer, inside one window


def recency_program(rng: np.random.Generator) -> tuple[list[str], list[str], str]:
    """A short program where names are assigned again and again: 2-4 one-letter names, one to
    five more lines than names, each line `x = 123` (a literal not used before) or, half the
    time when another name is assigned already, `x = y` from one. Returns the names assigned,
    the lines and the asked name q, one assigned two or more times when there is one: its
    literal line alone does not answer it, its latest assignment does, wherever in the program
    that is."""
    names = [string.ascii_lowercase[i] for i in rng.choice(26, int(rng.integers(2, 5)), replace=False)]
    values = iter(int(v) for v in rng.choice(np.arange(100, 1000), 16, replace=False))
    lines: list[str] = []
    count = dict.fromkeys(names, 0)
    for _ in range(len(names) + int(rng.integers(1, 6))):
        dst = str(rng.choice(names))
        sources = [n for n in names if count[n] and n != dst]
        src = str(rng.choice(sources)) if sources and rng.uniform() < 0.5 else str(next(values))
        lines.append(f"{dst} = {src}")
        count[dst] += 1
    assigned = [n for n in names if count[n]]
    again = [n for n in assigned if count[n] > 1]
    return assigned, lines, str(rng.choice(again or assigned))


def program_row(
    rng: np.random.Generator, corpus: Corpus, length: int, prose: bool = False, recency: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Evidence]]:
    """Blocks of one short chain program and one question in the chain task's words with its
    traced answer, each block inside one window: ids [length], an answer mask [length] (True on
    each answer's bytes after the asked name), a mask of every inserted byte and, for each
    name or value the answer looks up, the row that predicts its first byte with the value of
    the line that gives it (`v` of `x = v`, the bytes copied) and the block's lines' values as
    rivals (`Evidence`, not keyed).

    A block is a program of 2-4 names and 1-5 copies (:func:`replaykv.train.tasks.program`),
    one line each, then `print(q): q = y = 123` for a name q drawn among all of them (an
    unmoved one answers `q = 123`): every step is the latest assignment of a name before the
    line found last, read with the window's full-resolution keys, the form the chain task's
    traced answers take across the compressed entries. One question per program, so that no
    answer's text stands between a later question and the lines it needs. Blocks are at most
    `PROGRAM_BLOCK` bytes with 0-47 bytes of corpus text between them. With `recency`, the
    programs are :func:`recency_program`'s (names given literals and copies again and again, in
    any order; the asked name one assigned more than once): the latest of several lines that
    start with the same name, which the chain programs' literal-first order lets a model skip."""
    ids = corpus.window(rng, length, prose)
    answer = np.zeros(length, dtype=bool)
    used = np.zeros(length, dtype=bool)
    evidence: list[Evidence] = []
    at = int(rng.integers(0, 48))
    while True:
        if recency:
            _, lines, q = recency_program(rng)
        else:
            made = program(rng, int(rng.integers(2, 5)), int(rng.integers(1, 6)))
            if made is None:
                continue
            names, _, lines, _ = made
            q = str(rng.choice(names))
        found, steps = traced_names(lines, q)
        spans: list[tuple[int, int]] = []  # each line's [lo, hi) in the block, without newlines
        block = b""
        for line in lines:
            spans.append((len(block) + 1, len(block) + 1 + len(line)))
            block += f"\n{line}".encode()
        block += f"\nprint({q}): ".encode()
        first = len(block)  # the answer's first byte: q, copied from the question
        text = " = ".join(steps)
        block += f"{text}\n".encode()
        if len(block) > PROGRAM_BLOCK:
            continue
        if at + len(block) > length:
            return ids, answer, used, evidence
        ids[at : at + len(block)] = np.frombuffer(block, dtype=np.uint8)
        used[at : at + len(block)] = True
        answer[at + first + len(q) : at + first + len(text)] = True
        rivals = values_of(tuple((at + lo, at + hi) for lo, hi in spans))
        offset = first
        for name, i in zip(steps[:-1], found, strict=True):
            offset += len(name) + len(" = ")  # where the step found on line i starts
            evidence.append(Evidence(at + offset - 1, *rivals[i], rivals, keyed=False))
        at += len(block) + int(rng.integers(0, 48))


def repeat_row(
    rng: np.random.Generator, length: int, alphabet: np.ndarray = COPY_ALPHABET
) -> tuple[np.ndarray, int]:
    """One random string of 10-40 bytes (of `alphabet`, by default upper case and digits) written
    again and again to fill `length`: ids [length] and the string's size. Every byte after the
    first repeat's first is a copy of the byte one period back, inside the window: the densest
    copy target there is, for the phase that forms the copying circuit before anything else (see
    `Recipe` `small`) and for one that extends it to characters it has not copied yet."""
    size = int(rng.integers(10, 41))
    text = alphabet[rng.integers(0, len(alphabet), size)]
    return np.resize(text, length).astype(np.int64), size
