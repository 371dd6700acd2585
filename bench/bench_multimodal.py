"""Multimodal training systems measured side by side: hidden feature gathers, CP-sharded image
loading and the three-phase step's phases.

    python bench/bench_multimodal.py [--preset v41-small-vision] [--repeats 10] [--pairs 4]
        [--seq-len 0] [--images 6] [--threads 1] [--write docs/benchmarks.md]

Three parts, each on the preset's model (random weights from a fixed seed, float32, weights not
stepped, so every repeat computes the same step):

(a) the contrastive step (:mod:`replaykv.train.multimodal.contrastive`) in 2 gloo processes,
    `--pairs` pairs each, with the feature gathers overlapped and blocking; the two modes
    alternate inside every repeat (the order flips each repeat) after one dropped warm-up of
    each, and a barrier starts every step. Per mode: the seconds each gather was waited for
    (exposed; the mean over the processes per step, then min / median over steps), the phase
    times, the gradient all-reduce and the whole step;
(b) one long sequence with `--images` images split over CP = 2 processes (one image straddles
    the shard boundary), its full step (:class:`.ShardedImageLoader` phases 1 and 3 around
    :func:`.shard_lm_loss`), with each image read by one shard (sharded) and by every shard it
    touches (unaware of CP), alternating per repeat: reads per image per step counted from
    :attr:`.ImageStore.reads` over both processes, the bytes read, the span rows exchanged;
(c) the three-phase step (:func:`.three_phase_step`) on the same sequence in one process, the
    step time split by phase, beside the same step as one autograd graph over tower and LM.

Nothing is written unless `--write` names the file (docs/benchmarks.md). Not for: serving with
images (bench/bench_images.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from report import replace_section

from replaykv.images import PreparedImage, PromptImage
from replaykv.malloc import reexec_keeping_freed_memory
from replaykv.model.presets_v41 import get_preset_v41
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.train.context import ContextShards
from replaykv.train.multimodal.contrastive import (
    ContrastiveConfig,
    GatherTimes,
    contrastive_step,
    sum_gradients,
)
from replaykv.train.multimodal.data import ImageStore, make_pairs
from replaykv.train.multimodal.phases import PhaseTimes, lm_loss, split_tower, three_phase_step
from replaykv.train.multimodal.run import ContrastiveArgs, build, projections
from replaykv.train.multimodal.sharded import Placement, ShardedImageLoader, assign_readers, shard_lm_loss
from replaykv.train.spawn import free_port

WORLD = 2  # processes of (a), shards of (b)
SEED = 0
BEGIN, END = "<!-- bench_multimodal:begin -->", "<!-- bench_multimodal:end -->"
HEADING = "## Multimodal training: hidden gathers, sharded image loading, phases"


def zero_grads(*modules: torch.nn.Module) -> None:
    for module in modules:
        module.zero_grad(set_to_none=True)


def model_of(preset: str) -> DeepseekV41ForCausalLM:
    return build(ContrastiveArgs(preset=preset, out="", processes=WORLD, seed=SEED))


def _init(rank: int, port: int, threads: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)


def _collect(rank: int, mine: Any, out: str) -> None:
    """Process 0 writes every process's `mine` to OUT/result.json."""
    every: list[Any] = [None] * WORLD
    dist.all_gather_object(every, mine)
    if rank == 0:
        (Path(out) / "result.json").write_text(json.dumps(every))


def _spawn(fn: Any, args: tuple[Any, ...]) -> list[Any]:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(fn, args=(free_port(), out, *args), nprocs=WORLD, join=True)
        result: list[Any] = json.loads((Path(out) / "result.json").read_text())
    return result


# ------------------------------------------------------------------------------ (a) gathers
MODES = ("overlapped", "blocking")


