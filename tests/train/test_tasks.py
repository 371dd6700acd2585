"""Task generators whose answers an independent reading of the prompt confirms (and whose
scorers accept them), traced answers that write each step, and passkey depths and evidence
placement as asked."""

from __future__ import annotations

import itertools
import json
import re

import numpy as np
import pytest

from replaykv.train.data import load_corpus
from replaykv.train.tasks import TASKS, TOKENIZER, generate, score


@pytest.fixture(scope="module")
def corpus():  # type: ignore[no-untyped-def]
    return load_corpus(max_files=40, heldout_percent=25)


def _check_answer(sample, prompt: str) -> None:  # type: ignore[no-untyped-def]
    """Recompute the answer from the prompt text alone."""
    if sample.task == "passkey":
        assert re.findall(r"The pass key is (\d+)\.", prompt) == [sample.answer_text]
    elif sample.task == "multihop":
        links = dict(re.findall(r"\n([A-Z0-9]{4}) -> ([A-Z0-9]{4})\n", prompt))
        hops, start = re.search(r"Follow (\d) links from ([A-Z0-9]{4}):", prompt).groups()  # type: ignore[union-attr]
        code = start
        for _ in range(int(hops)):
            code = links[code]
        assert code == sample.answer_text
    elif sample.task == "chain":
        env: dict[str, int] = {}
        for name, rhs in re.findall(r"^([a-z]) = (\d+|[a-z])$", prompt, flags=re.M):
            env[name] = int(rhs) if rhs.isdigit() else env[rhs]
        q = re.search(r"print\(([a-z])\)<\|end\|>", prompt).group(1)  # type: ignore[union-attr]
        assert str(env[q]) == sample.answer_text
    elif sample.task == "extract":
        rec = json.loads(sample.answer_text)
        assert set(rec) == {"name", "year", "city", "job"}
        assert all(str(v) in prompt for v in rec.values())
    elif sample.task == "tool":
        results = re.findall(r"<\|tool\|>(.*?)<\|end\|>", prompt)
        key = re.search(r"value of (\w+)\?", prompt).group(1)  # type: ignore[union-attr]
        for text in results:
            value = json.loads(text)[key]
            if isinstance(value, str):
                key = value.removeprefix("see ")
            else:
                assert str(value) == sample.answer_text


def _render(ids: tuple[int, ...]) -> str:
    names = {v: k for k, v in TOKENIZER.special_ids.items()}
    return "".join(names[i] if i in names else chr(i) for i in ids)


@pytest.mark.parametrize("task", TASKS)
def test_generated_answers_are_verifiable_and_scored(corpus, task: str) -> None:  # type: ignore[no-untyped-def]
    made = 0
    for seed in range(6):
        for p_len in (160, 400, 1200):
            sample = generate(task, np.random.default_rng([seed, p_len]), corpus["train"], p_len)
            if sample is None:
                continue
            made += 1
            assert len(sample.prompt) == p_len and sample.prompt[-1] == TOKENIZER.special_ids["<|assistant|>"]
            assert sample.answer[-1] == TOKENIZER.special_ids["<|end|>"]
            assert TOKENIZER.decode(list(sample.answer[:-1])) == sample.answer_text
            assert score(sample, sample.answer_text) and score(sample, f" {sample.answer_text}\n")
            assert not score(sample, sample.answer_text[:-1] + "#")
            e0, e1 = sample.evidence
            assert 0 < e0 < e1 <= p_len
            if task != "extract":
                assert sample.answer_text in TOKENIZER.decode(list(sample.prompt[e0:e1]))
            _check_answer(sample, _render(sample.prompt))
    assert made >= 6


