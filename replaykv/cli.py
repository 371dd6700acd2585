"""The `replaykv` command line: one entry point, one subcommand per job.

Parsing happens only here; each subcommand calls the library. Not for: library logic.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from replaykv.cli_parser import (
    ArgumentParser,
    UsageError,
    check_device,
    positive_int,
    usage_error,
    whole_number,
)


def _find_model(args: argparse.Namespace) -> bool | None:
    """Resolve the model source of `args` in place (`args.model`: the directory, else None and
    `args.preset` named) and return the KV-quant override (None: as the config says)."""
    from replaykv.server.settings import model_to_load

    check_device(args.device)
    quant = {"on": True, "off": False}.get(getattr(args, "kv_quant", "config"))
    found = model_to_load(args.model, getattr(args, "preset", None) is not None)
    if found is not None and not (found / "config.json").is_file():
        what = "is not a directory" if not found.is_dir() else "holds no config.json"
        raise UsageError(f"--model {found} {what} (a model directory: config.json + safetensors)")
    args.model = str(found) if found is not None else None
    if args.model is None and hasattr(args, "preset"):
        args.preset = args.preset or "small"
    return quant


def _load(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The model of `args` (with `args.model` set to the directory it came from, if any) and
    whether its weights are random."""

    from replaykv.model.checkpoint import cast_model, load_model, parse_dtype, place

    quant = _find_model(args)
    if args.model:
        from replaykv.model.checkpoint import load_config

        config = load_config(args.model, kv_quant=quant)
        return load_model(args.model, device=args.device, dtype=args.dtype, config=config), False
    from replaykv.model.checkpoint import build_model
    from replaykv.model.init import init_weights
    from replaykv.model.presets import get_preset

    preset = get_preset(args.preset)
    if quant is not None:
        preset = preset.replace(kv_quant=quant)
    model = init_weights(build_model(preset), seed=args.seed)
    cast_model(model, parse_dtype(args.dtype))
    return place(model, args.device), True


def cmd_score(args: argparse.Namespace) -> int:
    import numpy as np

    from replaykv.engine.oneshot import score

    try:
        ids = json.loads(Path(args.input_ids).read_text())
    except OSError as e:
        raise UsageError(f"--input-ids {args.input_ids}: cannot read it ({e.strerror or e})") from e
    except UnicodeDecodeError as e:
        raise UsageError(f"--input-ids {args.input_ids}: not UTF-8 text ({e.reason})") from e
    except json.JSONDecodeError as e:
        raise UsageError(f"--input-ids {args.input_ids}: not JSON ({e})") from e
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids) or not ids:
        print("error: --input-ids must hold a non-empty JSON list of integer token ids", file=sys.stderr)
        return 2
    model, _ = _load(args)
    vocab = model.config.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        print(f"error: token ids out of range [0, {vocab}): {bad[:5]}", file=sys.stderr)
        return 2
    images = _score_images(model, ids, args.image or [])
    if args.cut is None:
        if args.swa_miss_strategy or args.decoder_replay == "on":
            print("error: --swa-miss-strategy and --decoder-replay need --cut H", file=sys.stderr)
            return 2
        from replaykv.engine.scenario import image_spans

        logits = score(model, ids, chunk=args.chunk, spans=image_spans(model, images))
    else:
        from replaykv.engine.scenario import score_after_cut
        from replaykv.replay import ReplayFlags

        flags = ReplayFlags(
            enable_decoder_swa_bounded_replay=args.decoder_replay == "on",
            swa_miss_strategy=args.swa_miss_strategy or "bounded",
            replay_span=args.replay_span,
        )
        try:
            logits, plan = score_after_cut(
                model, ids, args.cut, flags, keep_snapshot=not args.swa_miss_strategy, images=images
            )
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(plan.describe())
    np.save(args.out, logits.numpy().astype(np.float32))
    print(f"wrote {args.out}: float32 {tuple(logits.shape)}")
    return 0


def _score_images(model: Any, ids: list[int], given: list[str]) -> list[Any]:
    """`--image FILE@START` values -> PromptImages over `ids` (the span's positions must carry the
    model's image token id)."""
    from replaykv.images import ImageError, PromptImage, check_placement, prepare_image

    if not given:
        return []
    vision = model.config.vision_config
    if vision is None:
        raise UsageError("--image: the model has no vision tower; it reads text only")
    images = []
    for value in given:
        path, sep, start_text = value.rpartition("@")
        if not sep or not start_text.isdigit():
            raise UsageError(f"--image takes FILE@START (START: the span's first position), got {value!r}")
        try:
            image = prepare_image(Path(path).read_bytes(), vision)
        except OSError as e:
            raise UsageError(f"--image {path}: cannot read it ({e.strerror or e})") from e
        except ImageError as e:
            raise UsageError(f"--image {path}: {e}") from e
        images.append(PromptImage(int(start_text), image))
    try:
        check_placement(ids, images, model.config.image_token_id)
    except ImageError as e:
        raise UsageError(f"--image: {e}") from e
    return images


