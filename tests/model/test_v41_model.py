"""DeepSeek-V4.1: the model against a naive dense reference written from the spec, chunked and
decode paths against one-shot prefill, the schedule's selection rules, and both checkpoint
namings and config styles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import replaykv.model.attention_v41 as attention_v41
from replaykv.cache.views import advance, allocate_view
from replaykv.model.attention import joint_attention
from replaykv.model.attention_v41 import IndexerV41
from replaykv.model.checkpoint import load_model, read_state_dict, save_pretrained
from replaykv.model.init import init_weights
from replaykv.model.layers import sinkhorn
from replaykv.model.presets_v41 import v41_tiny
from replaykv.model.spec import ModelSpec
from replaykv.model.v41 import DeepseekV41ForCausalLM
from tests.model.v41_reference import reference_logits
from tests.model.v41_reference import sinkhorn as reference_sinkhorn

# Schedules: the §10 checklist config, one without a candidate source, and one with a
# single ratio-2 source feeding Reuse + Reindex layers before a ratio-1 candidate source.
SCHEDULES = {
    "checklist": {},
    "no_candidates": dict(candidate_source_layer_id=-1),
    "three_sources": dict(
        num_hidden_layers=8,
        compress_ratios=(0, 2, 2, 2, 2, 1, 1, 1),
        kv_source_layer_ids=(1, 3, 5),
        index_source_layer_ids=(1, 3, 5, 7),
        candidate_source_layer_id=5,
    ),
}


def make_model(schedule: str, quant: bool, seed: int = 0) -> DeepseekV41ForCausalLM:
    cfg = v41_tiny().replace(kv_quant=quant, **SCHEDULES[schedule])
    model = init_weights(DeepseekV41ForCausalLM(cfg), seed=seed).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", ".base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model


def run(
    model: DeepseekV41ForCausalLM,
    ids: torch.Tensor,
    chunks: list[int],
    record: dict | None = None,
    window_q: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Logits [S, vocab] of `ids` fed in `chunks`. `record` collects every index source's
    selections; `window_q` collects each layer's quantised window entries [S, D]."""
    view = allocate_view(ModelSpec.from_config(model.config), 1, ids.shape[1])
    orig_select, orig_fp8 = IndexerV41.select, attention_v41.fp8_window_fake_quant
    calls: list[torch.Tensor] = []

    def recording(self, x, q_res, keys, step, selection):  # type: ignore[no-untyped-def]
        orig_select(self, x, q_res, keys, step, selection)
        if record is not None:
            record.setdefault(self.layer, []).append((selection.topk.clone(), selection.candidates))

    def fp8(x, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = orig_fp8(x, *args, **kwargs)
        calls.append(out[0].clone())
        return out

    IndexerV41.select = recording  # type: ignore[method-assign]
    attention_v41.fp8_window_fake_quant = fp8  # type: ignore[assignment]
    try:
        outs, pos = [], 0
        with torch.inference_mode():
            for c in chunks:
                outs.append(model(ids[:, pos : pos + c], view))
                advance(view, c)
                pos += c
    finally:
        IndexerV41.select = orig_select  # type: ignore[method-assign]
        attention_v41.fp8_window_fake_quant = orig_fp8  # type: ignore[assignment]
    if window_q is not None:
        n_layers = model.config.num_hidden_layers
        window_q.extend(torch.cat(calls[i::n_layers], dim=0) for i in range(n_layers))
    return torch.cat(outs, dim=1)[0]


def as_mask(topk: torch.Tensor, n: int) -> torch.Tensor:
    mask = torch.zeros(topk.shape[0], n + 1, dtype=torch.bool)
    mask.scatter_(1, topk.masked_fill(topk < 0, n), True)
    return mask[:, :n]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("quant", [False, True])
def test_matches_dense_reference(schedule: str, quant: bool) -> None:
    model = make_model(schedule, quant)
    torch.manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (1, 96))
    record: dict = {}
    out = run(model, ids, [96], record)
    ref, ref_sel = reference_logits(model, ids[0].tolist())
    for layer, mask in ref_sel.items():
        got = as_mask(record[layer][0][0][0], mask.shape[1])
        assert torch.equal(got, mask), f"layer {layer}: selections differ"
    diff = (out - ref).abs().amax(-1)
    # Same selections everywhere; the only differences left are float summation orders.
    assert diff.max().item() <= (1e-3 if quant else 1e-5), diff.max().item()


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_chunked_and_decode_equal_one_shot(schedule: str) -> None:
    """Ragged chunks (odd boundaries) then decode give exactly the one-shot logits and selections,
    with the quantisers off and on: every query's reductions have fixed shapes and small matrix
    products are padded (replaykv.model.layers.linear), so no float-order difference exists that
    could flip an FP8 / FP4 rounding (architecture reference §11)."""
    chunks = [1, 3, 17, 5, 41, 9, 2] + [1] * 42
    for quant in (False, True):
        model = make_model(schedule, quant)
        torch.manual_seed(4)
        ids = torch.randint(0, model.config.vocab_size, (1, sum(chunks)))
        rec_one: dict = {}
        win_one: list[torch.Tensor] = []
        one = run(model, ids, [ids.shape[1]], rec_one, win_one)
        rec_chunk: dict = {}
        win_chunk: list[torch.Tensor] = []
        chunked = run(model, ids, chunks, rec_chunk, win_chunk)
        assert torch.equal(chunked, one), (quant, (chunked - one).abs().max().item())
        for a, b in zip(win_one, win_chunk, strict=True):
            assert torch.equal(a, b)  # the quantised window entries, layer by layer
        n = ids.shape[1]
        for layer, calls in rec_chunk.items():
            got = torch.cat([as_mask(c[0][0], n) for c in calls], dim=0)
            assert torch.equal(got, as_mask(rec_one[layer][0][0][0], n)), f"layer {layer} selections"