def test_traced_multihop_answers_name_every_code_reached(corpus) -> None:  # type: ignore[no-untyped-def]
    made = 0
    for seed in range(10):
        hops = 1 + seed % 3
        rng = [seed, hops]
        plain = generate("multihop", np.random.default_rng(rng), corpus["train"], 700, hops=hops)
        traced = generate("multihop", np.random.default_rng(rng), corpus["train"], 700, hops=hops, trace=True)
        assert plain is not None and traced is not None
        # the same prompt, evidence and chance: only the answer's form differs
        assert (traced.prompt, traced.evidence, traced.chance) == (plain.prompt, plain.evidence, plain.chance)
        prompt = _render(traced.prompt)
        links = dict(re.findall(r"\n([A-Z0-9]{4}) -> ([A-Z0-9]{4})\n", prompt))
        start = re.search(r"Follow \d links from ([A-Z0-9]{4}):", prompt).group(1)  # type: ignore[union-attr]
        codes = [links[start]]
        while len(codes) < hops:
            codes.append(links[codes[-1]])
        # the question's number, then each code with the links left after it: `2: B (1) -> C (0)`
        numbered = [f"{code} ({hops - k - 1})" for k, code in enumerate(codes)]
        assert traced.answer_text == f"{hops}: " + " -> ".join(numbered) and plain.answer_text == codes[-1]
        assert traced.answer_text.endswith(" (0)") and f"Follow {hops} links" in prompt
        assert TOKENIZER.decode(list(traced.answer[:-1])) == traced.answer_text
        # meta["links"]: the chain's records in order, for the per-hop evidence
        assert [_render(traced.prompt[lo:hi]) for lo, hi in traced.meta["links"]] == [
            f"{a} -> {b}" for a, b in zip([start, *codes], codes, strict=False)
        ]
        assert (
            traced.meta["links"][-1][0] > traced.evidence[0]
            and traced.meta["links"][-1][1] < traced.evidence[1]
        )
        assert score(traced, traced.answer_text)
        assert not score(traced, codes[-1]) and not score(traced, " -> ".join(codes))  # all of it
        made += 1
    assert made == 10


def test_traced_chain_answers_write_the_lines_behind_the_value(corpus) -> None:  # type: ignore[no-untyped-def]
    longer = 0
    for seed in range(24):
        rng = [seed, 7]
        plain = generate("chain", np.random.default_rng(rng), corpus["train"], 900)
        traced = generate("chain", np.random.default_rng(rng), corpus["train"], 900, trace=True)
        assert plain is not None and traced is not None
        assert (traced.prompt, traced.evidence, traced.chance) == (plain.prompt, plain.evidence, plain.chance)
        prompt = _render(traced.prompt)
        lines = re.findall(r"^([a-z]) = (\d+|[a-z])$", prompt, flags=re.M)
        q = re.search(r"print\(([a-z])\)<\|end\|>", prompt).group(1)  # type: ignore[union-attr]
        # run the program, keeping for every line which line last set each name before it
        setter: dict[str, int] = {}
        before: list[dict[str, int]] = []
        for k, (dst, _) in enumerate(lines):
            before.append(dict(setter))
            setter[dst] = k
        names, k = [q], setter[q]
        while True:
            names.append(lines[k][1])
            if lines[k][1].isdigit():
                break
            k = before[k][lines[k][1]]
        assert traced.answer_text == " = ".join(names) and names[-1] == plain.answer_text
        # each question: the answer's next name or value, and the value of the statement that
        # gives it (`b` of `a = b`, the bytes copied)
        pairs = list(itertools.pairwise(names))
        assert [(o, _render(traced.prompt[lo - 4 : hi])) for o, (lo, hi) in traced.meta["questions"]] == [
            (len(" = ".join(names[: i + 1])) + 3, f"{a} = {b}") for i, (a, b) in enumerate(pairs)
        ]
        assert [_render(traced.prompt[lo:hi]) for lo, hi in traced.meta["records"]] == [
            f"{a} = {b}" for a, b in lines
        ]
        assert [_render(traced.prompt[lo:hi]) for lo, hi in traced.meta["values"]] == [b for _, b in lines]
        assert score(traced, traced.answer_text) and not score(traced, plain.answer_text)
        longer += len(names) > 3
    assert longer >= 4


def test_passkey_depths_and_evidence_placement(corpus) -> None:  # type: ignore[no-untyped-def]
    starts = []
    for d in (0.0, 0.25, 0.5, 0.75, 1.0):
        s = generate("passkey", np.random.default_rng(0), corpus["train"], 1000, depth=d)
        assert s is not None and s.meta["depth"] == pytest.approx(d, abs=0.01)
        starts.append(s.evidence[0])
    assert starts == sorted(starts) and starts[-1] - starts[0] > 800
    # Evidence that ends exactly where a replay boundary s = cut - W will be.
    for task in ("passkey", "multihop", "chain", "extract"):
        for end in (300, 301, 640):
            s = generate(task, np.random.default_rng(end), corpus["train"], 900, evidence_end=end)
            assert s is not None and s.evidence[1] == end, task
