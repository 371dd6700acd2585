"""One training step of a recipe in each training setting, side by side in one process: tokens/s
and achieved GFLOP/s against torch.mm's peak measured in the same run.

    OMP_NUM_THREADS=2 python bench/bench_train.py --recipe small --phase base --repeats 5
    python bench/bench_train.py --recipe small --phase base,4k --repeats 3 --write docs/benchmarks.md

Settings (rounds interleave them, so drift on a shared machine hits each alike):

    float32      eager float32, what `replaykv train` ran before its speed work
    bf16         the same step under torch.autocast(bfloat16) (float32 master weights and AdamW)
    fused        the training-only fused forms (replaykv.model.fused), float32
    fused-bf16   both: what `replaykv train` runs by default where bf16 products are fast

A step is `accumulate_gradients` + gradient clipping + AdamW + router balancing on a batch of the
chosen phase (the same batch for every setting and round). The FLOPs of a step are counted once
with torch's FlopCounterMode (matrix products and attention; elementwise work is not counted), so
"share of peak" is the matrix-product throughput the step reaches against a large square
torch.mm of the same dtype. The process re-executes itself with glibc keeping freed memory
(replaykv.malloc), as `replaykv train` does.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import replace_section

from replaykv.malloc import reexec_keeping_freed_memory
from replaykv.model.spec import ModelSpec
from replaykv.train.data import MixtureSampler, load_corpus
from replaykv.train.distill import IndexerDistillation
from replaykv.train.loop import accumulate_gradients
from replaykv.train.recipes import get_recipe
from replaykv.train.setup import RouterBalance, fresh_model, make_optimizer
from replaykv.train.speed import StepSettings


def mm_peak(dtype: torch.dtype, n: int = 1024, repeats: int = 3) -> float:
    """GFLOP/s of an n × n × n torch.mm in `dtype` (best of `repeats`)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


# Setting name -> (kernels, precision) of replaykv.train.speed.StepSettings.
SETTINGS = {
    "float32": StepSettings("eager", "float32"),
    "bf16": StepSettings("eager", "bf16"),
    "fused": StepSettings("fused", "float32"),
    "fused-bf16": StepSettings("fused", "bf16"),
}


def _setting(name: str) -> contextlib.AbstractContextManager[None]:
    if name not in SETTINGS:
        raise SystemExit(f"unknown setting {name!r}; choose from {sorted(SETTINGS)}")
    return SETTINGS[name].applied(torch.device("cpu"))


def make_step(
    recipe_name: str, phase_name: str, micro_batch: int | None
) -> tuple[Callable[[str], float], int]:
    """A closure running one optimiser step in a setting (returns its seconds), and the batch's tokens."""
    recipe = get_recipe(recipe_name)
    phase_index = [p.name for p in recipe.phases].index(phase_name)
    step_no = sum(p.steps for p in recipe.phases[:phase_index])
    phase = recipe.phases[phase_index]
    corpus = load_corpus(max_files=recipe.corpus_files)
    model = fresh_model(recipe, seed=recipe.seed)
    spec = ModelSpec.from_config(model.config)
    opt = make_optimizer(model, recipe)
    sampler = MixtureSampler(corpus["train"], recipe, spec.sliding_window, spec.group_alignment)
    batch = sampler.batch(step_no)
    distill = IndexerDistillation(model, recipe.indexer_rows)
    balance = RouterBalance(model, recipe.router_bias_rate)
    device = torch.device("cpu")

    def step(setting: str) -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with _setting(setting):
            accumulate_gradients(model, spec, batch, phase, recipe, distill, device, micro_batch)
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        balance.update()
        return time.perf_counter() - t0

    return step, batch.tokens


def count_flops(step: Callable[[str], float]) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        step("float32")
    return int(counter.get_total_flops())


def cpu_name() -> str:
    """The CPU's model name and the vector kernels torch picked (they set speed and rounding)."""
    name = platform.processor() or "CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {torch.backends.cpu.get_cpu_capability()} kernels"


def time_phase(
    recipe: str, phase: str, settings: list[str], repeats: int, micro_batch: int | None
) -> tuple[dict[str, list[float]], int, int]:
    """Step times per setting (rounds interleaved), the batch's tokens and its counted FLOPs."""
    step, tokens = make_step(recipe, phase, micro_batch)
    flops = count_flops(step)
    for s in settings:  # warm-up: first-touch allocation, kernel selection, compilation
        step(s)
    times: dict[str, list[float]] = {s: [] for s in settings}
    for r in range(repeats):
        for s in settings if r % 2 == 0 else settings[::-1]:
            times[s].append(step(s))
    return times, tokens, flops


def main() -> int:
    reexec_keeping_freed_memory()
    # The rounds alternate autocast on and off, and each switch is a guard failure of every
    # compiled function: past dynamo's default of 8 entries the fused attention block would fall
    # back to eager for the rest of the run (a training run keeps one setting).
    torch._dynamo.config.recompile_limit = 64
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="small")
    ap.add_argument("--phase", default="base", help="recipe phases whose batch shapes are timed (comma-separated)")
    ap.add_argument("--settings", default="float32,fused,fused-bf16")
    ap.add_argument("--repeats", type=int, default=5, help="rounds (each runs every setting once)")
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--write", default="", help="docs/benchmarks.md: replace this bench's section")
    args = ap.parse_args()
    settings = args.settings.split(",")
    for s in settings:
        _setting(s)  # unknown names fail before anything runs
    results = {ph: time_phase(args.recipe, ph, settings, args.repeats, args.micro_batch) for ph in args.phase.split(",")}
    peaks = {"float32": mm_peak(torch.float32), "bf16": mm_peak(torch.bfloat16)}
    lines = [
        "<!-- bench_train:begin -->",
        f"`python bench/bench_train.py --recipe {args.recipe} --phase {args.phase} "
        f"--settings {args.settings} --repeats {args.repeats}`, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__} ({cpu_name()}); rounds interleaved; "
        f"torch.mm peak in the same run {peaks['float32']:.0f} GFLOP/s float32, {peaks['bf16']:.0f} GFLOP/s "
        "bf16. GFLOP/s counts the matrix products of a step (once, by FlopCounterMode) over its median time.",
        "",
        "| phase (tokens, GFLOP) | setting | step s (min / median) | tokens/s (median) | × float32 | GFLOP/s | share of its mm peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for phase, (times, tokens, flops) in results.items():
        base = statistics.median(times[settings[0]])
        for s in settings:
            med, low = statistics.median(times[s]), min(times[s])
            gflops = flops / med / 1e9
            peak = peaks["bf16" if "bf16" in s else "float32"]
            lines.append(
                f"| {phase} ({tokens:,}, {flops / 1e9:.0f}) | {s} | {low:.2f} / {med:.2f} | {tokens / med:,.0f} | "
                f"{base / med:.2f} | {gflops:.1f} | {100 * gflops / peak:.0f}% |"
            )
    lines.append("<!-- bench_train:end -->")
    print("\n".join(lines))
    if args.write:
        replace_section(
            args.write, "\n".join(lines), lines[0], lines[-1], "## Training step (bench/bench_train.py)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
