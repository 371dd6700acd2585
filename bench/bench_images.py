"""What rebuilding image rows costs a replay, measured side by side in one process.

When bounded replay (or an exact rebuild) runs prompt rows that lie inside an image span, the
image's span vectors must be placed there. Three ways to have them: keep them with the SWA
snapshot (useless: replay runs exactly when the snapshot is gone), keep them in a short-TTL
feature cache by content digest, or run the tower again from the pixels the request carries.
This bench prices the last two against the replay they serve, on `v41-small-vision` (random
weights, float32; an image of 448 × 448 pixels, an 11 × 11 grid, 134 positions):

* tower: one image through the tower, aligner and span assembly;
* cache: one feature-cache lookup of the same vectors;
* replay: the bounded replay of the last window (128 rows through every layer, global KV
  read-only) over a 1024-token cached prefix, the work the vectors are needed for.

Variants interleave per repeat; min / median over repeats. The bytes the cache holds per image
are printed beside it, with the same figures for DeepSeek-V4.1-Flash's released shapes
(computed, not measured).

    python bench/bench_images.py [--repeats 15] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import replace_section

from replaykv.cache.features import FeatureCache
from replaykv.cache.views import allocate_view
from replaykv.engine.runner import execute
from replaykv.engine.scenario import drop_snapshot
from replaykv.images import image_span_length, plan_resize, prepare_image
from replaykv.malloc import reexec_keeping_freed_memory
from replaykv.model.accounting import parameter_count
from replaykv.model.checkpoint import build_model
from replaykv.model.init import init_weights
from replaykv.model.presets_v41 import v41_flash, v41_small_vision
from replaykv.model.spec import ModelSpec
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.model.vision import DeepseekV41VisionConfig, VisionTower
from replaykv.plan.loading import tower_flops
from replaykv.replay import CacheState, ReplayFlags, plan_prefill

BEGIN, END = "<!-- bench_images:begin -->", "<!-- bench_images:end -->"


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--write", default=None, help="docs file to write the section into")
    args = parser.parse_args()
    reexec_keeping_freed_memory()
    torch.manual_seed(0)
    config = v41_small_vision()
    model = build_model(config)
    assert isinstance(model, DeepseekV41ForCausalLM)
    init_weights(model).eval()
    assert model.model.vision is not None and config.vision_config is not None
    vision: VisionTower = model.model.vision
    pixels = np.random.default_rng(0).integers(0, 256, (448, 448, 3), dtype=np.uint8)
    image = prepare_image(pixels, config.vision_config)
    cache = FeatureCache(1 << 30, 300.0)
    with torch.inference_mode():
        vectors = vision.span(image)
    cache.put(image.digest, vectors)

    spec = ModelSpec.from_config(config)
    w, n = config.sliding_window, args.prefix
    ids = torch.randint(0, 256, (1, n + 1))
    view = allocate_view(spec, 1, n + 1)
    cold = plan_prefill(CacheState(n), spec, ReplayFlags())
    with torch.inference_mode():
        execute(model, cold, ids[:, :n], view)
    plan = plan_prefill(CacheState(n + 1, global_hit=n), spec, ReplayFlags())

    def replay() -> None:
        drop_snapshot(view)
        with torch.inference_mode():
            execute(model, plan, ids, view)

    def tower() -> None:
        with torch.inference_mode():
            vision.span(image)

    variants = {"tower": tower, "cache": lambda: cache.get(image.digest), "replay": replay}
    for fn in variants.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            times[name].append(timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    feature_bytes = vectors.numel() * 2  # kept in bf16 where the model runs in bf16
    rows = [
        "| variant | min ms | median ms | vs replay (median) |",
        "|---|---|---|---|",
        *(
            f"| {k} | {min(v) * 1e3:.2f} | {med[k] * 1e3:.2f} | {med[k] / med['replay']:.3f} |"
            for k, v in times.items()
        ),
    ]
    flash = v41_flash()
    active = parameter_count(flash).active_matmul
    released = DeepseekV41VisionConfig()
    gh, gw, ch, cw = plan_resize(4096, 4096, released)
    span = image_span_length(gh, gw)
    patches = (ch // released.patch_size) * (cw // released.patch_size)
    forward = tower_flops(released, (ch, cw), flash.hidden_size, passes=1)
    lines = [
        BEGIN,
        f"`python bench/bench_images.py --repeats {args.repeats}` on `v41-small-vision` (random weights, "
        f"float32, {torch.get_num_threads()} threads): an image of 448 × 448 pixels is a {image.grid[0]} × "
        f"{image.grid[1]} grid, {image.span_length} positions; the replay is the last {w} rows of a {n}-token "
        "cached prefix through every layer.",
        "",
        *rows,
        "",
        f"Span vectors of that image: {feature_bytes / 1024:.0f} KiB in bf16 ({image.span_length} × "
        f"{config.hidden_size} × 2 B). At DeepSeek-V4.1-Flash's released shapes (computed): a "
        f"{gh} × {gw} image is {span} positions, {span * flash.hidden_size * 2 / 2**20:.1f} MiB of span vectors; "
        f"its tower run is {patches} patches, about {forward / 1e12:.1f} TFLOP, against about "
        f"{2 * active * w / 1e12:.1f} TFLOP for a {w}-row replay ({active / 1e9:.1f}B active matmul "
        "parameters of the text backbone).",
        END,
    ]
    section = "\n".join(lines)
    print(section)
    if args.write:
        replace_section(args.write, section, BEGIN, END, "## Image rows in replay: feature cache or tower")


if __name__ == "__main__":
    main()
