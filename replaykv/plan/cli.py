"""`replaykv plan`: the capacity planner's command line.

    python -m replaykv.plan.cli --model v41-flash --workload agent.yaml --plots out/ [--json]
    python -m replaykv.plan.cli --model v41-flash --images-per-turn 0.5 --image-size 1024x768

The model is a preset or a config.json; the workload comes from defaults, then the file, then
the flags (each flag overrides the file). Output: a table, or JSON with ``--json``; PNG plots
with ``--plots DIR``. Exit status 0 on success, 2 on a bad argument, model or workload.
Not for: the arithmetic (:mod:`replaykv.plan.planner`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from replaykv.cli_parser import ArgumentParser
from replaykv.plan.planner import format_table, load_model_config, plan
from replaykv.plan.workload import Workload, load_workload, workload_from_dict

# flag dest -> workload field
_FLAGS: dict[str, tuple[str, str]] = {
    "turn_tokens": ("--turn-tokens", "new input tokens per turn, e.g. lognormal:600:1.0"),
    "first_turn_tokens": ("--first-turn-tokens", "tokens of a session's first prompt (default: like turns)"),
    "output_tokens": ("--output-tokens", "output tokens per turn, e.g. exponential:300"),
    "turns_per_session": ("--turns", "turns per session"),
    "think_time": ("--think-time", "time between a turn's end and the next request, e.g. lognormal:30s:1.2"),
    "sessions_per_hour": ("--sessions-per-hour", "new sessions per hour, whole fleet"),
    "concurrency": ("--concurrency", "contexts resident on one machine's devices"),
    "device_context_tokens": (
        "--context-tokens",
        "context length for the device question (default: mean session)",
    ),
    "retention": ("--retention", "global-KV retention, e.g. 72h"),
    "swa_ttl": ("--ttl", "SWA pool TTL, e.g. 5m"),
    "host_ram": ("--host-ram", "host RAM per machine, e.g. 2TiB"),
    "pool_fraction": ("--pool-fraction", "fraction of host RAM given to the SWA pool"),
    "ssd": ("--ssd", "SSD per machine for the persistent cache, e.g. 30TB"),
    "machines": ("--machines", "number of machines"),
    "device_memory": ("--device-memory", "device memory per machine available to the KV cache"),
    "snapshots_per_turn": ("--snapshots-per-turn", "window snapshots written per turn (default 2)"),
    "target_hit_rate": ("--target-hit-rate", "pool hit rate to size the TTL for"),
    "replay_window": ("--replay-window", "replay span W (default: the model's sliding_window)"),
    "images_per_turn": (
        "--images-per-turn",
        "images in every user turn, the first included (a mean; default 0)",
    ),
    "image_size": (
        "--image-size",
        "pixel size of each image, WIDTHxHEIGHT (e.g. 1024x768); shows what one costs",
    ),
    "image_tokens": ("--image-tokens", "span length of each image in positions (instead of --image-size)"),
}
_MM_FLAGS = {
    "raw_bytes_per_token": ("--mm-raw-bytes", "multimodal: raw bytes per token (rho)"),
    "compute_per_token": ("--mm-compute", "multimodal: FLOP per token (C; default 6 x active params)"),
    "io_bandwidth": (
        "--mm-io-bandwidth",
        "multimodal: storage bandwidth per accelerator, bytes/s (e.g. 2GB)",
    ),
    "gpu_flops": ("--mm-gpu-flops", "multimodal: accelerator FLOP/s"),
}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="replaykv plan", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default="v41-flash", help="preset (v41-flash, v41-small, v4-flash, ...) or config.json"
    )
    p.add_argument("--backbone-only", action="store_true",
                   help="load a released config with Engram/DSpark switched off (backbone accounting)")  # fmt: skip
    p.add_argument("--workload", help="YAML or JSON workload file")
    for dest, (flag, text) in {**_FLAGS, **_MM_FLAGS}.items():
        p.add_argument(flag, dest=dest, default=None, help=text)
    p.add_argument("--no-decoder-replay", dest="decoder_replay", action="store_false", default=None,
                   help="account prefill without decoder replay")  # fmt: skip
    p.add_argument("--accounting", dest="convention", choices=["engine", "report"], default=None,
                   help="engine: layers 0..cut run every row (replaykv, vLLM, SGLang); report: the tech "
                        "report's split, the last KV source counted as decoder")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plots", metavar="DIR", help="write the PNG plots into DIR")
    return p


def _workload(args: argparse.Namespace) -> Workload:
    base = load_workload(args.workload) if args.workload else Workload()
    flags: dict[str, Any] = {d: getattr(args, d) for d in _FLAGS if getattr(args, d) is not None}
    # An image given one way on the command line replaces the file's other way.
    if "image_size" in flags and "image_tokens" not in flags:
        flags["image_tokens"] = None
    if "image_tokens" in flags and "image_size" not in flags:
        flags["image_size"] = None
    for dest in ("decoder_replay", "convention"):
        if getattr(args, dest) is not None:
            flags[dest] = getattr(args, dest)
    mm = {d: getattr(args, d) for d in _MM_FLAGS if getattr(args, d) is not None}
    if mm:
        current = base.multimodal
        merged = {} if current is None else {k: v for k, v in vars(current).items() if v is not None}
        flags["multimodal"] = {**merged, **mm}
    return workload_from_dict(flags, base)


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    try:
        config = load_model_config(args.model, backbone_only=args.backbone_only)
        result = plan(config, _workload(args), model_name=args.model)
    except (ValueError, NotImplementedError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(result.to_json())
    else:
        print(format_table(result))
    if args.plots:
        from replaykv.plan.plots import write_plots

        try:
            paths = write_plots(result, args.plots)
        except OSError as e:
            print(f"error: cannot write plots to {args.plots}: {e}", file=sys.stderr)
            return 2
        print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
