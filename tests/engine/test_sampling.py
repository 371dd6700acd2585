"""Sampling and stopping: seeded reproducibility, top-k = 1 is greedy, stop tokens and eos, stop
strings (through the engine, and the text stream's hold-back rules on their own)."""

from __future__ import annotations

import pytest
import torch

from replaykv.engine import Engine, Request, SamplingParams
from replaykv.engine.api import SamplingParams as Params
from replaykv.engine.sampling import OutputStream, Sampler
from tests.engine.conftest import prompt_of

PROMPT = tuple(prompt_of(40, 11))


def run(engine: Engine, **sampling: object) -> tuple[list[int], str, str]:
    r = engine.generate(Request(PROMPT, SamplingParams(**sampling)))  # type: ignore[arg-type]
    return r.token_ids, r.text, r.finish_reason


def test_seeded_sampling_is_reproducible(cold_engine: Engine) -> None:
    a = run(cold_engine, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    b = run(cold_engine, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    assert a == b
    # batched with other requests, the same seed still draws the same tokens
    handles = [
        cold_engine.submit(
            Request(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True))
        )
        for s in (7, 8)
    ]
    assert handles[0].result(timeout=60).token_ids == a[0]


def test_top_k_one_is_greedy(cold_engine: Engine) -> None:
    greedy = run(cold_engine, max_tokens=6, temperature=0.0, ignore_eos=True)
    top1 = run(cold_engine, max_tokens=6, temperature=1.3, top_k=1, top_p=0.5, seed=3, ignore_eos=True)
    assert top1 == greedy


def test_stop_token_and_eos(cold_engine: Engine) -> None:
    greedy, _, _ = run(cold_engine, max_tokens=8, temperature=0.0, ignore_eos=True)
    k = next(i for i in range(1, 8) if greedy[i] not in greedy[:i])
    ids, _, reason = run(cold_engine, max_tokens=8, temperature=0.0, stop_token_ids=(greedy[k],))
    assert reason == "stop" and ids == greedy[:k]  # the stop token itself is not returned
    # eos stops unless ignore_eos
    tokens = OutputStream(Params(max_tokens=5), lambda ids: "", eos_ids=(257,))
    assert tokens.push(3)[2] is None and tokens.push(257) == ((), "", "stop")
    ignoring = OutputStream(Params(max_tokens=5, ignore_eos=True), lambda ids: "", eos_ids=(257,))
    assert ignoring.push(257) == ((257,), "", None)


def test_stop_string_through_engine(cold_engine: Engine) -> None:
    _, text, _ = run(cold_engine, max_tokens=12, temperature=0.0, ignore_eos=True)
    stop = next(c for c in text[1:] if c != "\ufffd")
    expected = text[: text.index(stop)]
    ids, got, reason = run(cold_engine, max_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop,))
    assert reason == "stop" and got == expected and len(ids) < 12


def byte_stream(params: Params) -> OutputStream:
    return OutputStream(params, lambda ids: bytes(ids).decode("utf-8", errors="replace"), eos_ids=())


def test_stop_string_is_held_back_and_cut() -> None:
    stream = byte_stream(Params(max_tokens=20, stop=("<end>", "zz")))
    pieces = [stream.push(t) for t in b"ab<en"]
    assert "".join(p[1] for p in pieces) == "ab"  # "<en" might become "<end>"
    assert all(p[2] is None for p in pieces)
    ids, text, reason = stream.push(ord("d"))
    assert (text, reason) == ("", None)
    ids, text, reason = stream.push(ord(">"))
    assert reason == "stop" and stream.text == "ab" and ids == (ord(">"),)


def test_no_stop_trim_keeps_the_stop_in_the_output() -> None:
    """SGLang's no_stop_trim: the stop string, or the stop token, that ended the output stays in it."""
    stream = byte_stream(Params(max_tokens=20, stop=("b<", "ab<e"), no_stop_trim=True))
    text = "".join(stream.push(t)[1] for t in b"ab<")
    assert stream.finish_reason == "stop" and text == stream.text == "ab<"  # the earliest stop, whole
    stream = byte_stream(Params(max_tokens=20, stop=("<end>",), no_stop_trim=True))
    text = "".join(stream.push(t)[1] for t in b"ab<end>")
    assert text == "ab<end>" and stream.token_ids == list(b"ab<end>")
    tokens = OutputStream(Params(max_tokens=5, no_stop_trim=True), lambda ids: "x" * len(ids), eos_ids=(257,))
    assert tokens.push(3)[2] is None and tokens.push(257) == ((257,), "x", "stop")
    assert tokens.token_ids == [3, 257]