def test_index_scores_in_slices_change_no_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The indexers score their entries in slices of attention.INDEX_SLICE: slices of 5 entries
    give the one-piece logits and selections exactly, one shot and in chunks then decode."""
    import replaykv.model.attention as attention

    model = make_model("three_sources", quant=True)
    torch.manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (1, 90))
    rec_whole: dict = {}
    whole = run(model, ids, [90], rec_whole)
    monkeypatch.setattr(attention, "INDEX_SLICE", 5)
    rec_sliced: dict = {}
    assert torch.equal(run(model, ids, [90], rec_sliced), whole)
    for layer, calls in rec_whole.items():
        assert torch.equal(calls[0][0], rec_sliced[layer][0][0]), f"layer {layer} selections"
    assert torch.equal(run(model, ids, [37, 13] + [1] * 40), whole)


def test_ratio2_entries_appear_at_odd_positions() -> None:
    model = make_model("checklist", quant=False)
    spec = ModelSpec.from_config(model.config)
    view = allocate_view(spec, 1, 40)
    ids = torch.randint(0, model.config.vocab_size, (1, 40))
    src = spec.sources[0]
    assert spec.layers[src].ratio == 2
    entries = view.layers[src].entries
    assert entries is not None
    with torch.inference_mode():
        for t in range(40):
            model(ids[:, t : t + 1], view)
            advance(view, 1)
            filled = int((entries[0].abs().sum(-1) > 0).sum())
            assert filled == (t + 1) // 2, (t, filled)


def test_reindex_layers_select_only_inside_candidates() -> None:
    model = make_model("checklist", quant=True)
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (1, 120))
    record: dict = {}
    run(model, ids, [120], record)
    cand_layer = cfg.candidate_source
    cands = record[cand_layer][0][1][0]  # [S, kb] block ids
    bs = cfg.candidate_block_size
    limit = (torch.arange(120) + 1) // cfg.compress_ratio(cand_layer)
    newest = (limit - 1) // bs
    has = limit > 0
    assert bool(((cands == newest[:, None]).any(-1) | ~has).all()), "the newest block is always a candidate"
    later = [layer for layer in cfg.index_sources if layer > cand_layer]
    assert later, "the schedule must have a Reindex layer after the candidate source"
    for layer in later:
        sel = record[layer][0][0][0]
        blocks = torch.where(sel >= 0, torch.div(sel, bs, rounding_mode="floor"), -2)
        inside = (blocks[..., None] == cands[:, None, :]).any(-1) | (sel < 0)
        assert bool(inside.all()), f"layer {layer} selected outside the candidate blocks"


def _deepseek_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a transformers-named V4.1 state dict to DeepSeek's released names (written here)."""
    leaf = {
        "self_attn.q_a_proj": "attn.wq_a", "self_attn.q_a_norm": "attn.q_norm", "self_attn.q_b_proj": "attn.wq_b",
        "self_attn.kv_proj": "attn.wkv", "self_attn.kv_norm": "attn.kv_norm", "self_attn.o_a_proj": "attn.wo_a",
        "self_attn.o_b_proj": "attn.wo_b", "self_attn.compressor.kv_proj": "attn.compressor.wkv",
        "self_attn.compressor.gate_proj": "attn.compressor.wgate", "self_attn.compressor.kv_norm": "attn.compressor.norm",
        "self_attn.indexer.q_b_proj": "attn.indexer.wq_b", "self_attn.indexer.weights_proj": "attn.indexer.weights_proj",
        "self_attn.indexer.k_proj": "attn.indexer.wk", "self_attn.indexer.k_norm": "attn.indexer.k_norm",
        "mlp.shared_experts.gate_proj": "ffn.shared_experts.w1", "mlp.shared_experts.down_proj": "ffn.shared_experts.w2",
        "mlp.shared_experts.up_proj": "ffn.shared_experts.w3", "mlp.gate": "ffn.gate",
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key == "model.embed_tokens.weight":
            out["embed.weight"] = value
        elif key == "lm_head.weight":
            out["head.weight"] = value
        elif key == "model.norm.weight":
            out["norm.weight"] = value
        else:
            layer, rest = key[len("model.layers.") :].split(".", 1)
            p = f"layers.{layer}."
            if rest.startswith(("attn_hc.", "ffn_hc.")):
                site, what = rest.split(".")
                out[p + f"hc_{site[:-3]}_{what}"] = value
            elif rest == "self_attn.sinks":
                out[p + "attn.attn_sink"] = value
            elif rest == "mlp.gate.e_score_correction_bias":
                out[p + "ffn.gate.bias"] = value
            elif rest == "mlp.gate.e_score_correction_bias_vl":
                out[p + "ffn.gate.bias_vl"] = value
            elif rest == "mlp.experts.gate_up_proj":
                inter = value.shape[1] // 2
                for e in range(value.shape[0]):
                    out[p + f"ffn.experts.{e}.w1.weight"] = value[e, :inter].clone()
                    out[p + f"ffn.experts.{e}.w3.weight"] = value[e, inter:].clone()
            elif rest == "mlp.experts.down_proj":
                for e in range(value.shape[0]):
                    out[p + f"ffn.experts.{e}.w2.weight"] = value[e].clone()
            else:
                mod, tail = rest.rsplit(".", 1)
                out[p + leaf[mod] + "." + tail] = value
    return out


def test_both_namings_and_config_styles_load_to_identical_logits(tmp_path: Path) -> None:
    model = make_model("checklist", quant=True)
    ids = torch.randint(0, model.config.vocab_size, (1, 64))
    ref = run(model, ids, [64])
    ours = tmp_path / "transformers"
    save_pretrained(model, ours)
    saved = load_file(str(ours / "model.safetensors"))
    assert "model.layers.2.self_attn.compressor.gate_proj.weight" in saved
    assert "model.layers.2.mlp.experts.gate_up_proj" in saved
    reloaded = load_model(ours)
    assert torch.equal(run(reloaded, ids, [64]), ref)

    deepseek = tmp_path / "deepseek"
    deepseek.mkdir()
    save_file(_deepseek_names(saved), str(deepseek / "model.safetensors"))
    flat = json.loads((ours / "config.json").read_text())
    composite = {
        "model_type": "deepseek_v41",
        "text_config": {**flat, "model_type": "deepseek_v41_text"},
        "image_token_id": 129264,
        "tie_word_embeddings": False,
    }
    (deepseek / "config.json").write_text(json.dumps(composite))
    assert torch.equal(run(load_model(deepseek), ids, [64]), ref)

    # Our saver round-trips: load (DeepSeek names) -> save (transformers names) -> load.
    again = tmp_path / "again"
    save_pretrained(load_model(deepseek), again)
    assert torch.equal(run(load_model(again), ids, [64]), ref)


def test_a_sharded_checkpoint_with_mtp_and_vision_shards_loads_lazily(tmp_path: Path) -> None:
    """Shards named by model.safetensors.index.json; the MTP and vision tensors (here in shards of
    their own) are skipped by name, so a shard holding only them is opened but none is read."""
    model = make_model("checklist", quant=True)  # the saved config keeps the quantisers on
    ids = torch.randint(0, model.config.vocab_size, (1, 32))
    ref = run(model, ids, [32])
    save_pretrained(model, tmp_path / "one")
    state = load_file(str(tmp_path / "one" / "model.safetensors"))
    names = sorted(state)
    shards = {"model-00001-of-00003.safetensors": names[: len(names) // 2],
              "model-00002-of-00003.safetensors": names[len(names) // 2 :]}  # fmt: skip
    extra = {"mtp.0.eh_proj.weight": torch.ones(8, 8), "vision.patch_embed.weight": torch.ones(4, 4)}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(sharded / shard))
    save_file(extra, str(sharded / "model-00003-of-00003.safetensors"))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    weight_map.update({k: "model-00003-of-00003.safetensors" for k in extra})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (sharded / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    assert set(read_state_dict(sharded, skip=("mtp.", "vision."))) == set(names)
    assert set(read_state_dict(sharded)) == set(names) | set(extra)
    assert torch.equal(run(load_model(sharded), ids, [32]), ref)


def test_mixed_or_unknown_names_are_rejected(tmp_path: Path) -> None:
    model = make_model("checklist", quant=False)
    save_pretrained(model, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["model.layers.3.self_attn.compressor.kv_proj.weight"] = torch.zeros(
        64, 256
    )  # a Reuse layer has none
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(kv_source_layer_ids=(3, 6)), "source"),
        (dict(compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1, 1, 1)), "ratio"),
        (dict(index_source_layer_ids=(4, 6, 8)), "index source"),
        (dict(candidate_source_layer_id=4), "candidate"),
    ],
)
def test_inconsistent_schedules_fail_clearly(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        v41_tiny().replace(**change)


def test_packed_cache_continues_bit_identically() -> None:
    """Pack every cache tensor into DeepSeek's byte layouts and back: the forward that continues
    from the unpacked cache gives exactly the logits of the fake-quantised path."""
    from replaykv.model.quant import FP4_COMPRESSED_ENTRY, FP8_WINDOW_ENTRY, MXFP4_INDEX_KEY

    model = make_model("checklist", quant=True)
    spec = ModelSpec.from_config(model.config)
    ids = torch.randint(0, model.config.vocab_size, (1, 90))
    views = [allocate_view(spec, 1, 90) for _ in range(2)]
    with torch.inference_mode():
        for view in views:
            model(ids[:, :70], view)
            advance(view, 70)
        packed = views[1]
        for i, (ls, lc) in enumerate(zip(spec.layers, packed.layers, strict=True)):
            d = ls.head_dim
            lc.window.copy_(FP8_WINDOW_ENTRY.unpack(FP8_WINDOW_ENTRY.pack(lc.window), d))
            if ls.owns_compressor:
                assert lc.entries is not None and lc.index_keys is not None
                assert spec.layers[i].source == i
                lc.entries.copy_(FP4_COMPRESSED_ENTRY.unpack(FP4_COMPRESSED_ENTRY.pack(lc.entries), d))
                lc.index_keys.copy_(MXFP4_INDEX_KEY.unpack(MXFP4_INDEX_KEY.pack(lc.index_keys), ls.index_dim))
        outs = [[], []]
        for t in range(70, 90):
            for k, view in enumerate(views):
                outs[k].append(model(ids[:, t : t + 1], view))
                advance(view, 1)
    assert torch.equal(torch.cat(outs[0], 1), torch.cat(outs[1], 1))


def test_released_shapes_instantiate_on_the_meta_device() -> None:
    from replaykv.model.checkpoint import build_model
    from replaykv.model.presets import v4_flash
    from replaykv.model.presets_v41 import v41_flash

    with torch.device("meta"):
        v41 = build_model(v41_flash())
        v4 = build_model(v4_flash())
    n41 = sum(p.numel() for p in v41.parameters())
    n4 = sum(p.numel() for p in v4.parameters())
    # Backbones without Engram tables or MTP/DSpark layers (hundreds of billions of parameters).
    assert 1e11 < n41 < 1e12 and 1e11 < n4 < 1e12, (n41, n4)
    assert all(p.device.type == "meta" for p in v41.parameters())


@pytest.mark.parametrize("shape", [(2, 64, 4, 4), (1, 2000, 4, 4), (3, 5, 2, 2)])
def test_sinkhorn_equals_the_unrolled_loop_and_its_gradient(shape: tuple[int, ...]) -> None:
    # Every path (NumPy for small CPU inputs, matrix-first torch, the hand-written backward)
    # gives the unrolled loop's values bit for bit; the backward matches autograd through it.
    torch.manual_seed(0)
    comb = torch.softmax(torch.randn(shape), dim=-1) + 1e-6
    expected = reference_sinkhorn(comb, 20, 1e-6)
    assert torch.equal(sinkhorn(comb, 20, 1e-6), expected)
    leaf = comb.clone().requires_grad_(True)
    out = sinkhorn(leaf, 20, 1e-6)
    assert torch.equal(out.detach(), expected)
    weights = torch.randn(shape)
    (out * weights).sum().backward()
    auto = comb.clone().requires_grad_(True)
    (reference_sinkhorn(auto, 20, 1e-6) * weights).sum().backward()
    assert leaf.grad is not None and auto.grad is not None
    assert torch.allclose(leaf.grad, auto.grad, rtol=1e-4, atol=1e-6)
    small = (torch.softmax(torch.randn(2, 3, 4, 4, dtype=torch.float64), dim=-1) + 1e-6).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda c: sinkhorn(c, 5, 1e-6), (small,))


def _naive_joint_attention(
    q: torch.Tensor,
    win_keys: torch.Tensor,
    start: list[int],
    floors: list[int],
    window: int,
    sinks: torch.Tensor,
    entries: torch.Tensor | None,
    ratio: int,
    selection: torch.Tensor | None,
) -> torch.Tensor:
    """One query at a time, from the spec: the readable window rows (inside the window, at or
    after the floor and position 0), the visible (or selected) entries and the sink share one
    softmax; keys are the values."""
    b, s, _, d = q.shape
    out = []
    for r in range(b):
        rows = []
        for i in range(s):
            p = start[r] + i
            keys = [
                win_keys[r, j]
                for j in range(window - 1 + s)
                if p - window < start[r] - window + 1 + j <= p
                and start[r] - window + 1 + j >= max(floors[r], 0)
            ]
            if entries is not None:
                visible = range((p + 1) // ratio)
                if selection is not None:
                    visible = [int(e) for e in selection[r, i] if e >= 0]
                keys += [entries[r, e] for e in visible]
            k = torch.stack(keys)  # [N, D]
            logits = q[r, i] @ k.T * d**-0.5  # [H, N]
            z = torch.cat([logits, sinks[:, None]], dim=1).softmax(dim=1)
            rows.append(z[:, :-1] @ k)
        out.append(torch.stack(rows))
    return torch.stack(out)


@pytest.mark.parametrize("case", ["prefill", "floors", "offsets-dense", "offsets-sparse"])
def test_training_attention_equals_the_engine_path_and_a_naive_softmax(case: str) -> None:
    # With gradients, joint_attention scores each block's 2W - 1 window rows in one GEMM and masks;
    # without, each query reads its own W rows. Both equal the spec, and so do the gradients.
    from replaykv.model.step import RopeTables, Step

    torch.manual_seed(0)
    b, s, h, d, w, ratio = 2, 37, 3, 16, 8, 2
    start = {"prefill": [0, 0], "floors": [3, 9]}.get(case, [5, 12])
    floors = [0, 9] if case == "floors" else [0, 0]  # a replay's window starts at its floor
    start_t = torch.tensor(start)
    positions = start_t[:, None] + torch.arange(s)
    step = Step(
        positions, start_t, tuple(start), torch.tensor(floors), tuple(floors), RopeTables.build({}, positions)
    )
    q = torch.randn(b, s, h, d, dtype=torch.float64, requires_grad=True)
    win_keys = torch.randn(b, w - 1 + s, d, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(h, dtype=torch.float64)
    n = (max(start) + s) // ratio
    entries = None if case == "prefill" else torch.randn(b, n, d, dtype=torch.float64, requires_grad=True)
    selection = None
    if case == "offsets-sparse":
        limit = (positions + 1) // ratio
        selection = torch.stack([torch.randperm(n)[:5] for _ in range(b * s)]).view(b, s, 5)
        selection = selection.masked_fill(selection >= limit[..., None], -1)
    args = (step, w, sinks, entries, ratio, selection)
    out = joint_attention(q, win_keys, *args)
    with torch.no_grad():
        engine = joint_attention(q, win_keys, *args)
    ref = _naive_joint_attention(q, win_keys, start, floors, w, sinks, entries, ratio, selection)
    assert torch.allclose(out, ref, atol=1e-6) and torch.allclose(engine, ref, atol=1e-6)
    weights = torch.randn_like(out)
    leaves = [t for t in (q, win_keys, entries) if t is not None]
    got = torch.autograd.grad((out * weights).sum(), leaves)
    want = torch.autograd.grad((ref * weights).sum(), leaves)
    for g, e in zip(got, want, strict=True):
        assert torch.allclose(g, e, atol=1e-6)
