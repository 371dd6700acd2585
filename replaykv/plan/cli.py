"""`replaykv plan`: the capacity planner's command line.

    python -m replaykv.plan.cli --model v41-flash --workload agent.yaml --plots out/ [--json]
    python -m replaykv.plan.cli --model v41-flash --images-per-turn 0.5 --image-size 1024x768
    python -m replaykv.plan.cli --loading --model v41-flash --image-fraction 0.3 --image-bytes 150kB

The model is a preset or a config.json; the workload comes from defaults, then the file, then
the flags (each flag overrides the file). Output: a table, or JSON with ``--json``; PNG plots
with ``--plots DIR``. ``--loading`` prints the multimodal loading condition instead, for a data
mix, given hardware figures and the rates measured on this machine
(:mod:`replaykv.plan.loading`). Exit status 0 on success, 2 on a bad argument, model or workload.
Not for: the arithmetic (:mod:`replaykv.plan.planner`, :mod:`replaykv.plan.loading`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from replaykv.cli_parser import ArgumentParser, UsageError, check_device
from replaykv.plan import loading
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
_LOADING_FLAGS = {
    "image_fraction": ("--image-fraction", "share of tokens that are image positions (default 0.3)"),
    "image_bytes": ("--image-bytes", "bytes of one image as stored, JPEG/PNG (default 150kB)"),
    "text_bytes": ("--text-bytes", "raw bytes per text token (default 4: UTF-8; 1 for a byte vocabulary)"),
    "storage_bandwidth": (
        "--io-bandwidth",
        f"storage read bandwidth per accelerator (default {loading.DEFAULT_IO_BANDWIDTH:.0e} B/s, e.g. 2GB/s)",
    ),
    "accelerator_flops": (
        "--accelerator-flops",
        f"compute per accelerator (default {loading.DEFAULT_ACCELERATOR_FLOPS:.0e} FLOP/s, e.g. 900T)",
    ),
    "tower": ("--tower", "vision tower FLOPs counted: train (default), frozen (forward only) or none"),
    "measure_seconds": ("--measure-seconds", "seconds for each measurement (default 1)"),
    "measure_device": ("--measure-device", "torch device of the matmul measurement (default: cuda if any)"),
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
    g = p.add_argument_group(
        "loading condition",
        "--loading: rho < (B_IO / B_GPU) * C for a data mix (with --image-size or --image-tokens "
        "per image, default 1024x768), on given and on measured hardware",
    )
    g.add_argument("--loading", action="store_true", help="print the loading condition instead of the plan")
    metavars = {"image_fraction": "F", "image_bytes": "SIZE", "text_bytes": "SIZE", "storage_bandwidth": "BYTES/S",
                "accelerator_flops": "FLOP/S", "tower": "MODE", "measure_seconds": "S", "measure_device": "DEVICE"}  # fmt: skip
    for dest, (flag, text) in _LOADING_FLAGS.items():
        g.add_argument(flag, dest=dest, default=None, metavar=metavars[dest], help=text)
    g.add_argument("--no-measure", action="store_true", help="skip the measurements on this machine")
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


def _loading_report(args: argparse.Namespace) -> loading.LoadingReport:
    """The report of `replaykv plan --loading`; ValueError or UsageError for a bad argument."""
    planner_only = [flag for dest, (flag, _) in {**_FLAGS, **_MM_FLAGS}.items()
                    if dest not in ("image_size", "image_tokens") and getattr(args, dest) is not None]  # fmt: skip
    planner_only += [flag for flag, on in (("--workload", args.workload), ("--plots", args.plots),
                     ("--no-decoder-replay", args.decoder_replay is not None),
                     ("--accounting", args.convention)) if on]  # fmt: skip
    if planner_only:
        raise UsageError(f"--loading does not use {', '.join(planner_only)} (flags of the capacity plan)")
    mix = loading.data_mix_from_args(
        image_fraction=args.image_fraction,
        image_bytes=args.image_bytes,
        image_size=args.image_size,
        image_positions=args.image_tokens,
        text_bytes=args.text_bytes,
    )
    hardware = loading.Hardware(
        io_bandwidth=loading.parse_bandwidth(args.storage_bandwidth or loading.DEFAULT_IO_BANDWIDTH),
        accelerator_flops=loading.parse_flops(args.accelerator_flops or loading.DEFAULT_ACCELERATOR_FLOPS),
    )
    tower = args.tower or "train"
    if tower not in loading.TOWER_MODES:
        raise UsageError(f"--tower {tower!r}: choose one of {', '.join(loading.TOWER_MODES)}")
    seconds: float | None = None
    device = "cpu"
    if not args.no_measure:
        try:
            seconds = float(args.measure_seconds or 1.0)
        except ValueError:
            raise UsageError(f"--measure-seconds: expected a number, got {args.measure_seconds!r}") from None
        if not 0 < seconds <= 600:
            raise UsageError(f"--measure-seconds must lie in (0, 600], got {args.measure_seconds}")
        import torch

        device = args.measure_device or ("cuda" if torch.cuda.is_available() else "cpu")
        check_device(device)
    elif args.measure_seconds is not None or args.measure_device is not None:
        raise UsageError("--no-measure leaves nothing for --measure-seconds or --measure-device")
    config = load_model_config(args.model, backbone_only=args.backbone_only)
    return loading.loading_report(
        config, mix, hardware, tower=tower, model_name=args.model, measure_seconds=seconds, device=device
    )


def _run_loading(args: argparse.Namespace) -> int:
    try:
        report = _loading_report(args)
    except (ValueError, UsageError, NotImplementedError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else loading.format_loading(report))
    return 0


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    if args.loading:
        return _run_loading(args)
    loading_only = [flag for dest, (flag, _) in _LOADING_FLAGS.items() if getattr(args, dest) is not None]
    if args.no_measure:
        loading_only.append("--no-measure")
    if loading_only:
        print(f"error: {', '.join(loading_only)} belong(s) to --loading; add --loading", file=sys.stderr)
        return 2
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
