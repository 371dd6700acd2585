"""The record-key loss: it reads each record's code from the entry at its answer (checked against
a reference over the entries the attention itself received), teaches the KV source's compressor,
lowers when trained, runs in the training loop with its heads outside the export and inside the
resumable state, and is refused where it is not implemented (pipeline training, a layer that is
no KV source)."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch

from replaykv.model.spec import ModelSpec
from replaykv.train.keys import RecordKeys
from replaykv.train.loop import train
from replaykv.train.paths import path_losses
from replaykv.train.pipeline.run import _check_recipe
from replaykv.train.recipes import Mixture, Phase, tiny
from replaykv.train.state import STATE
from tests.train.lookups import LENGTH, assert_reaches_compressor, lookup_rows, tiny_model


def _forward(model, keys, ids, rows):  # type: ignore[no-untyped-def]
    spec = ModelSpec.from_config(model.config)
    keys.arm(rows, ids)
    path_losses(model, spec, ids, torch.ones_like(ids, dtype=torch.float32), LENGTH // 2, 0)
    return keys.pop()


def test_it_reads_each_records_code_from_the_entry_at_its_answer(corpus) -> None:  # type: ignore[no-untyped-def]
    model = tiny_model()
    ids, rows = lookup_rows(corpus)
    keys = RecordKeys(model)
    assert all(float(q.abs().sum()) == 0 for q in keys.parameters())  # heads start at zero
    torch.manual_seed(1)
    for q in keys.parameters():  # a read-out that tells entries apart
        torch.nn.init.normal_(q, std=0.1)
    sources = [i for i in range(len(model.model.layers)) if model.config.is_kv_source(i)]
    assert keys.layer_ids == tuple(sources) and sources
    captured = {}

    def grab(attn, args, output):  # type: ignore[no-untyped-def]
        captured.setdefault(attn.layer, (args[2].entries.detach().clone(), attn.ratio))

    handles = [model.model.layers[i].self_attn.register_forward_hook(grab) for i in sources]
    loss = _forward(model, keys, ids, rows)
    for h in handles:
        h.remove()
    assert loss is not None
    record = re.compile(rb"[A-Z0-9]{4} -> [A-Z0-9]{4}")
    per_layer = []
    for layer, (entries, ratio) in captured.items():
        terms = []
        for b, row in enumerate(rows):
            for lo, hi in sorted({span for e in row for span in e.records}):
                text = bytes(ids[b, lo:hi].tolist())
                assert record.fullmatch(text), text  # the layout the loss assumes: A at lo, B[0] at lo + 8
                entry = entries[b, (lo + 8) // ratio].double()
                head = keys.heads[str(layer)]
                logits = (entry @ head.weight.detach().double().T + head.bias.detach().double()).view(4, 256)
                terms += [float(-torch.log_softmax(logits[k], 0)[text[k]]) for k in range(4)]
        per_layer.append(np.mean(terms))
    assert float(loss) == pytest.approx(np.mean(per_layer), rel=1e-5)


def test_it_teaches_the_source_and_lowers_when_trained(corpus) -> None:  # type: ignore[no-untyped-def]
    model = tiny_model()
    ids, rows = lookup_rows(corpus)
    keys = RecordKeys(model)
    opt = torch.optim.AdamW([*model.parameters(), *keys.parameters()], lr=3e-3)
    seen = []
    for i in range(12):
        opt.zero_grad()
        loss = _forward(model, keys, ids, rows)
        assert loss is not None
        loss.backward()
        if i == 3:  # a zero head sends no gradient; it grows along what it reads
            assert_reaches_compressor(model.model.layers[keys.layer_ids[0]].self_attn)
        opt.step()
        seen.append(float(loss))
    keys.remove()
    assert seen[-1] < 0.8 * seen[0], seen
    assert seen[0] == pytest.approx(np.log(256), rel=1e-6)  # zero heads: uniform over bytes


def test_a_layer_that_is_no_kv_source_is_refused_by_name() -> None:
    model = tiny_model()
    other = next(i for i in range(len(model.model.layers)) if not model.config.is_kv_source(i))
    with pytest.raises(ValueError, match=rf"record-key layers \[{other}\] are not KV sources"):
        RecordKeys(model, layers=(other,))


def test_in_the_loop_its_heads_train_beside_the_model_outside_the_export_and_resume(corpus, tmp_path) -> None:  # type: ignore[no-untyped-def]
    phase = Phase("keys", 3, LENGTH, 2, Mixture(lookup=1.0), record_keys=1.0)
    recipe = dataclasses.replace(tiny(), phases=(phase,), log_every=1, quick_eval=None)
    train(recipe, tmp_path, corpus=corpus, progress=False, evaluate_at_end=False, max_steps=2)
    logged = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "record_keys" in r]
    assert len(steps) == 2 and all(np.isfinite(r["record_keys"]) and r["record_keys"] > 0 for r in steps)
    state = torch.load(tmp_path / STATE, weights_only=False)
    assert not any("heads" in k for k in state["model"])  # the heads are not the model's ...
    assert state["record_keys"] and all("heads" in k for k in state["record_keys"])  # ... but the state's
    # An exact resume continues them: the third step equals the third step of one whole run.
    rest = train(recipe, tmp_path, resume=True, corpus=corpus, progress=False, evaluate_at_end=False)
    whole = train(recipe, tmp_path / "whole", corpus=corpus, progress=False, evaluate_at_end=False)
    assert rest.losses == whole.losses[2:]
    a, b = (torch.load(d / STATE, weights_only=False) for d in (tmp_path, tmp_path / "whole"))
    assert all(torch.equal(a["record_keys"][k], b["record_keys"][k]) for k in b["record_keys"])
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])


def test_pipeline_training_refuses_it() -> None:
    phase = dataclasses.replace(tiny().phases[0], record_keys=0.5)
    with pytest.raises(NotImplementedError, match="record-key loss"):
        _check_recipe(dataclasses.replace(tiny(), phases=(phase,)))