def _gathers_worker(
    rank: int, port: int, out: str, preset: str, pairs: int, repeats: int, threads: int
) -> None:
    _init(rank, port, threads)
    try:
        model = model_of(preset)
        cfg = ContrastiveConfig()
        text_proj, image_proj = projections(model, cfg.dim, SEED)
        lm, tower = split_tower(model)
        vc = model.config.vision_config
        assert vc is not None
        batch = make_pairs(SEED, pairs * WORLD, vc)
        rows = slice(rank * pairs, (rank + 1) * pairs)
        log: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for r in range(repeats + 1):  # r = 0: warm-up, dropped
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                dist.barrier()
                times = GatherTimes()
                t0 = time.perf_counter()
                contrastive_step(
                    lm, text_proj, tower, image_proj, batch.ids[rows], batch.mask[rows], batch.images[rows],
                    cfg, overlap=mode == "overlapped", times=times,
                )  # fmt: skip
                t1 = time.perf_counter()
                sum_gradients(lm, text_proj, tower, image_proj)
                t2 = time.perf_counter()
                zero_grads(lm, text_proj, tower, image_proj)
                if r > 0:
                    log[mode].append({**asdict(times), "all_reduce": t2 - t1, "step": t2 - t0})
        _collect(rank, log, out)
    finally:
        dist.destroy_process_group()


def gathers(preset: str, pairs: int, repeats: int, threads: int) -> list[str]:
    every = _spawn(_gathers_worker, (preset, pairs, repeats, threads))
    dim = ContrastiveConfig().dim
    gathered = WORLD * pairs * dim * 4
    lines = [
        f"(a) Contrastive step, {WORLD} gloo processes × {pairs} pairs, features of {dim} floats: each "
        f"gather assembles {gathered:,} bytes ({(WORLD - 1) * pairs * dim * 4:,} received per process). "
        f"Exposed = seconds a process waited for the gather (mean over the processes per step); "
        f"{repeats} steps per mode, the modes alternating; ms, min / median:",
        "",
        "| gathers | image gather exposed | text gather exposed | vision forward | LM forward + backward "
        "| vision backward | gradient all-reduce | step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    medians = {}
    for mode in MODES:
        steps = [
            {k: statistics.fmean(proc[mode][i][k] for proc in every) for k in every[0][mode][i]}
            for i in range(len(every[0][mode]))
        ]

        def cell(key: str, steps: list[dict[str, float]] = steps) -> str:
            values = [s[key] * 1e3 for s in steps]
            return f"{min(values):.2f} / {statistics.median(values):.2f}"

        medians[mode] = statistics.median(s["step"] for s in steps)
        keys = (
            "image_gather", "text_gather", "vision_forward", "language_model", "vision_backward", "all_reduce", "step",
        )  # fmt: skip
        lines.append(f"| {mode} | " + " | ".join(cell(k) for k in keys) + " |")
    lines += [
        "",
        f"Median step, overlapped / blocking: {medians['overlapped'] / medians['blocking']:.3f}. "
        "The LM phase includes the waits of both gathers; a blocking wait also covers the other "
        "process catching up (the step's imbalance), which the overlapped gather hides behind the "
        "text forward and backward.",
    ]
    return lines


# ---------------------------------------------------------------------- (b) CP image loading
def sequence(
    preset: str, seq_len: int, images: int
) -> tuple[ImageStore, list[Placement], list[PreparedImage], torch.Tensor, torch.Tensor]:
    """One sequence of `seq_len` tokens with `images` generated images: the first half of them in
    shard 0, the middle one across the boundary at seq_len / 2, the rest in shard 1."""
    config = get_preset_v41(preset)
    assert config.vision_config is not None and config.image_token_id is not None
    store = ImageStore()
    batch = make_pairs(SEED + 1, images, config.vision_config, store=store)
    store.reads.clear()
    spans = [im.span_length for im in batch.images]
    half, middle = seq_len // 2, images // 2
    starts, at = [], 4
    for k in range(middle):
        starts.append(at)
        at += spans[k] + 4
    straddle = half - spans[middle] // 2
    if straddle < at:
        raise ValueError(f"--seq-len {seq_len}: too short for {images} images of {spans} positions")
    starts.append(straddle)
    at = straddle + spans[middle] + 4
    for k in range(middle + 1, images):
        starts.append(at)
        at += spans[k] + 4
    if at > seq_len:
        raise ValueError(f"--seq-len {seq_len}: too short for {images} images of {spans} positions")
    placements = [Placement(k, s, spans[k]) for k, s in enumerate(starts)]
    ids = torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(SEED + 2))
    for p in placements:
        ids[0, p.start : p.end] = config.image_token_id
    return store, placements, batch.images, ids, torch.ones(1, seq_len)


LOADERS = ("sharded", "every shard")


