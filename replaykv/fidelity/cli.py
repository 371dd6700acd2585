"""`replaykv fidelity`: the fidelity study on a model, written as JSON, Markdown and a plot.

    replaykv fidelity --model replaykv/weights/small --out results/fidelity
    replaykv fidelity --parts tokens --lengths 1024 --prompts 4 --out /tmp/f   # a quick look

Parts: `tokens` (per-token KL, top-1 agreement, first greedy divergence, decay with distance
from the cut), `answers` (task accuracy per path with paired differences), `drift` (sessions in
turns against one pass). OUT gets fidelity.json (everything, with the engine commit and the
model's digests), fidelity.md (the tables) and decay.png; `--write FILE` also replaces the
section between the fidelity markers in FILE (docs/fidelity.md). Not for: serving endpoints
(see `replaykv accept`).
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from replaykv.cli_parser import ArgumentParser, UsageError, check_device, positive_int, usage_error
from replaykv.fidelity.prompts import FAMILIES
from replaykv.fidelity.study import DEFAULT_OFFSETS, StudySpec, resolve_offset

BEGIN, END = "<!-- fidelity:begin -->", "<!-- fidelity:end -->"
PARTS = ("tokens", "answers", "drift")


def _csv(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in _csv(text))
    except ValueError as exc:
        raise UsageError(f"expected comma-separated whole numbers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise UsageError(f"expected comma-separated positive numbers, got {text!r}")
    return values


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="replaykv fidelity", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    p.add_argument("--preset", default=None, help="a preset with random weights instead (tests, smoke runs)")
    p.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--parts", default="tokens,answers,drift", help=f"any of {','.join(PARTS)}")
    p.add_argument("--families", default=",".join(FAMILIES), help=f"prompt families: {','.join(FAMILIES)}")
    p.add_argument("--lengths", default="1024,2048", help="context lengths in tokens")
    p.add_argument("--prompts", type=positive_int, default=8, help="prompts per family and length (tokens)")
    p.add_argument(
        "--answer-prompts", type=positive_int, default=40, help="prompts per task and length (answers)"
    )
    p.add_argument(
        "--offsets", default=",".join(DEFAULT_OFFSETS), help="cut offsets after the anchor (W = the span)"
    )
    p.add_argument("--paths", default="bounded,decoder,both", help="replay paths compared with the exact one")
    p.add_argument("--continuation", type=positive_int, default=64, help="greedy continuation tokens")
    p.add_argument("--turns", default="5,10,20", help="turns per drift session")
    p.add_argument(
        "--drift-prompts", type=positive_int, default=8, help="prompts per family and length (drift)"
    )
    p.add_argument("--drift-lengths", default=None, help="lengths of drift sessions (default: --lengths)")
    p.add_argument("--replay-span", type=positive_int, default=None, help="W (default: the model's window)")
    p.add_argument(
        "--corpus-files", type=positive_int, default=None, help="held-out corpus from this many files"
    )
    p.add_argument("--write", default=None, help="also replace the fidelity section of this Markdown file")
    p.add_argument("--quiet", action="store_true")
    return p


def _model(args: Any) -> tuple[Any, dict[str, Any]]:
    from replaykv.model.checkpoint import build_model, load_model, place, weights_digest
    from replaykv.model.init import init_weights
    from replaykv.model.presets import get_preset
    from replaykv.server.settings import model_to_load

    found = model_to_load(args.model, args.preset is not None)
    model: Any
    if found is None:
        config = get_preset(args.preset or "small")
        model = place(init_weights(build_model(config), seed=args.seed), args.device)
        name = f"preset {args.preset or 'small'} (random weights, seed {args.seed})"
    else:
        if not (found / "config.json").is_file():
            raise UsageError(
                f"--model {found} holds no config.json (a model directory: config.json + safetensors)"
            )
        model, name = load_model(found, device=args.device, dtype="float32").eval(), str(found)
    # the same identity an acceptance report gives the model (Engine.model_identity)
    return model, {
        "name": name,
        "weights_sha256": weights_digest(model),
        "config_digest": model.config.digest(),
    }


def _replace_section(path: Path, section: str) -> None:
    """Put `section` between the fidelity markers of `path` (appended under "## Results" when
    the file has none)."""
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n## Results\n\n" + section + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args, argv if argv is not None else sys.argv[2:])
    except (UsageError, ValueError) as e:
        return usage_error(str(e))


def run(args: Any, argv: list[str]) -> int:
    import torch

    from replaykv.accept.harness import _environment
    from replaykv.fidelity.drift import drift_study
    from replaykv.fidelity.report import plot_decay, render
    from replaykv.fidelity.study import answers, token_fidelity
    from replaykv.train.data import load_corpus

    check_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = _csv(args.parts)
    if not parts or set(parts) - set(PARTS):
        raise UsageError(f"--parts takes any of {','.join(PARTS)}, got {args.parts!r}")
    families, offsets, paths = _csv(args.families), _csv(args.offsets), _csv(args.paths)
    for label in offsets:
        resolve_offset(label, 128)  # a bad label fails before any work
    spec = StudySpec(
        families, _ints(args.lengths), args.prompts, offsets, paths, args.continuation, args.replay_span
    )
    model, info = _model(args)
    heldout = load_corpus(max_files=args.corpus_files)["heldout"]
    say = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "command": "replaykv fidelity " + shlex.join(argv),
        "environment": _environment(),
        "model": info,
    }
    if "tokens" in parts:
        result["tokens"] = token_fidelity(model, heldout, spec, say)
    if "answers" in parts:
        aspec = StudySpec(
            tuple(f for f in families if f != "text"), spec.lengths, args.answer_prompts, offsets, paths,
            args.continuation, args.replay_span,
        )  # fmt: skip
        result["answers"] = answers(model, heldout, aspec, say)
    if "drift" in parts:
        lengths = _ints(args.drift_lengths) if args.drift_lengths else spec.lengths
        result["drift"] = drift_study(
            model, heldout, lengths, families, args.drift_prompts, _ints(args.turns), args.replay_span, say
        )
    result["seconds"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fidelity.json").write_text(json.dumps(result, indent=1) + "\n")
    text = render(result)
    (out / "fidelity.md").write_text(text + "\n")
    if "tokens" in result:
        plot_decay(result, out / "decay.png")
    if args.write:
        _replace_section(Path(args.write), "\n".join([BEGIN, text, END]))
    say(f"wrote {out / 'fidelity.json'} and {out / 'fidelity.md'} in {result['seconds']:.0f} s")
    return 0
