"""The evidence-attention loss: it scores the attention the layers compute (checked against the
real attention's own queries and entries), reaches queries and the source's compressor, lowers
when trained, leaves the language-model loss and a recipe without it untouched, and is refused
where it is not implemented (pipeline training)."""

from __future__ import annotations

import dataclasses
import itertools
import re

import numpy as np
import pytest
import torch

import replaykv.model.attention_v41 as attention_v41
from replaykv.model.compressor import causal_entry_limit
from replaykv.model.spec import ModelSpec
from replaykv.train.data import Batch, MixtureSampler
from replaykv.train.distill import IndexerDistillation
from replaykv.train.evidence import EvidenceAttention
from replaykv.train.loop import accumulate_gradients, train
from replaykv.train.paths import path_losses
from replaykv.train.pipeline.run import _check_recipe
from replaykv.train.recipes import Mixture, Phase, tiny
from tests.train.lookups import LENGTH, assert_reaches_compressor, lookup_rows, tiny_model


def _reference(captured, rows, contrast: bool = False, tail: int = 0) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """From the queries and entries the attention itself received: per layer and question, the
    mean over heads of the softmax mass on the record's entries among the visible ones (with
    `contrast`, among the visible ones that cover one of the row's records; with `tail`, a
    record is its last `tail` bytes)."""

    def overlaps(i: int, ratio: int, lo: int, hi: int) -> bool:
        lo = max(lo, hi - tail) if tail else lo
        return i * ratio + ratio > lo and i * ratio < hi

    losses = []
    for q, entries, ratio, positions in captured:
        per_layer = []
        for b, row in enumerate(rows):
            for e in row:
                visible = int(causal_entry_limit(positions[b, e.query], ratio))
                pool = [
                    i
                    for i in range(visible)
                    if not contrast or any(overlaps(i, ratio, lo, hi) for lo, hi in e.records)
                ]
                covered = [k for k, i in enumerate(pool) if overlaps(i, ratio, e.lo, e.hi)]
                if not covered or (contrast and len(covered) == len(pool)):
                    continue
                heads = []
                for h in range(q.shape[2]):
                    logits = [float(q[b, e.query, h] @ entries[b, i]) / q.shape[-1] ** 0.5 for i in pool]
                    p = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
                    heads.append(float(p[covered].sum()))
                per_layer.append(-np.log(np.mean(heads) + 1e-6))
        losses.append(np.mean(per_layer))
    return torch.tensor(np.mean(losses))