def cmd_generate(args: argparse.Namespace) -> int:
    from replaykv.engine.oneshot import greedy_generate
    from replaykv.tokenizer import load_tokenizer

    if args.image:
        return _generate_with_images(args)
    model, random_weights = _load(args)
    tok = load_tokenizer(args.model)
    if random_weights:
        print(f"note: preset {args.preset!r} with RANDOM weights; the text below is noise.")
    ids = tok.encode(args.prompt, bos=True)
    ids = [i % model.config.vocab_size for i in ids]
    t0 = time.perf_counter()
    new = greedy_generate(model, ids, args.max_tokens, chunk=args.chunk)
    dt = time.perf_counter() - t0
    print(f"prompt: {args.prompt!r}")
    print(f"output: {tok.decode(new)!r}  (token ids {new})")
    print(f"{len(ids)} prompt + {len(new)} new tokens in {dt:.2f} s")
    return 0


def _generate_with_images(args: argparse.Namespace) -> int:
    """`generate --image`: BOS, the images, then the prompt text (the ids the server's helper
    gives: :func:`replaykv.server.image_parts.raw_prompt`), run greedily by a one-row engine
    with its caches off (the engine places the tower's span vectors)."""
    from replaykv.engine.api import EngineError, Request, SamplingParams
    from replaykv.engine.config import EngineConfig
    from replaykv.engine.engine import Engine
    from replaykv.images import ImageError, prepare_image
    from replaykv.model.checkpoint import load_config
    from replaykv.model.presets import get_preset
    from replaykv.server.image_parts import VisionPath, raw_prompt
    from replaykv.tokenizer import load_tokenizer

    quant = _find_model(args)
    model_config = load_config(args.model, kv_quant=quant) if args.model else get_preset(args.preset)
    vision = VisionPath.of(model_config)
    if vision is None:
        which = f"--model {args.model}" if args.model else f"preset {args.preset!r}"
        raise UsageError(
            f"{which} has no vision tower, so it cannot read --image; use a model that has one "
            "(e.g. --preset v41-tiny-vision)"
        )
    images = []
    for path in args.image:
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise UsageError(f"--image {path}: cannot read it ({e.strerror or e})") from e
        try:
            images.append(prepare_image(data, vision.config))
        except ImageError as e:
            raise UsageError(f"--image {path}: {e}") from e
    tok = load_tokenizer(args.model)
    ids, placed = raw_prompt(tok, vision, images, args.prompt)
    config = EngineConfig(
        model_dir=args.model,
        preset=args.preset or "small",
        seed=args.seed,
        kv_quant=quant,
        device=args.device,
        dtype=args.dtype,
        swa_pool=None,
        store_dir=None,
        device_pool_bytes=0,
        max_batch=1,
        max_queue=1,
        max_context=len(ids) + args.max_tokens,
        prefill_token_budget=args.chunk or len(ids),
    )
    if args.model is None:
        print(f"note: preset {args.preset!r} with RANDOM weights; the text below is noise.")
    engine = Engine(config)
    try:
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        result = engine.generate(Request(tuple(ids), sampling, images=placed))
        dt = time.perf_counter() - t0
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()
    new = result.token_ids
    spans = ", ".join(
        f"{p} ({im.image.grid[0]}×{im.image.grid[1]} grid)" for p, im in zip(args.image, placed, strict=True)
    )
    print(f"images: {spans}")
    print(f"prompt: {args.prompt!r}")
    print(f"output: {tok.decode(new)!r}  (token ids {new})")
    image_tokens = sum(im.end - im.start for im in placed)
    print(f"{len(ids)} prompt tokens ({image_tokens} in images) + {len(new)} new tokens in {dt:.2f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from replaykv.model.presets import all_presets

    p = ArgumentParser(prog="replaykv", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    presets = sorted(all_presets())

    def model_args(sp: argparse.ArgumentParser, need_model: bool = False) -> None:
        sp.add_argument("--model", required=need_model, help="model directory (config.json + safetensors)")
        if not need_model:
            sp.add_argument(
                "--preset",
                default=None,
                choices=presets,
                help="preset with random weights (default: the bundled model, else 'small')",
            )
            sp.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")
        sp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
        sp.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
        sp.add_argument(
            "--chunk", type=whole_number, default=0, help="prefill chunk size in tokens (0 = one shot)"
        )
        sp.add_argument(
            "--kv-quant",
            choices=["config", "on", "off"],
            default="config",
            help="KV fake-quantisers (FP8 window, FP4 entries, MXFP4 index keys): as the config says, or forced",
        )

    sp = sub.add_parser("score", help="teacher-forced float32 logits [S, vocab] of a token sequence")
    model_args(sp, need_model=True)
    sp.add_argument("--input-ids", required=True, help="JSON file holding a list of token ids")
    sp.add_argument("--out", required=True, help="output .npy file")
    sp.add_argument(
        "--cut", type=int, default=None, help="prefill [0, H) as an earlier request, score [H, end)"
    )
    sp.add_argument(
        "--image",
        action="append",
        metavar="FILE@START",
        help="an image whose span starts at position START (its positions carry the image token id); repeatable",
    )
    sp.add_argument(
        "--swa-miss-strategy",
        choices=["bounded", "exact", "truncate", "full"],
        default=None,
        help="drop the window snapshot at H and rebuild it this way (default: keep it, a full hit)",
    )
    sp.add_argument("--decoder-replay", choices=["on", "off"], default="off")
    sp.add_argument(
        "--replay-span", type=positive_int, default=None, help="W of bounded replay (default: the window)"
    )
    sp.set_defaults(func=cmd_score)

    sp = sub.add_parser("generate", help="one-shot greedy generation")
    model_args(sp)
    sp.add_argument("--prompt", default="Hello")
    sp.add_argument("--max-tokens", type=positive_int, default=16, help="tokens to generate (default 16)")
    sp.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help="an image file (PNG, JPEG, ...) put before the prompt text (repeatable; the model needs a "
        "vision tower, e.g. --preset v41-tiny-vision)",
    )
    sp.set_defaults(func=cmd_generate)

    sp = sub.add_parser(
        "plan", help="capacity planner: the three ledgers for a model and a workload", add_help=False
    )
    sp.add_argument("rest", nargs=argparse.REMAINDER)
    sp.set_defaults(func=lambda a: _plan(a.rest))

    sp = sub.add_parser(
        "accept", help="run an acceptance contract (see `replaykv accept --help`)", add_help=False
    )
    sp.add_argument("rest", nargs=argparse.REMAINDER)
    sp.set_defaults(func=lambda a: _accept(a.rest))

    sp = sub.add_parser(
        "fidelity", help="what replay costs in answers (see `replaykv fidelity --help`)", add_help=False
    )
    sp.add_argument("rest", nargs=argparse.REMAINDER)
    sp.set_defaults(func=lambda a: _fidelity(a.rest))

    sp = sub.add_parser("train", help="train the small model (see `replaykv train --help`)", add_help=False)
    sp.add_argument("rest", nargs=argparse.REMAINDER)
    sp.set_defaults(func=lambda a: _train(a.rest))

    sp = sub.add_parser("store", help="operate on a persistent global-KV store: stats, verify, gc")
    sp.add_argument("rest", nargs=argparse.REMAINDER)
    sp.set_defaults(func=lambda a: _store(a.rest))

    sp = sub.add_parser(
        "serve", help="the OpenAI-compatible server (see `replaykv serve --help`)", add_help=False
    )
    sp.add_argument("rest", nargs=argparse.REMAINDER)
    sp.set_defaults(func=lambda a: _serve(a.rest))

    sp = sub.add_parser(
        "route",
        help="a router in front of several serve replicas (see `replaykv route --help`)",
        add_help=False,
    )
    sp.add_argument("rest", nargs=argparse.REMAINDER)
    sp.set_defaults(func=lambda a: _route(a.rest))

    return p


def _store(rest: list[str]) -> int:
    from replaykv.cache.store_cli import main as store_main

    return int(store_main(rest))


def _serve(rest: list[str]) -> int:
    from replaykv.server import main as serve_main

    return int(serve_main(rest))


def _route(rest: list[str]) -> int:
    from replaykv.route import main as route_main

    return int(route_main(rest))


def _plan(rest: list[str]) -> int:
    from replaykv.plan.cli import main as plan_main

    return int(plan_main(rest))


def _accept(rest: list[str]) -> int:
    from replaykv.accept.cli import main as accept_main

    return int(accept_main(rest))


def _fidelity(rest: list[str]) -> int:
    from replaykv.fidelity.cli import main as fidelity_main

    return int(fidelity_main(rest))


def _train(rest: list[str]) -> int:
    from replaykv.train.cli import main as train_main

    return int(train_main(rest))


_PASSTHROUGH = {
    "plan": _plan, "store": _store, "serve": _serve, "route": _route, "train": _train, "accept": _accept,
    "fidelity": _fidelity,
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["train"]:
        from replaykv.malloc import reexec_keeping_freed_memory

        reexec_keeping_freed_memory()  # a console `replaykv train`: glibc keeps freed memory
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _PASSTHROUGH:  # subcommands with their own parsers
        return _PASSTHROUGH[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except UsageError as e:
        return usage_error(str(e))
