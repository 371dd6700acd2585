"""Pipeline-parallel training steps: P = 1, 2, 4 stages side by side, with what crosses each
boundary and the shared state each micro-batch holds.

For: ``python bench/bench_pipeline.py [--recipe tiny|small] [--stages 1,2,4] [--micro-batches 4]
[--payload exact,compact] [--steps 4] [--write docs/benchmarks.md]``. Each setting is a real `replaykv train
--pipeline-stages P` run (one process per stage, gloo on loopback) of the recipe's first phase
for `--steps` optimizer steps from the same seed; the first step (shape inference, warm-up) is
dropped and the rest give min / median step time. Also printed: bytes one micro-batch sends over
each boundary (the residual alone, and the extended payload with CSA2's latents and selections),
the bubble fraction per stage (1 - busy / step time) next to the schedule's ideal (P-1)/(M+P-1),
and the peak bytes of shared state a stage held during the last step with what was left after
each micro-batch's backward. On a 2-core machine the stages share the cores, so P > 1 shows the
pipeline's overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from report import replace_section

from replaykv.malloc import reexec_keeping_freed_memory
from replaykv.train.pipeline.run import PipelineArgs, launch
from replaykv.train.recipes import Recipe, get_recipe


def first_phase(name: str, steps: int) -> Recipe:
    base = get_recipe(name)
    phase = dataclasses.replace(base.phases[0], steps=steps)
    return dataclasses.replace(base, phases=(phase,), warmup=0, stages=(), eval_every=0, init_from=None)


def run(recipe: Recipe, stages: int, micro: int, schedule: str, threads: int, payload: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        report = launch(
            PipelineArgs(
                recipe.name,
                out,
                stages,
                micro,
                schedule,
                None,
                save=False,
                recipe_obj=recipe,
                threads=threads,
                payload=payload,
                kernels="eager",
                precision="float32",
            )
        )
    assert report is not None
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--stages", default="1,2,4")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    ap.add_argument("--payload", default="exact,compact")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write", default="")
    args = ap.parse_args()
    reexec_keeping_freed_memory()
    recipe = first_phase(args.recipe, args.steps)
    phase = recipe.phases[0]
    rows, payload_rows, memory_rows = [], [], []
    for p in (int(x) for x in args.stages.split(",")):
        for payload in args.payload.split(",") if p > 1 else ["exact"]:
            rep = run(recipe, p, args.micro_batches, args.schedule, args.threads, payload)
            times = [r["seconds"] for r in rep["log"][1:]] or [rep["log"][0]["seconds"]]
            bubble = {int(k): v for k, v in rep["bubble_fraction"].items()}
            form = payload if p > 1 else "–"
            rows.append(
                f"| {p} | {form} | {min(times):.2f} / {statistics.median(times):.2f} | "
                f"{phase.batch * phase.seq_len / statistics.median(times):,.0f} | "
                + ", ".join(f"{bubble[k]:.2f}" for k in range(p))
                + f" | {rep['ideal_bubble_fraction']:.2f} |"
            )
            for st in rep["stage_reports"]:
                sent = st["sent"]
                if sent is not None:
                    extra = ", ".join(
                        f"{k} {v:,}"
                        for k, v in sent["fields"].items()
                        if k not in ("streams", "pre_mix", "input_ids")
                    )
                    payload_rows.append(
                        f"| {p} | {payload} | {st['stage']} → {st['stage'] + 1} (layer {sent['boundary_layer']}) | "
                        f"{sent['residual_bytes']:,} | {sent['payload_bytes']:,} | "
                        f"{sent['payload_bytes'] / sent['residual_bytes']:.3f} | {extra or '–'} |"
                    )
                trace = st["trace"]
                peak = max((sum(e["bytes"].values()) for e in trace), default=0)
                left = [e["bytes"][str(e["micro_batch"])] for e in trace if e["event"] == "backward"]
                memory_rows.append(
                    f"| {p} | {form} | {st['stage']} | {peak:,} | {', '.join(f'{x:,}' for x in left)} |"
                )
            print(f"P={p} {payload}: median {statistics.median(times):.2f} s", flush=True)
    cmd = (
        f"python bench/bench_pipeline.py --recipe {args.recipe} --stages {args.stages} "
        f"--micro-batches {args.micro_batches} --schedule {args.schedule} --payload {args.payload} "
        f"--steps {args.steps}"
    )
    begin, end = f"<!-- bench_pipeline_{args.recipe}:begin -->", f"<!-- bench_pipeline_{args.recipe}:end -->"
    section = "\n".join(
        [
            begin,
            f"`{cmd}` ({phase.batch} × {phase.seq_len} tokens a step, {args.micro_batches} micro-batches, "
            f"{args.schedule}, float32 eager, {args.threads} threads shared by the stages; first step dropped):",
            "",
            "| stages | payload | step s (min / median) | tokens/s | bubble per stage | ideal bubble |",
            "|---:|---|---|---:|---|---:|",
            *rows,
            "",
            "Bytes one micro-batch sends over each boundary:",
            "",
            "| stages | payload | boundary | residual only | extended payload | ratio | CSA2 fields (bytes) |",
            "|---:|---|---|---:|---:|---:|---|",
            *payload_rows,
            "",
            "Shared state of the last step per stage (bytes; tensor registry): peak over the step, and what "
            "each micro-batch still held after its own backward:",
            "",
            "| stages | payload | stage | peak | left after each backward |",
            "|---:|---|---:|---:|---|",
            *memory_rows,
            end,
        ]
    )
    print(section)
    if args.write:
        replace_section(args.write, section, begin, end, f"## Pipeline-parallel training ({args.recipe})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
