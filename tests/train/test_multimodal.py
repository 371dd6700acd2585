"""Multimodal training systems on `v41-tiny-vision` (float32): the three-phase step against one
autograd graph, the contrastive stage with overlapped and blocking gathers in two gloo
processes against one process on the whole batch, and context-parallel image loading (CP = 2)
against one process, with every image read once."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from replaykv.images import PromptImage
from replaykv.model.checkpoint import build_model, load_model
from replaykv.model.init import init_weights
from replaykv.model.presets_v41 import v41_tiny_vision
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.train.context import ContextShards
from replaykv.train.multimodal.contrastive import (
    ContrastiveConfig,
    contrastive_step,
    image_features,
    pair_loss,
    text_features,
)
from replaykv.train.multimodal.data import ImageStore, make_pairs
from replaykv.train.multimodal.phases import PhaseTimes, lm_loss, split_tower, three_phase_step
from replaykv.train.multimodal.run import ContrastiveArgs, build, launch, projections
from replaykv.train.multimodal.sharded import Placement, ShardedImageLoader, shard_lm_loss

TOL = 1e-5


def vision_model() -> DeepseekV41ForCausalLM:
    model = init_weights(build_model(v41_tiny_vision().replace(kv_quant=False)), seed=3)
    gen = torch.Generator().manual_seed(4)
    for layer in model.model.layers:
        gate = layer.mlp.gate
        gate.e_score_correction_bias_vl.copy_(
            torch.randn(gate.e_score_correction_bias_vl.shape, generator=gen)
        )
    return model.float().train()


def grads_of(*named: tuple[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}{k}": p.grad.detach().clone()
        for prefix, module in named
        for k, p in module.named_parameters()
        if p.grad is not None
    }


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= TOL, worst


def test_three_phase_step_equals_one_autograd_graph() -> None:
    joint = vision_model()
    vc = joint.config.vision_config
    pairs = make_pairs(11, 2, vc)
    images = [[PromptImage(5, pairs.images[0])], [PromptImage(20, pairs.images[1])]]
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(5))
    for row, ims in enumerate(images):
        for im in ims:
            ids[row, im.start : im.end] = joint.config.image_token_id
    targets = torch.ones_like(ids, dtype=torch.float32)
    split_model = copy.deepcopy(joint)

    assert joint.model.vision is not None
    spans = [[(im.start, joint.model.vision.span(im.image)) for im in row] for row in images]
    loss = lm_loss(joint, ids, targets, spans)
    loss.backward()
    expected = grads_of(("", joint))

    lm, tower = split_tower(split_model)
    assert not any(k.startswith("model.vision.") for k, _ in lm.named_parameters())
    times = PhaseTimes()
    got_loss = three_phase_step(lm, tower, ids, targets, images, times)
    got = grads_of(("", lm), ("model.vision.", tower))
    assert abs(float(got_loss) - float(loss.detach())) <= TOL
    assert_close(got, expected)
    assert times.vision_forward > 0 and times.vision_backward > 0
    with pytest.raises(ValueError, match="without a vision tower"):
        three_phase_step(joint, tower, ids, targets, images)


def test_three_phase_step_without_images_is_the_text_step() -> None:
    model = vision_model()
    lm, tower = split_tower(model)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(6))
    targets = torch.ones_like(ids, dtype=torch.float32)
    loss = three_phase_step(lm, tower, ids, targets, [[], []])
    assert all(p.grad is None for p in tower.parameters())
    plain = vision_model()
    plain.model.vision = None
    expected = lm_loss(plain, ids, targets, [])
    assert abs(float(loss) - float(expected.detach())) <= TOL


def full_batch(args: ContrastiveArgs) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, the whole global batch, one autograd graph over both feature sides."""
    model = build(args)
    text_proj, image_proj = projections(model, args.dim, args.seed)
    lm, tower = split_tower(model)
    vc = model.config.vision_config
    batch = make_pairs(args.seed * 100_003, args.pairs * args.processes, vc)
    t = text_features(lm, text_proj, batch.ids, batch.mask)
    v = image_features(tower, image_proj, batch.images)
    loss = pair_loss(t, v, 0, 0, t.shape[0], ContrastiveConfig(dim=args.dim))
    loss.backward()
    return float(loss), grads_of(
        ("lm.", lm), ("text_proj.", text_proj), ("tower.", tower), ("image_proj.", image_proj)
    )


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "blocking"])
def test_contrastive_gathers_equal_one_process_on_the_whole_batch(tmp_path: Path, overlap: bool) -> None:
    args = ContrastiveArgs(
        preset="v41-tiny-vision", out=str(tmp_path / "run"), processes=2, steps=1, pairs=2, overlap=overlap,
        dump_gradients=True,
    )  # fmt: skip
    report = launch(args)
    assert report is not None and len(report["steps"]) == 1
    dumped = torch.load(tmp_path / "run" / "gradients.pt", weights_only=True)
    loss, expected = full_batch(args)
    assert abs(float(dumped["loss"]) - loss) <= TOL
    assert_close(dumped["grads"], expected)
    step = report["steps"][0]
    assert step["image_gather"] >= 0 and step["text_gather"] >= 0
    # the export serves: the tower is back in the model, with the trained weights
    served = load_model(tmp_path / "run")
    assert served.model.vision is not None
    assert (tmp_path / "run" / "vision" / "vision.safetensors").exists()