@pytest.mark.parametrize(
    ("contrast", "tail", "layers", "bf16"),
    [
        (False, 0, (), False),
        (True, 0, (), False),
        (True, 4, (), False),
        (True, 4, (6, 7, 9), False),
        (True, 4, (), True),
    ],
    ids=["entries", "records", "answers", "answers-in-decoder-layers", "answers-under-bf16-products"],
)
def test_the_loss_reads_the_attention_the_layers_compute(
    corpus, monkeypatch, contrast, tail, layers, bf16
) -> None:  # type: ignore[no-untyped-def]
    """Under bf16 products (`--precision bf16`) the queries and entries are the bf16 model's;
    the softmax and the mass over them stay float32, as the reference computes them."""
    model = tiny_model()
    spec = ModelSpec.from_config(model.config)
    ids, rows = lookup_rows(corpus)
    captured = []
    real = attention_v41.joint_attention

    def capture(q, win_keys, step, w, sinks, entries=None, ratio=0, selection=None, ring_first=None):  # type: ignore[no-untyped-def]
        if entries is not None and q.shape[1] == LENGTH:
            captured.append((q.detach().float(), entries.detach().float(), ratio, step.positions))
        return real(q, win_keys, step, w, sinks, entries, ratio, selection, ring_first)

    monkeypatch.setattr(attention_v41, "joint_attention", capture)
    hooks = EvidenceAttention(model)
    with_entries = [i for i, r in enumerate(model.config.compress_ratios) if r]
    assert hooks.layer_ids == tuple(with_entries)
    hooks.arm(rows, LENGTH, contrast, tail, layers)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        path_losses(model, spec, ids, torch.ones_like(ids, dtype=torch.float32), LENGTH // 2, 0)
    got = hooks.pop()
    hooks.remove()
    assert got is not None and len(captured) == len(with_entries)  # captured in layer order
    taught = [c for i, c in zip(with_entries, captured, strict=True) if not layers or i in layers]
    assert len(taught) == (len(layers) or len(with_entries))
    assert float(got.detach()) == pytest.approx(float(_reference(taught, rows, contrast, tail)), rel=1e-5)
    assert hooks.pop() is None  # popped and disarmed


@pytest.mark.parametrize("keyed_layers", [(6, 9), ()], ids=["keyed-in-decoder-layers", "keyed-everywhere"])
def test_keyed_records_are_taught_in_layers_of_their_own(corpus, monkeypatch, keyed_layers) -> None:  # type: ignore[no-untyped-def]
    """`keyed_layers`: a question whose records are keyed by a code is taught in those layers
    (empty: every layer with entries), the others in `layers`; a layer teaches the questions of
    both kinds it is named for, and the loss is the mean over the layers that taught any."""
    model = tiny_model()
    spec = ModelSpec.from_config(model.config)
    ids, rows = lookup_rows(corpus)
    rows = (tuple(dataclasses.replace(e, keyed=False) for e in rows[0]), rows[1])  # a chain's, a lookup's
    captured = {}
    real = attention_v41.joint_attention
    order = iter([i for i, r in enumerate(model.config.compress_ratios) if r])

    def capture(q, win_keys, step, w, sinks, entries=None, ratio=0, selection=None, ring_first=None):  # type: ignore[no-untyped-def]
        if entries is not None and q.shape[1] == LENGTH:
            captured[next(order)] = (q.detach().float(), entries.detach().float(), ratio, step.positions)
        return real(q, win_keys, step, w, sinks, entries, ratio, selection, ring_first)

    monkeypatch.setattr(attention_v41, "joint_attention", capture)
    hooks = EvidenceAttention(model)
    first, layers = hooks.layer_ids[0], (hooks.layer_ids[0], 9)
    hooks.arm(rows, LENGTH, True, 4, layers, keyed_layers)
    path_losses(model, spec, ids, torch.ones_like(ids, dtype=torch.float32), LENGTH // 2, 0)
    got = hooks.pop()
    hooks.remove()
    expected = []
    for i, c in captured.items():
        taught = (rows[0] if i in layers else (), rows[1] if not keyed_layers or i in keyed_layers else ())
        if any(taught):
            expected.append(float(_reference([c], taught, True, 4)))
    assert len(expected) == (3 if keyed_layers else len(hooks.layer_ids))
    assert first in captured and first not in keyed_layers
    assert got is not None and float(got.detach()) == pytest.approx(float(np.mean(expected)), rel=1e-5)


def test_naming_a_layer_without_entries_is_an_error() -> None:
    hooks = EvidenceAttention(tiny_model())
    with pytest.raises(ValueError, match=r"evidence layers \[0, 1\] read no compressed entries"):
        hooks.arm((), LENGTH, layers=(0, 1, 2))
    hooks.remove()
    with pytest.raises(ValueError, match="evidence_layers are layer indices"):
        Phase("base", 4, LENGTH, 2, Mixture(lookup=1.0), evidence_loss=1.0, evidence_layers=(-1,))
    with pytest.raises(ValueError, match="evidence_layers are layer indices"):
        Phase("base", 4, LENGTH, 2, Mixture(lookup=1.0), evidence_loss=1.0, evidence_keyed_layers=(-1,))


def test_the_loss_trains_queries_and_the_compressor_and_falls(corpus) -> None:  # type: ignore[no-untyped-def]
    model = tiny_model()
    spec = ModelSpec.from_config(model.config)
    ids, rows = lookup_rows(corpus)
    hooks = EvidenceAttention(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    seen = []
    for i in range(15):
        opt.zero_grad()
        hooks.arm(rows, LENGTH)
        path_losses(model, spec, ids, torch.ones_like(ids, dtype=torch.float32), LENGTH // 2, 0)
        loss = hooks.pop()
        assert loss is not None
        loss.backward()
        if i == 0:
            attn = model.model.layers
            reuse, source = attn[3].self_attn, attn[2].self_attn  # layer 3 reads layer 2's entries
            assert float(reuse.q_b_proj.weight.grad.abs().sum()) > 0
            assert_reaches_compressor(source)
        opt.step()
        seen.append(float(loss))
    hooks.remove()
    assert seen[-1] < 0.8 * seen[0], seen


def test_a_recipe_without_it_is_unchanged_and_with_it_adds_only_its_term(corpus) -> None:  # type: ignore[no-untyped-def]
    ids, rows = lookup_rows(corpus, n=2)
    recipe = tiny()
    batch = Batch(
        ids, torch.ones_like(ids, dtype=torch.float32), LENGTH // 2, 0, ("lookup",) * 2, (None,) * 2, rows
    )
    logged, grads = {}, {}
    for weight in (0.0, 0.5):
        model = tiny_model()
        spec = ModelSpec.from_config(model.config)
        distill = IndexerDistillation(model, 0)
        hooks = EvidenceAttention(model) if weight else None
        phase = Phase("base", 4, LENGTH, 2, Mixture(lookup=1.0), evidence_loss=weight)
        logged[weight] = accumulate_gradients(
            model, spec, batch, phase, recipe, distill, torch.device("cpu"), 1, hooks
        )
        grads[weight] = model.model.layers[3].self_attn.q_b_proj.weight.grad.clone()
    assert "evidence" not in logged[0.0] and logged[0.5]["evidence"] > 0
    assert logged[0.5]["full"] == logged[0.0]["full"]  # the language-model loss is the same forward
    assert logged[0.5]["loss"] == logged[0.0]["loss"]
    assert not torch.equal(grads[0.5], grads[0.0])


def test_its_own_budget_clips_it_apart_from_the_rest(corpus) -> None:  # type: ignore[no-untyped-def]
    """`Phase.evidence_clip`: the gradient equals the rest's gradient clipped to the recipe's norm
    plus the evidence term's clipped to its own, each computed here from separate runs (the
    evidence term's as the difference of a run with it and one without)."""
    ids, rows = lookup_rows(corpus, n=2)
    batch = Batch(
        ids, torch.ones_like(ids, dtype=torch.float32), LENGTH // 2, 0, ("lookup",) * 2, (None,) * 2, rows
    )

    def grads(weight: float, clip: float, recipe_clip: float) -> tuple[list[torch.Tensor], dict[str, float]]:
        model = tiny_model()
        recipe = dataclasses.replace(tiny(), grad_clip=recipe_clip)
        hooks = EvidenceAttention(model) if weight else None
        phase = Phase("base", 4, LENGTH, 2, Mixture(lookup=1.0), evidence_loss=weight, evidence_clip=clip)
        distill = IndexerDistillation(model, 0)
        spec = ModelSpec.from_config(model.config)
        logged = accumulate_gradients(
            model, spec, batch, phase, recipe, distill, torch.device("cpu"), 1, hooks
        )
        zero = [torch.zeros_like(q) for q in model.parameters()]
        return [
            q.grad.detach().clone() if q.grad is not None else z
            for q, z in zip(model.parameters(), zero, strict=True)
        ], logged

    rest, _ = grads(0.0, 0.0, 1.0)
    both, _ = grads(2.0, 0.0, 1.0)
    ev = [b - r for b, r in zip(both, rest, strict=True)]
    norm_rest = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in rest])))
    norm_ev = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ev])))
    clip_rest, clip_ev = norm_rest / 4, norm_ev / 3  # both budgets bind
    got, logged = grads(2.0, clip_ev, clip_rest)
    assert logged["grad_norm_rest"] == pytest.approx(norm_rest, rel=1e-4)
    assert logged["grad_norm_evidence"] == pytest.approx(norm_ev, rel=1e-3)
    want = [r * (clip_rest / norm_rest) + e * (clip_ev / norm_ev) for r, e in zip(rest, ev, strict=True)]
    err = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    scale = max(float(w.abs().max()) for w in want)
    assert err <= 1e-4 * scale, (err, scale)
    # one clip over the sum would have given another gradient
    total = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(b) for b in both])))
    shared = [b * (clip_rest / total) for b in both]
    assert max(float((g - w).abs().max()) for g, w in zip(got, shared, strict=True)) > 100 * err