def test_held_text_released_when_it_cannot_stop() -> None:
    stream = byte_stream(Params(max_tokens=20, stop=("<end>",)))
    out = "".join(stream.push(t)[1] for t in b"a<ex")
    assert out == "a<ex"


def test_multibyte_characters_are_not_split() -> None:
    stream = byte_stream(Params(max_tokens=3))
    first = stream.push(0xC3)  # first byte of "é"
    assert first[1] == ""
    second = stream.push(0xA9)
    assert second[1] == "é"
    last = stream.push(ord("!"))
    assert last == ((ord("!"),), "!", "length")


def test_top_p_keeps_the_smallest_set() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(Params(temperature=1.0, top_p=0.7, seed=0))
    drawn = {sampler.sample(logits) for _ in range(200)}
    assert drawn == {0, 1}
    top2 = Sampler(Params(temperature=1.0, top_k=2, seed=0))
    assert {top2.sample(logits) for _ in range(200)} == {0, 1}


def _reference_adjusted(logits: list[float], p: Params, prompt: list[int], output: list[int]) -> list[float]:
    """The logit processors written out per token, from their definitions (vLLM / HF order)."""
    x = list(logits)
    for t, b in p.logit_bias:
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.presence_penalty + p.frequency_penalty * output.count(t)
    return x


def test_penalties_and_bias_match_the_reference() -> None:
    torch.manual_seed(0)
    logits = torch.randn(50)
    prompt, output = [1, 2, 3, 3, 9], [4, 4, 4, 2, 7]
    params = Params(
        temperature=0.0,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.25,
        logit_bias=((5, 3.0), (2, -1.5)),
    )
    sampler = Sampler(params, prompt)
    for t in output:  # the sampler counts what it drew; feed the output through it
        sampler.observe(t)
    got = sampler.adjusted(logits).tolist()
    want = _reference_adjusted(logits.tolist(), params, prompt, output)
    assert got == pytest.approx(want, abs=1e-6)
    assert logits.tolist() != got  # the input is not modified in place
    assert sampler.sample(logits) == max(range(50), key=lambda i: want[i])


def test_a_strong_bias_forces_a_token_and_frequency_penalty_breaks_loops() -> None:
    logits = torch.zeros(10)
    forced = Sampler(Params(temperature=1.0, seed=1, logit_bias=((6, 100.0),)))
    assert {forced.sample(logits) for _ in range(20)} == {6}
    # greedy on flat logits repeats token 0; a frequency penalty walks through the vocabulary
    looping = Sampler(Params(temperature=0.0, frequency_penalty=1.0))
    assert [looping.sample(logits) for _ in range(10)] == list(range(10))


def test_min_p_drops_unlikely_tokens() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(Params(temperature=1.0, min_p=0.35, seed=0))  # keeps p >= 0.175
    assert {sampler.sample(logits) for _ in range(300)} == {0, 1}
    everything = Sampler(Params(temperature=1.0, min_p=0.0, seed=0))
    assert {everything.sample(logits) for _ in range(300)} == {0, 1, 2, 3}


def test_new_sampling_fields_are_checked() -> None:
    from replaykv.engine.sampling import check_sampling

    for bad, field in (
        (Params(min_p=1.5), "min_p"),
        (Params(repetition_penalty=0.0), "repetition_penalty"),
        (Params(presence_penalty=2.5), "presence_penalty"),
        (Params(frequency_penalty=float("nan")), "frequency_penalty"),
        (Params(logit_bias=((999, 1.0),)), "logit_bias"),
    ):
        try:
            check_sampling(bad, vocab_size=100)
        except ValueError as e:
            assert field in str(e)
        else:
            raise AssertionError(f"{field} was not checked")


def test_penalties_through_the_engine(cold_engine: Engine) -> None:
    greedy, _, _ = run(cold_engine, max_tokens=8, temperature=0.0, ignore_eos=True)
    banned = greedy[0]
    ids, _, _ = run(cold_engine, max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias=((banned, -100.0),))
    assert banned not in ids
    fresh, _, _ = run(cold_engine, max_tokens=8, temperature=0.0, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0)
    assert len(set(fresh)) >= len(set(greedy))