def test_the_single_process_step_is_the_full_batch_computation() -> None:
    args = ContrastiveArgs(preset="v41-tiny-vision", out="", processes=1, pairs=3)
    loss, expected = full_batch(args)
    model = build(args)
    text_proj, image_proj = projections(model, args.dim, args.seed)
    lm, tower = split_tower(model)
    batch = make_pairs(0, 3, model.config.vision_config)
    got = contrastive_step(
        lm, text_proj, tower, image_proj, batch.ids, batch.mask, batch.images, ContrastiveConfig()
    )
    assert abs(float(got) - loss) <= TOL
    assert_close(
        grads_of(("lm.", lm), ("text_proj.", text_proj), ("tower.", tower), ("image_proj.", image_proj)),
        expected,
    )


def test_generated_pairs_are_seeded_and_reads_are_counted() -> None:
    vc = v41_tiny_vision().vision_config
    store = ImageStore()
    a = make_pairs(1, 3, vc, store=store)
    b = make_pairs(1, 3, vc)
    assert a.captions == b.captions and [im.digest for im in a.images] == [im.digest for im in b.images]
    assert dict(store.reads) == {0: 1, 1: 1, 2: 1}


# ---------------------------------------------------------------------------------- CP loading
SEQ = 64


def _sequence(image_token: int) -> tuple[ImageStore, list[Placement], torch.Tensor, torch.Tensor]:
    """A 64-token sequence with three images: one in shard 0, one straddling the boundary at
    32, one in shard 1 (CP = 2)."""
    vc = v41_tiny_vision().vision_config
    store = ImageStore()
    pairs = make_pairs(21, 3, vc, store=store)
    store.reads.clear()
    starts = [2, 26, 44]
    placements = [Placement(k, s, pairs.images[k].span_length) for k, s in enumerate(starts)]
    ids = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(8))
    for p in placements:
        ids[0, p.start : p.end] = image_token
    assert placements[1].start < SEQ // 2 < placements[1].end
    return store, placements, ids, torch.ones(1, SEQ)


def _cp_step(
    rank: int, world: int, shard_reads: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[int, int]]:
    model = vision_model()
    lm, tower = split_tower(model)
    store, placements, ids, targets = _sequence(model.config.image_token_id)
    shards = ContextShards(rank, world, dist.group.WORLD, list(range(world))) if world > 1 else None
    loader = ShardedImageLoader(tower, model.config.vision_config, store, shards, SEQ // world, shard_reads)
    images = loader.forward(placements)
    loss = shard_lm_loss(lm, ids, targets, shards, images.spans)
    loss.backward()
    loader.backward(placements, images)
    grads = grads_of(("", lm), ("model.vision.", tower))
    total = loss.detach().clone()
    if world > 1:
        dist.all_reduce(total)
        for g in grads.values():
            dist.all_reduce(g)
    return total, grads, dict(store.reads)


def _cp_worker(rank: int, world: int, port: int, out: str, shard_reads: bool) -> None:
    import os

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        loss, grads, reads = _cp_step(rank, world, shard_reads)
        every: list[dict[int, int] | None] = [None] * world
        dist.all_gather_object(every, reads)
        if rank == 0:
            torch.save({"loss": loss, "grads": grads, "reads": every}, Path(out) / "cp.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shard_reads", [True, False], ids=["sharded", "every-shard-reads"])
def test_context_parallel_image_loading_reads_each_image_once(tmp_path: Path, shard_reads: bool) -> None:
    import torch.multiprocessing as mp

    from replaykv.train.spawn import free_port

    loss_1, grads_1, reads_1 = _cp_step(0, 1, True)
    assert reads_1 == {0: 1, 1: 1, 2: 1}
    mp.spawn(_cp_worker, args=(2, free_port(), str(tmp_path), shard_reads), nprocs=2, join=True)
    got = torch.load(tmp_path / "cp.pt", weights_only=False)
    assert abs(float(got["loss"]) - float(loss_1)) <= TOL
    assert max((got["grads"][k] - grads_1[k]).abs().max().item() for k in grads_1) <= 1e-4
    per_image = {k: sum(r.get(k, 0) for r in got["reads"]) for k in range(3)}
    if shard_reads:
        assert per_image == {0: 1, 1: 1, 2: 1}  # the straddling image too
    else:
        assert per_image == {0: 1, 1: 2, 2: 1}  # the straddling image is read by both shards
