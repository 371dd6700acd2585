"""Training data: a deterministic corpus with disjoint splits, deterministic batches with the
right loss masks and row kinds, and replay steps' evidence placed before the boundary (the task
generators themselves: tests/train/test_tasks.py)."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import re

import numpy as np
import pytest

from replaykv.train.data import MixtureSampler, list_files, load_corpus, split_of, stdlib_root
from replaykv.train.recipe_spec import COPY_ALPHABET_NAMES
from replaykv.train.recipes import Mixture, Paths, Phase, small, tiny
from replaykv.train.rows import (
    COPY_ALPHABET,
    COPY_ALPHABETS,
    copy_row,
    lookup_row,
    program_row,
    recall_row,
    repeat_row,
    traced_recall_row,
)

FILES = 40


def mixed():  # type: ignore[no-untyped-def]
    """`small` without its first (repeat-rows-only) phase: batch 0 is of the mixture."""
    recipe = small()
    assert recipe.phases[0].name == "induction"
    return dataclasses.replace(recipe, phases=recipe.phases[1:], stages=())


@pytest.fixture(scope="module")
def corpus():  # type: ignore[no-untyped-def]
    return load_corpus(max_files=FILES, heldout_percent=25)


def test_splits_are_disjoint_stable_and_cover_the_files(corpus) -> None:  # type: ignore[no-untyped-def]
    files = list_files(stdlib_root(), FILES)
    assert len(files) == FILES and not any("site-packages" in f for f in files)
    splits = {f: split_of(f, 25) for f in files}
    assert splits == {f: split_of(f, 25) for f in files}
    train = {f for f, s in splits.items() if s == "train"}
    held = {f for f, s in splits.items() if s == "heldout"}
    assert train and held and not train & held
    assert corpus["train"].info.files == len(train) and corpus["heldout"].info.files == len(held)
    assert corpus["train"].info.fingerprint != corpus["heldout"].info.fingerprint


def test_corpus_is_deterministic_and_shuffled_by_seed(corpus) -> None:  # type: ignore[no-untyped-def]
    again = load_corpus(max_files=FILES, heldout_percent=25, cached=False)  # read the files again
    other = load_corpus(max_files=FILES, heldout_percent=25, seed=1)
    assert np.array_equal(again["train"].code, corpus["train"].code)
    assert len(other["train"].code) == len(corpus["train"].code)
    assert not np.array_equal(other["train"].code, corpus["train"].code)
    assert b"def " in corpus["train"].code.tobytes() and len(corpus["train"].prose) > 1000
    assert again["train"].code is not corpus["train"].code  # a fresh read, not the cached arrays
    cached = load_corpus(max_files=FILES, heldout_percent=25)
    assert cached["train"].code is again["train"].code and not cached["train"].code.flags.writeable


def test_batches_are_a_function_of_seed_and_step(corpus) -> None:  # type: ignore[no-untyped-def]
    recipe = tiny()
    s = MixtureSampler(corpus["train"], recipe, window=8)
    a, b = s.batch(3), s.batch(3)
    assert (a.ids == b.ids).all() and (a.targets == b.targets).all() and a.prompt_len == b.prompt_len
    assert not (s.batch(4).ids == a.ids).all()
    reseeded = MixtureSampler(corpus["train"], dataclasses.replace(recipe, seed=7), window=8)
    assert not (reseeded.batch(3).ids == a.ids).all()
    held = MixtureSampler(corpus["heldout"], recipe, window=8)
    assert not (held.batch(3).ids == a.ids).all()


def test_loss_masks_cover_answers_and_text_only(corpus) -> None:  # type: ignore[no-untyped-def]
    recipe = mixed()
    s = MixtureSampler(corpus["train"], recipe, window=128)
    seen = set()
    for step in range(4):
        batch = s.batch(step)
        p = batch.prompt_len
        n_seq = recipe.phases[0].seq_len
        assert batch.ids.shape == (8, n_seq) and n_seq // 2 <= p <= n_seq - recipe.answer_budget
        for row, (kind, sample) in enumerate(zip(batch.kinds, batch.samples, strict=True)):
            seen.add(kind)
            t = batch.targets[row]
            if kind == "copy":  # checked in detail by test_copy_rows_repeat_random_strings
                assert set(t[1:].unique().tolist()) == {0.0, 1.0, recipe.phases[0].copy_weight}
                continue
            if sample is None:
                assert kind == "text" and (t[1:] == 1).all()
                continue
            n = len(sample.answer)
            assert batch.ids[row, :p].tolist() == list(sample.prompt)
            assert batch.ids[row, p : p + n].tolist() == list(sample.answer)
            assert (t[p : p + n] == recipe.phases[0].answer_weight).all()
            assert not t[p + n]  # the <|eos|> after the answer is no target
            in_prompt = {i for a, b in sample.train_spans for i in range(a, b)}
            assert {i for i in range(p) if t[i]} == in_prompt
            assert (t[p + n + 1 :] == 1).all()  # packed text after the sample
    assert len(seen) >= 4


def test_copy_rows_repeat_random_strings(corpus) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(5)
    near = far = 0
    for _ in range(20):
        ids, mask, pairs = copy_row(rng, corpus["train"], 1024, window=128)
        assert ids.shape == mask.shape == (1024,) and len(pairs) >= 8
        expected = np.zeros(1024, dtype=bool)
        covered = np.zeros(1024, dtype=int)
        for first, repeat, size in pairs:
            assert 6 <= size <= 32 and first + size <= repeat and repeat + size <= 1024
            assert (ids[first : first + size] == ids[repeat : repeat + size]).all()
            assert np.isin(ids[first : first + size], COPY_ALPHABET).all()
            expected[repeat + 1 : repeat + size] = True
            covered[first : first + size] += 1
            covered[repeat : repeat + size] += 1
            gap = repeat - first - size
            near, far = near + (gap <= 128), far + (gap > 128)
        assert (mask == expected).all() and covered.max() == 1  # strings never overlap
    assert near > 40 and far > 40  # both sides of the window

    recipe = mixed()
    weight = recipe.phases[0].copy_weight
    s = MixtureSampler(corpus["train"], recipe, window=128)
    rows = [
        (b.ids[i], b.targets[i])
        for b in map(s.batch, range(12))
        for i, k in enumerate(b.kinds)
        if k == "copy"
    ]
    assert rows
    for ids, t in rows:
        at = np.flatnonzero(t.numpy() == weight)
        assert len(at) > len(ids) // 10 and np.isin(ids[at].numpy(), COPY_ALPHABET).all()


@pytest.mark.parametrize("kind", ["copy", "repeat"])
def test_copy_and_repeat_rows_draw_the_mixtures_alphabet(corpus, kind: str) -> None:  # type: ignore[no-untyped-def]
    assert tuple(COPY_ALPHABETS) == COPY_ALPHABET_NAMES
    lower = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    copied = {}
    for name in COPY_ALPHABET_NAMES:
        only = Mixture(**{**{k: 0.0 for k in Mixture().weights}, kind: 1.0}, copy_alphabet=name)
        phase = Phase("copies", 40, 1024, 4, only, copy_weight=5.0)
        batch = MixtureSampler(corpus["train"], dataclasses.replace(tiny(), phases=(phase,)), 128).batch(0)
        assert batch.kinds == (kind,) * 4
        strings = np.concatenate(
            [ids[t == 5.0] for ids, t in zip(batch.ids.numpy(), batch.targets.numpy(), strict=True)]
        )
        assert np.isin(strings, COPY_ALPHABETS[name]).all()
        copied[name] = np.isin(strings, lower).mean()
    # lower case only where asked for, about 26 of its 62 characters in letters (a repeat row's
    # string is one draw of 10-40 bytes, its 1,000-odd targets four draws: a wider margin)
    assert copied["codes"] == 0 and 0.2 < copied["letters"] < 0.65 and copied["lower"] == 1
    with pytest.raises(ValueError, match="copy_alphabet"):
        Mixture(copy_alphabet="bytes")


def test_repeat_rows_fill_the_row_with_one_string_and_weigh_its_copies(corpus) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(3)
    sizes = set()
    for _ in range(50):
        ids, size = repeat_row(rng, 256)
        sizes.add(size)
        assert ids.shape == (256,) and 10 <= size <= 40
        assert np.isin(ids, COPY_ALPHABET).all()
        assert (ids[size:] == ids[:-size]).all()  # period `size` ...
        assert all((ids[p:] != ids[:-p]).any() for p in range(1, size))  # ... and no shorter one
    assert min(sizes) < 15 and max(sizes) > 35

    recipe = small()
    first = recipe.phases[0]
    assert (first.name, first.seq_len) == ("induction", 256)
    batch = MixtureSampler(corpus["train"], recipe, window=128).batch(0)
    assert batch.kinds == ("repeat",) * first.batch and batch.ids.shape == (first.batch, 256)
    for ids, t in zip(batch.ids.numpy(), batch.targets.numpy(), strict=True):
        size = next(p for p in range(10, 41) if (ids[p:] == ids[:-p]).all())
        # no loss until the first repeat's second byte (the first could follow any string)
        assert not t[: size + 1].any() and (t[size + 1 :] == first.copy_weight).all()
    later = MixtureSampler(corpus["train"], recipe, window=128).batch(first.steps)
    assert "repeat" not in later.kinds and later.ids.shape[1] == recipe.phases[1].seq_len


RECORD = re.compile(rb"\n([A-Z0-9]{4}) -> ([A-Z0-9]{4})\n")
QUESTION = re.compile(rb"\nFollow (\d) links from ([A-Z0-9]{4}): ([A-Z0-9]{4})\n")


def assert_rows_weigh_answers(  # type: ignore[no-untyped-def]
    corpus, kind: str, answers: int, text: int, alphabet: np.ndarray = COPY_ALPHABET
) -> None:
    """A batch of `kind` rows only: at least `answers` answer bytes a row at the copy weight, all
    from `alphabet` (codes), more than `text` bytes of text at weight 1, inserted bytes at 0."""
    weights = {k: 0.0 for k in ("text", "passkey", "multihop", "chain", "extract", "tool")}
    mix = Mixture(**weights, **{kind: 1.0})
    recipe = dataclasses.replace(
        tiny(), phases=(Phase("p", 4, 512, 2, mix, copy_weight=5.0),), warmup=1, stages=()
    )
    batch = MixtureSampler(corpus["train"], recipe, window=32).batch(0)
    assert batch.kinds == (kind, kind)
    for ids, t in zip(batch.ids.numpy(), batch.targets.numpy(), strict=True):
        at = np.flatnonzero(t == 5.0)
        assert len(at) >= answers and np.isin(ids[at], alphabet).all()
        assert set(np.unique(t)) <= {0.0, 1.0, 5.0} and (t == 1.0).sum() > text


def test_lookup_rows_ask_about_links_recorded_before_the_questions(corpus) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(11)
    hops = set()
    for _ in range(20):
        ids, answers, inserted, evidence = lookup_row(rng, corpus["train"], 2048)
        assert ids.shape == answers.shape == inserted.shape == (2048,) and not (answers & ~inserted).any()
        text = bytes(int(i) if i < 256 else 0 for i in ids)
        links = {m.group(1): (m.group(2), m.end()) for m in RECORD.finditer(text)}
        asked = list(QUESTION.finditer(text))
        assert len(links) >= 8 and len(asked) >= 8
        expected = np.zeros(2048, dtype=bool)
        for q in asked:
            code, last_record = q.group(2), 0
            for _ in range(int(q.group(1))):  # follow the links the row recorded
                code, end = links[code]
                last_record = max(last_record, end)
            assert code == q.group(3) and last_record <= q.start()  # answerable when asked
            expected[q.start(3) : q.end(3)] = True
            hops.add(int(q.group(1)))
        assert (answers == expected).all()
        # Each one-link question's evidence: the row before its answer and its record's span.
        one_link = [q for q in asked if q.group(1) == b"1"]
        assert len(evidence) == len(one_link) and one_link
        # ... and every record of the row, its rivals in the contrastive form.
        spans = tuple((m.start(1), m.end(2)) for m in RECORD.finditer(text))
        for q, e in zip(one_link, evidence, strict=True):
            assert e.query == q.start(3) - 1 and e.hi <= q.start()
            assert text[e.lo : e.hi] == q.group(2) + b" -> " + q.group(3)
            assert e.records == spans and (e.lo, e.hi) in spans
        pairs = [(q.group(1), q.group(2)) for q in asked]
        assert len(set(pairs)) == len(pairs)  # no question twice: a repeat would be a copy
    assert hops == {1, 2, 3}

    # In segments, every question sits within its segment, after the records it needs.
    for _ in range(20):
        ids, answers, inserted, _ = lookup_row(rng, corpus["train"], 1024, segment=256)
        text = bytes(int(i) if i < 256 else 0 for i in ids)
        links = {m.group(1): (m.group(2), m.start(), m.end()) for m in RECORD.finditer(text)}
        asked = list(QUESTION.finditer(text))
        assert len(asked) >= 4 and int(answers.sum()) == 4 * len(asked)
        for q in asked:
            code, seg = q.group(2), q.start() // 256
            for _ in range(int(q.group(1))):
                code, start, end = links[code]
                assert start // 256 == seg and (end - 1) // 256 == seg and end <= q.start()
            assert code == q.group(3) and q.end() <= (seg + 1) * 256
    with pytest.raises(ValueError, match="lookup_segment"):
        Mixture(lookup_segment=-1)

    assert_rows_weigh_answers(corpus, "lookup", 8, 256)


def test_recall_rows_ask_one_and_two_links_inside_a_window(corpus) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(12)
    for _ in range(20):
        ids, answers, inserted, evidence = recall_row(rng, corpus["train"], 512)
        assert ids.shape == answers.shape == inserted.shape == (512,) and not (answers & ~inserted).any()
        text = bytes(int(i) if i < 256 else 0 for i in ids)
        links = {m.group(1): (m.group(2), m.start()) for m in RECORD.finditer(text)}
        asked = list(QUESTION.finditer(text))
        assert len(links) == 2 * len(asked) >= 6  # four records and two questions a block
        assert sorted(q.group(1) for q in asked) == sorted([b"1", b"2"] * (len(asked) // 2))
        expected = np.zeros(512, dtype=bool)
        for q in asked:
            code, first = q.group(2), q.start()
            for _ in range(int(q.group(1))):  # follow the links the row recorded
                code, at = links[code]
                first = min(first, at)
            # the answer, and every record it needs within one window before the answer's end
            assert code == q.group(3) and q.end(3) - first < 128
            expected[q.start(3) : q.end(3)] = True
        assert (answers == expected).all()
        # Each one-link question's evidence: the row before its answer, its record, every record.
        one_link = [q for q in asked if q.group(1) == b"1"]
        spans = tuple((m.start(1), m.end(2)) for m in RECORD.finditer(text))
        assert len(evidence) == len(one_link)
        for q, e in zip(one_link, evidence, strict=True):
            assert e.query == q.start(3) - 1 and e.records == spans and (e.lo, e.hi) in spans
            assert text[e.lo : e.hi] == q.group(2) + b" -> " + q.group(3)
    assert_rows_weigh_answers(corpus, "recall", 24, 64)


TRACED = re.compile(rb"\nFollow (\d) links from ([A-Z0-9]{4}): (\d): ((?:[A-Z0-9]{4} \(\d\)(?: -> )?)+)\n")


def test_traced_recall_rows_count_down_every_answer_inside_a_window(corpus) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(14)
    hops_seen = set()
    for _ in range(20):
        ids, answers, inserted, evidence = traced_recall_row(rng, corpus["train"], 512)
        assert ids.shape == answers.shape == inserted.shape == (512,) and not (answers & ~inserted).any()
        text = bytes(int(i) if i < 256 else 0 for i in ids)
        records = list(RECORD.finditer(text))
        links = {m.group(1): (m.group(2), m.start(1), m.end(2)) for m in records}
        asked = list(TRACED.finditer(text))
        assert len(records) == 4 * len(asked) and len(asked) >= 3  # four records a question
        expected = np.zeros(512, dtype=bool)
        steps = []
        for q in asked:
            hops = int(q.group(1))
            hops_seen.add(hops)
            assert q.group(3) == q.group(1)  # the answer copies the question's number
            code, first, written = q.group(2), q.start(), []
            for left in range(hops - 1, -1, -1):  # follow the links the row recorded
                code, lo, hi = links[code]
                first = min(first, lo)
                written.append(code + f" ({left})".encode())
                at = q.start(4) + q.group(4).index(code)
                steps.append((at - 1, lo, hi))
            assert q.group(4) == b" -> ".join(written) and q.end(4) - first < 128
            expected[q.start(3) : q.end(4)] = True
        assert (answers == expected).all()
        spans = tuple((m.start(1), m.end(2)) for m in records)
        codes = [e for e in evidence if e.keyed]
        assert [(e.query, e.lo, e.hi) for e in codes] == steps and all(e.records == spans for e in codes)
        # every number an answer writes reads the question's number or the number before it
        numbers = [e for e in evidence if not e.keyed]
        assert len(numbers) == sum(int(q.group(1)) + 1 for q in asked)
        for e in numbers:
            made = int(text[e.query + 1 : e.query + 2])
            read = int(text[e.lo : e.hi])
            assert (
                e.hi == e.lo + 1 and made in (read, read - 1) and e.lo < e.query and (e.lo, e.hi) in e.records
            )
            assert text[e.query - 1 : e.query + 1] in (b": ", b" (")
    assert hops_seen == {1, 2, 3}
    traced = Mixture(**{**{k: 0.0 for k in Mixture().weights}, "recall": 1.0}, trace_hops=True)
    recipe = dataclasses.replace(tiny(), phases=(Phase("p", 4, 512, 2, traced),), warmup=1, stages=())
    batch = MixtureSampler(corpus["train"], recipe, window=32).batch(0)
    assert all(len(TRACED.findall(bytes(int(t) if t < 256 else 0 for t in row))) >= 3 for row in batch.ids)


PROGRAM_LINE = re.compile(rb"([a-z]) = ([a-z]|[0-9]{3})")


@pytest.mark.parametrize("recency", [False, True])
def test_program_rows_ask_for_traced_chains_inside_a_window(corpus, recency) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(13)
    lengths = set()
    late_literals = 0  # programs with a literal line after a copy
    for _ in range(20):
        ids, answers, inserted, evidence = program_row(rng, corpus["train"], 512, recency=recency)
        assert ids.shape == answers.shape == inserted.shape == (512,) and not (answers & ~inserted).any()
        text = bytes(int(i) if i < 256 else 0 for i in ids)
        expected = np.zeros(512, dtype=bool)
        steps = []  # (query, lo, hi, lines of the block) for every name or value looked up
        at = 0
        asked = list(re.finditer(rb"\nprint\(([a-z])\): ([a-z0-9 =]+)\n", text))
        assert len(asked) >= 4
        for m in asked:
            start = int(np.flatnonzero(inserted[at : m.start() + 1])[0]) + at  # the block's first byte
            block = text[start : m.start()]
            lines = _program_lines(block, start)
            assert inserted[start : m.end()].all()
            assert m.end() - start <= 120  # the program, question and answer inside one window
            names = m.group(2).split(b" = ")
            assert names[0] == m.group(1) and names[-1].isdigit()
            # Run the program: q's final value is the answer's value.
            state: dict[bytes, bytes] = {}
            for _, dst, src, _ in lines:
                state[dst] = src if src.isdigit() else state[src]
            assert state[m.group(1)] == names[-1]
            times = collections.Counter(dst for _, dst, _, _ in lines)
            if recency:  # the asked name is one assigned again whenever there is one
                assert times[m.group(1)] > 1 or max(times.values()) == 1
            copied = [i for i, (_, _, src, _) in enumerate(lines) if not src.isdigit()]
            late_literals += any(src.isdigit() for _, _, src, _ in lines[copied[0] :]) if copied else 0
            # Each step is the latest assignment of the name before the line found last.
            bound = len(lines)
            offset = m.start(2)
            for name, source in itertools.pairwise(names):
                k = max(i for i in range(bound) if lines[i][1] == name)
                lo, _, src, line = lines[k]
                assert src == source
                offset += len(name) + 3
                steps.append((offset - 1, lo + len(line) - len(src), lo + len(line), len(lines)))
                bound = k
            lengths.add(len(names))
            expected[m.start(2) + 1 : m.end(2)] = True
            at = m.end()
        assert (answers == expected).all()
        assert [(e.query, e.lo, e.hi, len(e.records)) for e in evidence] == steps
        assert not any(e.keyed for e in evidence)
        # every rival is a line's value, the bytes after `x = `
        assert all(PROGRAM_LINE.fullmatch(text[lo - 4 : hi]) for e in evidence for lo, hi in e.records)
    assert {2, 3, 4} <= lengths  # answers of one, two and three lookups
    # chain programs give every literal first; their recency form mixes literals and copies
    assert (late_literals > 20) if recency else (late_literals == 0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz0123456789 =", dtype=np.uint8)
    assert_rows_weigh_answers(corpus, "recency" if recency else "program", 24, 64, letters)


def _program_lines(block: bytes, start: int) -> list[tuple[int, bytes, bytes, bytes]]:
    """Each newline-led line of a program block at row position `start`: where its text starts
    in the row, its name, its source (a name or a literal) and its text."""
    out, k = [], start
    for part in block.split(b"\n")[1:]:
        m = PROGRAM_LINE.fullmatch(part)
        assert m is not None, part
        out.append((k + 1, m.group(1), m.group(2), part))
        k += 1 + len(part)
    return out


def test_answer_weight_scales_answer_targets_only(corpus) -> None:  # type: ignore[no-untyped-def]
    recipe = mixed()
    weighted = dataclasses.replace(
        recipe, phases=(dataclasses.replace(recipe.phases[0], answer_weight=25.0), *recipe.phases[1:])
    )
    plain, heavy = (MixtureSampler(corpus["train"], r, window=128).batch(2) for r in (recipe, weighted))
    assert (plain.ids == heavy.ids).all()  # the weight changes the loss, not the data
    answer = np.zeros(plain.targets.shape, dtype=bool)
    for row, sample in enumerate(plain.samples):
        if sample is not None:
            p = plain.prompt_len
            answer[row, p : p + len(sample.answer)] = True
            for a, b in sample.train_spans:
                answer[row, a:b] = True
    assert answer.any() and (plain.targets.numpy()[answer] == recipe.phases[0].answer_weight).all()
    assert (heavy.targets.numpy()[answer] == 25).all()
    assert (heavy.targets.numpy()[~answer] == plain.targets.numpy()[~answer]).all()
    with pytest.raises(ValueError, match="answer_weight"):
        dataclasses.replace(recipe.phases[0], answer_weight=0.0)


def test_a_cycled_phase_takes_its_row_shapes_in_turn(corpus) -> None:  # type: ignore[no-untyped-def]
    cycle = ((128, 4, 2), (256, 2, None))
    phase = Phase("lengths", steps=5, seq_len=256, batch=2, cycle=cycle, prompt_from=0.25)
    recipe = dataclasses.replace(tiny(), phases=(tiny().phases[0], phase), stages=())
    first = recipe.phases[0].steps
    sampler = MixtureSampler(corpus["train"], recipe, window=32)
    shapes = [tuple(sampler.batch(first + k).ids.shape) for k in range(5)]
    assert shapes == [(4, 128), (2, 256), (4, 128), (2, 256), (4, 128)]
    assert [recipe.phase_at(first + k).micro_batch for k in range(3)] == [2, None, 2]
    assert (
        recipe.phase_at(first + 1).cycle == () and recipe.phase_at(first + 9).seq_len == 128
    )  # past the end: the last
    assert phase.tokens == 3 * 4 * 128 + 2 * 2 * 256 and phase.describe() == "4 × 128 / 2 × 256 in turn"
    assert recipe.total_tokens == recipe.phases[0].tokens + phase.tokens
    # prompt_from lowers the shortest prompt: 256-token rows get prompts from 64 tokens on
    longer = dataclasses.replace(phase, prompt_from=0.5, steps=400)
    wide = dataclasses.replace(phase, steps=400)
    lows = {
        name: min(
            MixtureSampler(corpus["train"], dataclasses.replace(recipe, phases=(p,)), window=32)
            .batch(k)
            .prompt_len
            for k in range(1, 400, 2)
        )
        for name, p in (("half", longer), ("quarter", wide))
    }
    assert lows["half"] >= 128 and 64 <= lows["quarter"] < 128
    with pytest.raises(ValueError, match="prompt_from"):
        dataclasses.replace(phase, prompt_from=0.0)
    with pytest.raises(ValueError, match="cycle"):
        dataclasses.replace(phase, cycle=((128, 0, None),))


def test_small_keeps_short_rows_beside_long_ones_in_its_last_phase() -> None:
    recipe = small()
    last = recipe.phases[-1]
    lengths = {recipe.phase_at(recipe.total_steps - 1 - k).seq_len for k in range(3)}
    assert lengths == {1024, 2048, 4096} and last.prompt_from < 0.5
    assert {recipe.phase_at(s).batch * recipe.phase_at(s).seq_len for s in range(3500, 3510)} == {8192}


def test_replay_steps_put_evidence_before_the_boundary(corpus) -> None:  # type: ignore[no-untyped-def]
    mix = Mixture(text=0.0, passkey=1.0, multihop=0.0, chain=0.0, extract=0.0, tool=0.0)
    paths = Paths(full=1.0, decoder_replay=1.0, bounded_prob=1.0, boundary_prob=1.0)
    recipe = dataclasses.replace(small(), phases=(Phase("p", 10, 1024, 4, mix, paths),), warmup=1, stages=())
    s = MixtureSampler(corpus["train"], recipe, window=128)
    checked = 0
    for step in range(6):
        b = s.batch(step)
        assert b.cut > 0 and b.cut % 2 == 0 and b.cut < b.prompt_len
        for sample in b.samples:
            if sample is not None and b.cut - 128 > 40:
                assert sample.evidence[1] == b.cut - 128
                checked += 1
    assert checked