def test_its_own_budget_is_refused_by_name_with_fused_kernels_under_bf16(corpus, tmp_path) -> None:  # type: ignore[no-untyped-def]
    phase = dataclasses.replace(tiny().phases[0], evidence_loss=1.0, evidence_clip=1.0)
    recipe = dataclasses.replace(tiny(), phases=(phase,))
    with pytest.raises(NotImplementedError, match="evidence_clip with the fused kernels under bf16"):
        train(recipe, tmp_path, corpus=corpus, progress=False, kernels="fused", precision="bf16")
    assert not (tmp_path / "train_log.jsonl").exists()  # refused before the first step


def test_pipeline_training_refuses_it() -> None:
    _check_recipe(tiny())
    phase = dataclasses.replace(tiny().phases[0], evidence_loss=0.5)
    with pytest.raises(NotImplementedError, match="evidence-attention loss"):
        _check_recipe(dataclasses.replace(tiny(), phases=(phase,)))


def test_multihop_rows_carry_the_last_links_record_and_every_record_as_rivals(corpus) -> None:  # type: ignore[no-untyped-def]
    record = re.compile(rb"\n([A-Z0-9]{4}) -> ([A-Z0-9]{4})\n")
    only = Mixture(**{**{k: 0.0 for k in Mixture().weights}, "multihop": 1.0})
    phase = Phase("hops", 4, 512, 4, only, evidence_rows=("multihop",))
    sampler = MixtureSampler(corpus["train"], dataclasses.replace(tiny(), phases=(phase,)), 128)
    seen = 0
    for step in range(3):
        batch = sampler.batch(step)
        for row, sample, found in zip(batch.ids, batch.samples, batch.evidence, strict=True):
            if sample is None:  # a prompt the task could not fill falls back to text
                assert found == ()
                continue
            assert sample.task == "multihop" and len(found) == 1
            text = bytes(int(t) if t < 256 else 0 for t in row[: batch.prompt_len])
            (e,) = found
            assert e.query == batch.prompt_len - 1  # the row that predicts the answer's first byte
            assert text[e.lo : e.hi].endswith(b" -> " + sample.answer_text.encode())
            assert e.records == tuple((m.start(1), m.end(2)) for m in record.finditer(text))
            seen += 1
    assert seen >= 8
    # Off by default: a phase that reads lookup rows gives a multi-hop row no evidence.
    default = dataclasses.replace(phase, evidence_rows=("lookup",))
    batch = MixtureSampler(corpus["train"], dataclasses.replace(tiny(), phases=(default,)), 128).batch(0)
    assert batch.evidence == ((),) * 4