def _cp_worker(
    rank: int, port: int, out: str, preset: str, seq_len: int, images: int, repeats: int, threads: int
) -> None:
    _init(rank, port, threads)
    try:
        model = model_of(preset)
        lm, tower = split_tower(model)
        vc = model.config.vision_config
        assert vc is not None
        store, placements, _, ids, targets = sequence(preset, seq_len, images)
        shards = ContextShards(rank, WORLD, dist.group.WORLD, list(range(WORLD)))
        log: dict[str, list[dict[str, Any]]] = {mode: [] for mode in LOADERS}
        for r in range(repeats + 1):
            for mode in LOADERS if r % 2 == 0 else LOADERS[::-1]:
                loader = ShardedImageLoader(tower, vc, store, shards, seq_len // WORLD, mode == "sharded")
                dist.barrier()
                store.reads.clear()
                t0 = time.perf_counter()
                step_images = loader.forward(placements)
                t1 = time.perf_counter()
                shard_lm_loss(lm, ids, targets, shards, step_images.spans).backward()
                t2 = time.perf_counter()
                loader.backward(placements, step_images)
                t3 = time.perf_counter()
                sum_gradients(lm, tower)
                t4 = time.perf_counter()
                zero_grads(lm, tower)
                if r > 0:
                    log[mode].append(
                        {
                            "reads": {str(k): n for k, n in store.reads.items()},
                            "bytes": sum(store.nbytes(k) * n for k, n in store.reads.items()),
                            "vision_forward": t1 - t0,
                            "language_model": t2 - t1,
                            "vision_backward": t3 - t2,
                            "step": t4 - t0,
                        }
                    )
        _collect(rank, log, out)
    finally:
        dist.destroy_process_group()


def cp_loading(preset: str, seq_len: int, images: int, repeats: int, threads: int) -> list[str]:
    store, placements, _, _, _ = sequence(preset, seq_len, images)
    config = get_preset_v41(preset)
    every = _spawn(_cp_worker, (preset, seq_len, images, repeats, threads))
    half = seq_len // WORLD
    owner = assign_readers(placements, [store.nbytes(p.image_id) for p in placements], WORLD, half)
    # span rows a shard holds of an image another shard reads: sent forward, their gradient back
    moved = sum(
        max(0, min(p.end, (c + 1) * half) - max(p.start, c * half))
        for k, p in enumerate(placements)
        for c in range(WORLD)
        if c != owner[k]
    )
    row_bytes = config.hidden_size * 4
    lines = [
        f"(b) One sequence of {seq_len:,} tokens with {images} images over CP = {WORLD} shards of "
        f"{half:,} positions (gloo); its full step {repeats} times per loader, alternating. Reads per "
        "image per step, over both shards:",
        "",
        "| image | positions | shards it touches | PNG bytes | reads: sharded | reads: every shard |",
        "|---:|---|---|---:|---:|---:|",
    ]
    per_mode: dict[str, dict[str, float]] = {}
    for mode in LOADERS:
        steps = len(every[0][mode])
        reads = {
            p.image_id: sum(
                proc[mode][i]["reads"].get(str(p.image_id), 0) for proc in every for i in range(steps)
            )
            / steps
            for p in placements
        }
        per_mode[mode] = {
            "reads": sum(reads.values()),
            "bytes": sum(proc[mode][i]["bytes"] for proc in every for i in range(steps)) / steps,
            **{
                key: statistics.median(max(proc[mode][i][key] for proc in every) for i in range(steps))
                for key in ("vision_forward", "language_model", "vision_backward", "step")
            },
        }
        per_mode[mode].update({f"image {k}": v for k, v in reads.items()})
    for p in placements:
        touched = [c for c in range(WORLD) if max(p.start, c * half) < min(p.end, (c + 1) * half)]
        lines.append(
            f"| {p.image_id} | [{p.start}, {p.end}) | {', '.join(map(str, touched))} | "
            f"{store.nbytes(p.image_id):,} | {per_mode['sharded'][f'image {p.image_id}']:g} | "
            f"{per_mode['every shard'][f'image {p.image_id}']:g} |"
        )
    lines += [
        "",
        "Per step (times: the slower shard, median; s):",
        "",
        "| loader | reads | bytes read | span rows exchanged (bytes, each way) | vision forward | LM "
        "| vision backward | step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in LOADERS:
        m = per_mode[mode]
        exchanged = f"{moved * row_bytes:,}" if mode == "sharded" else "0"
        lines.append(
            f"| {mode} | {m['reads']:g} | {m['bytes']:,.0f} | {exchanged} | {m['vision_forward']:.3f} | "
            f"{m['language_model']:.3f} | {m['vision_backward']:.3f} | {m['step']:.3f} |"
        )
    return lines


# -------------------------------------------------------------------------- (c) three phases
def phases(preset: str, seq_len: int, images: int, repeats: int, threads: int) -> list[str]:
    torch.set_num_threads(threads)
    _, placements, prepared, ids, targets = sequence(preset, seq_len, images)
    model = model_of(preset)
    lm, tower = split_tower(model)
    row = [[PromptImage(p.start, prepared[p.image_id]) for p in placements]]
    log: dict[str, list[dict[str, float]]] = {"three-phase": [], "one graph": []}
    for r in range(repeats + 1):
        for mode in ("three-phase", "one graph") if r % 2 == 0 else ("one graph", "three-phase"):
            t0 = time.perf_counter()
            if mode == "three-phase":
                times = PhaseTimes()
                three_phase_step(lm, tower, ids, targets, row, times)
                entry = asdict(times)
            else:
                spans = [[(im.start, tower.span(im.image)) for im in row[0]]]
                lm_loss(lm, ids, targets, spans).backward()
                entry = {}
            entry["step"] = time.perf_counter() - t0
            zero_grads(lm, tower)
            if r > 0:
                log[mode].append(entry)
    three = log["three-phase"]
    med = {k: statistics.median(e[k] for e in three) for k in three[0]}
    span = statistics.median(e["step"] for e in log["one graph"])
    cells = [
        f"{min(e[k] for e in three):.3f} / {med[k]:.3f} ({med[k] / med['step']:.0%})"
        for k in ("vision_forward", "language_model", "vision_backward")
    ]
    return [
        f"(c) The three-phase step on the same sequence (1 × {seq_len:,} tokens, {images} images, "
        f"{sum(p.length for p in placements)} image positions) in one process, {repeats} steps; s, "
        "min / median (share of the median step):",
        "",
        "| vision forward | LM forward + backward (span leaves) | vision backward | step | one autograd graph "
        "(same step) |",
        "|---:|---:|---:|---:|---:|",
        f"| {' | '.join(cells)} | {min(e['step'] for e in three):.3f} / {med['step']:.3f} | "
        f"{min(e['step'] for e in log['one graph']):.3f} / {span:.3f} |",
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="v41-small-vision", choices=("v41-small-vision", "v41-tiny-vision"))
    ap.add_argument("--repeats", type=int, default=10, help="measured steps per mode (after one warm-up)")
    ap.add_argument("--pairs", type=int, default=4, help="(a): pairs per process")
    ap.add_argument("--seq-len", type=int, default=0, help="(b), (c): tokens (default 1024, tiny 128)")
    ap.add_argument("--images", type=int, default=6, help="(b), (c): images in the sequence")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--write", default="", help="write the section into this file (docs/benchmarks.md)")
    args = ap.parse_args()
    if args.repeats < 1 or args.pairs < 1 or args.images < 2:
        ap.error("--repeats and --pairs must be at least 1, --images at least 2")
    reexec_keeping_freed_memory()
    seq_len = args.seq_len or (128 if "tiny" in args.preset else 1024)
    sequence(args.preset, seq_len, args.images)  # a layout that does not fit fails before any process starts
    cmd = (
        f"python bench/bench_multimodal.py --preset {args.preset} --repeats {args.repeats} --pairs {args.pairs} "
        f"--seq-len {seq_len} --images {args.images} --threads {args.threads}"
    )
    part_a = gathers(args.preset, args.pairs, args.repeats, args.threads)
    print("\n".join(part_a), flush=True)
    part_b = cp_loading(args.preset, seq_len, args.images, args.repeats, args.threads)
    print("\n".join(part_b), flush=True)
    part_c = phases(args.preset, seq_len, args.images, args.repeats, args.threads)
    print("\n".join(part_c), flush=True)
    section = "\n".join(
        [
            BEGIN,
            f"`{cmd}` ({args.preset}, random weights, float32, {args.threads} torch thread(s) per process; "
            "one warm-up step per mode dropped):",
            "",
            *part_a,
            "",
            *part_b,
            "",
            *part_c,
            END,
        ]
    )
    if args.write:
        replace_section(args.write, section, BEGIN, END, HEADING)
        print(f"wrote the section into {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
