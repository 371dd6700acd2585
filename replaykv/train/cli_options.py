"""The options of `replaykv train` (:mod:`replaykv.train.cli`): the parser, and which options
each mode reads (a mode refuses the options it does not read, by name).
"""

from __future__ import annotations

import argparse

from replaykv.cli_parser import ArgumentParser, positive_int
from replaykv.train.recipes import RECIPES


def shard_size(text: str) -> int:
    """argparse type: a file size of at least 1 MiB (16MiB, 16M, 16000000)."""
    from replaykv.cache.stores import parse_capacity

    try:
        value = parse_capacity(text)
    except ValueError:
        value = 0.0
    if isinstance(value, float) or value < 1 << 20:
        raise argparse.ArgumentTypeError(f"expected a size of at least 1 MiB such as 16MiB, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="replaykv train", description="Train replaykv's small V4.1 model.")
    p.add_argument("--recipe", choices=sorted(RECIPES), required=True, help="tiny (tests), small, adapt")
    p.add_argument("--out", required=True, help="output directory (export, card, log, train_state/)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from OUT/train_state/ (exact), else from the last stage checkpoint "
        "(OUT/stage/, or the one committed in the package) with fresh optimiser moments; after the "
        "recipe's own stages, its continuation stages, each from the stage before (OUT/continue/S/)",
    )
    p.add_argument(
        "--stages", type=positive_int, default=None, help="stop after this many stage ends (default: all)"
    )
    p.add_argument(
        "--from-stage", default=None, help="stage checkpoint directory to continue from (with --resume)"
    )
    p.add_argument(
        "--ship",
        action="store_true",
        help="also copy each stage checkpoint into the package (replaykv/weights/<recipe's directory>/)",
    )
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="stop after global step N (resume later; not in continuation stages)",
    )
    p.add_argument(
        "--init", default=None, help="checkpoint to start from (the adapt recipe: the small export)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per forward (memory only)")
    p.add_argument(
        "--shard-size",
        type=shard_size,
        default=None,
        help="write stage checkpoints and the export in safetensors shards of at most this size "
        "(e.g. 16MiB; default: one file)",
    )
    p.add_argument(
        "--kernels",
        choices=("fused", "eager"),
        default="fused",
        help="fused: compiled mHC sites and other training-only forms (default); eager: the engine's layers",
    )
    p.add_argument(
        "--precision",
        choices=("auto", "float32", "bf16"),
        default="auto",
        help="matrix products in bf16 (float32 master weights) or float32; auto: bf16 where this "
        "device multiplies bf16 at least twice as fast (default)",
    )
    p.add_argument("--eval-only", action="store_true", help="evaluate OUT's model and rewrite its card")
    p.add_argument(
        "--bar",
        action="store_true",
        help="score the stage checkpoint (OUT/stage/, or --from-stage) on the recipe's shipping bar: "
        "writes bar.json, MODEL_CARD.md and the rung into stage.json (with --ship, then copies it)",
    )
    p.add_argument(
        "--bar-lengths", default=None, help="comma-separated context lengths for --bar (default: the bar's)"
    )
    p.add_argument(
        "--bar-traced",
        action="store_true",
        help="--bar with the multi-hop and chain cells answered step by step (BarSpec.trace_hops and "
        "trace_chains: `2: B (1) -> C (0)`, `q = y = x = 123`)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs still go to OUT)")
    pp = p.add_argument_group("pipeline parallelism (replaykv.train.pipeline)")
    pp.add_argument(
        "--pipeline-stages",
        type=positive_int,
        default=None,
        help="train in P pipeline stages, one process each (spawned here, or started by torchrun "
        "--nproc-per-node P); gloo on CPU, NCCL on GPUs",
    )
    pp.add_argument(
        "--micro-batches", type=positive_int, default=None, help="micro-batches per step (default: P)"
    )
    pp.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b", help="pipeline schedule")
    pp.add_argument(
        "--stage-boundaries",
        default=None,
        help="first layer of stages 1..P-1, comma-separated (default: layers split evenly)",
    )
    pp.add_argument(
        "--pipeline-payload",
        choices=("exact", "compact"),
        default="exact",
        help="exact: a group's entries cross a boundary (bit-identical to one process); compact: its "
        "latents only, entries rebuilt after the boundary (fewer bytes, equal to float rounding)",
    )
    pp.add_argument(
        "--context-parallel",
        type=positive_int,
        default=1,
        help="split each sequence into this many shards per stage, one process each "
        "(processes = pipeline stages x context shards)",
    )
    pp.add_argument(
        "--print-plan",
        action="store_true",
        help="print the stage plan (layers, payload, shadow indexers) and exit",
    )
    cs = p.add_argument_group("image-caption contrastive stage (replaykv.train.multimodal)")
    cs.add_argument(
        "--contrastive",
        action="store_true",
        help="train the vision tower and the language model on generated image-caption pairs with "
        "the pairwise sigmoid loss, on the recipe's preset with its vision tower (<preset>-vision); "
        "data parallel over --processes gloo processes on the CPU (or started by torchrun)",
    )
    cs.add_argument(
        "--processes", type=positive_int, default=None, help="processes of the contrastive stage (default 2)"
    )
    cs.add_argument(
        "--pairs", type=positive_int, default=None, help="image-caption pairs per process a step (default 4)"
    )
    cs.add_argument(
        "--blocking-gathers",
        action="store_true",
        help="wait for each feature gather where it is issued (default: the image features travel "
        "during the text forward, the text features during the text backward)",
    )
    return p


PIPELINE_UNSUPPORTED = ("ship", "from_stage", "micro_batch", "shard_size", "eval_only", "bar", "bar_traced")
# What --contrastive reads (with --device cpu or auto); every other option given is refused.
CONTRASTIVE_OPTIONS = ("recipe", "out", "contrastive", "processes", "pairs", "blocking_gathers", "steps",
                       "init", "threads", "no_progress", "device")  # fmt: skip
CONTRASTIVE_ONLY = ("processes", "pairs", "blocking_gathers")


def given_options(argv: list[str] | None) -> dict[str, str]:
    """The options on the command line (dest -> its flag), whatever their values: a default
    given explicitly counts, so a mode can refuse every option it does not read."""
    probe = build_parser()
    flags = {}
    for action in probe._actions:
        if action.option_strings:
            flags[action.dest] = action.option_strings[0]
            action.default = argparse.SUPPRESS
    return {dest: flags[dest] for dest in vars(probe.parse_args(argv))}