def _traced_rows(corpus, task: str, steps: int):  # type: ignore[no-untyped-def]
    """(row text, sample, evidence, prompt length) of the task rows of a phase of `task` rows
    alone with traced answers and evidence on them."""
    only = Mixture(**{**{k: 0.0 for k in Mixture().weights}, task: 1.0}, trace_hops=True, trace_chains=True)
    phase = Phase("traced", 4, 512, 4, only, evidence_rows=(task,))
    sampler = MixtureSampler(corpus["train"], dataclasses.replace(tiny(), phases=(phase,)), 128)
    for step in range(steps):
        batch = sampler.batch(step)
        for row, sample, found in zip(batch.ids, batch.samples, batch.evidence, strict=True):
            if sample is not None:
                yield bytes(int(t) if t < 256 else 0 for t in row), sample, found, batch.prompt_len


def test_traced_multihop_rows_ask_one_question_per_hop(corpus) -> None:  # type: ignore[no-untyped-def]
    longer = 0
    for text, sample, found, prompt_len in _traced_rows(corpus, "multihop", 4):
        steps = sample.answer_text.split(": ", 1)[1].split(" -> ")  # `2: B (1) -> C (0)`
        codes = [step.split(" (")[0] for step in steps]
        numbers = [e for e in found if not e.keyed]  # the question's number, then each count
        found = tuple(e for e in found if e.keyed)
        assert len(found) == sample.meta["hops"] == len(codes) == len(numbers) - 1
        hops = sample.meta["hops"]
        for k, e in enumerate(numbers):
            # the row before each number, which reads the question's number or the count before
            assert text[e.query + 1 : e.query + 2] == str(hops - k).encode()
            assert text[e.lo : e.hi] == str(hops - k + 1 if k else hops).encode() and e.hi == e.lo + 1
            assert (e.lo < prompt_len) == (k == 0) and (e.lo, e.hi) in e.records
        for e, code in zip(found, codes, strict=True):
            # the row that predicts this hop's code, and the record that gives it
            assert text[e.query + 1 : e.query + 5] == code.encode()
            assert text[e.lo : e.hi].endswith(b" -> " + code.encode())
            assert e.records == found[0].records and (e.lo, e.hi) in e.records and e.keyed
        assert found[0].query == prompt_len - 1 + len(f"{len(codes)}: ")  # after the question's number
        longer += len(codes) > 1
    assert longer >= 4


def test_traced_chain_rows_ask_for_each_line_behind_the_value(corpus) -> None:  # type: ignore[no-untyped-def]
    seen = 0
    for text, sample, found, prompt_len in _traced_rows(corpus, "chain", 3):
        names = sample.answer_text.split(" = ")
        assert len(found) == len(names) - 1 and found[0].query == prompt_len - 1 + len(names[0]) + 3
        for e, (dst, src) in zip(found, itertools.pairwise(names), strict=True):
            assert text[e.query + 1 : e.query + 1 + len(src)] == src.encode()
            assert text[e.lo - 4 : e.hi] == f"{dst} = {src}".encode() and (e.lo, e.hi) in e.records
            assert text[e.lo : e.hi] == src.encode()  # the value copied, not the whole statement
            assert not e.keyed  # a statement is no `A -> B` record for the record-key loss
        seen += 1
    assert seen >= 8


@pytest.mark.parametrize("kind", ["program", "recency"])
def test_program_rows_carry_each_step_and_train_through_the_loss(corpus, kind) -> None:  # type: ignore[no-untyped-def]
    only = Mixture(**{**{k: 0.0 for k in Mixture().weights}, kind: 1.0})
    phase = Phase(
        "programs", 4, 512, 2, only, evidence_loss=1.0, evidence_contrast=True, evidence_rows=(kind,)
    )
    recipe = dataclasses.replace(tiny(), phases=(phase,))
    batch = MixtureSampler(corpus["train"], recipe, 128).batch(0)
    assert batch.kinds == (kind, kind) and all(len(found) >= 4 for found in batch.evidence)
    for row, found in zip(batch.ids, batch.evidence, strict=True):
        text = bytes(int(t) if t < 256 else 0 for t in row)
        for e in found:
            # the row before a looked-up name or value, and the value of the line `dst = src`
            # that gives it
            line = text[e.lo - 4 : e.hi]
            assert re.fullmatch(rb"[a-z] = ([a-z]|[0-9]{3})", line) and (e.lo, e.hi) in e.records
            src = text[e.lo : e.hi]
            assert text[e.query + 1 : e.query + 1 + len(src)] == src and e.query > e.hi and not e.keyed
    model = tiny_model()
    spec = ModelSpec.from_config(model.config)
    hooks = EvidenceAttention(model)
    logged = accumulate_gradients(
        model, spec, batch, phase, recipe, IndexerDistillation(model, 0), torch.device("cpu"), 1, hooks
    )
    hooks.remove()
    assert logged["evidence"] > 0
