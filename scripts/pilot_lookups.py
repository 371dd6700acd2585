"""Continue a stage checkpoint on a lookup-heavy mixture at chosen learning rates and score the
lookup probe after each arm: does a higher rate, or a row design, teach lookups by a drawn code
where the recipe's task phase (at its final rate) has not?

    python scripts/pilot_lookups.py ~/.cache/replaykv/train/v41-small-stage10 \
        --out /tmp/pilot --steps 120 --lrs 2e-4,1e-3 --seq-len 512 --batch 8 --probe-lengths 512,1024

Each arm starts from the same weights with fresh AdamW moments, warms up over `--warmup` steps
and keeps its rate (or, with `--min-lr`, cools down to it on a cosine): a continuation stage of the `small` recipe (`Recipe.continued`), so
an arm worth keeping goes into `recipes.SMALL_CONTINUATIONS` as the same run; it trains `--steps` steps of `--batch` × `--seq-len` rows of the
mixture given by `--mixture` (the recipe's row kinds and weights), with the `small` recipe's
answer and copy weights (and, with `--evidence-loss`, the evidence-attention loss of
replaykv.train.evidence at that weight, `--evidence-contrast` its contrastive form,
`--evidence-rows` the row kinds it reads, `--evidence-tail` the part of each record it
counts, `--evidence-layers` the layers it teaches (`--evidence-keyed-layers` those for records keyed by a
code), `--evidence-clip` its own gradient budget; with
`--record-keys`, the record-key loss of replaykv.train.keys at that weight on the KV sources
`--record-key-layers`), with `--trace-hops` and `--trace-chains`, multi-hop and chain rows
that answer with every step (`2: B (1) -> C (0)`, `q = y = x = 123`), with `--cycle`, the row
shapes in turn that the recipe's last phases use,
and is scored by scripts/probe_lookups.py's cells (teacher-forced and greedy, held-out filler)
at each probe length. Arms run one after another in one process, so their batches are the same
bits; the state of each arm is kept in OUT/ARM/ for a longer look.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from replaykv.model.checkpoint import load_model
from replaykv.train.data import load_corpus
from replaykv.train.loop import train
from replaykv.train.recipe_spec import COPY_ALPHABET_NAMES, Continuation, Mixture, Phase, Recipe
from replaykv.train.recipes import TASK_ANSWER_WEIGHT, small
from replaykv.train.state import STATE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_lookups import CELLS, TRACE_CELLS, score_cell

DEFAULT_MIXTURE = "lookup=0.5,multihop=0.2,passkey=0.15,copy=0.1,text=0.05"


def parse_shape(text: str) -> tuple[int, int, int | None]:
    """'1024x8x4' (seq_len x batch x micro-batch) or '512x8' as a `Phase.cycle` entry."""
    parts = [int(x) for x in text.split("x")]
    if len(parts) not in (2, 3):
        raise SystemExit(f"error: --cycle takes SEQxBATCH[xMICRO] shapes, got {text!r}")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None


def pilot_recipe(args: argparse.Namespace, lr: float, mixture: Mixture) -> Recipe:
    base = small()
    phase = Phase(
        "pilot",
        steps=args.steps,
        seq_len=args.seq_len,
        batch=args.batch,
        cycle=tuple(parse_shape(x) for x in args.cycle.split(",") if x),
        mixture=mixture,
        answer_weight=TASK_ANSWER_WEIGHT,
        copy_weight=base.phases[-1].copy_weight,  # the task phase's
        prompt_from=0.25,
        index_topk=args.index_topk,
        evidence_loss=args.evidence_loss,
        evidence_contrast=args.evidence_contrast,
        evidence_rows=tuple(args.evidence_rows.split(",")),
        evidence_tail=args.evidence_tail,
        evidence_layers=tuple(int(x) for x in args.evidence_layers.split(",") if x),
        evidence_keyed_layers=(
            None
            if args.evidence_keyed_layers is None
            else tuple(int(x) for x in args.evidence_keyed_layers.split(",") if x and x != "all")
        ),
        evidence_clip=args.evidence_clip,
        record_keys=args.record_keys,
        record_key_layers=tuple(int(x) for x in args.record_key_layers.split(",") if x),
    )
    arm = replace(
        base, continuations=(Continuation(phase, lr, args.seed, args.warmup, args.min_lr),)
    ).continued(0)
    return replace(
        arm,
        name=(
            f"lookup-pilot-lr{lr:g}-segment{mixture.lookup_segment}-evidence{args.evidence_loss:g}"
            + ("-contrast" if args.evidence_contrast else "")
            + ("" if args.evidence_rows == "lookup" else f"-{args.evidence_rows.replace(',', '+')}")
            + (f"-tail{args.evidence_tail}" if args.evidence_tail else "")
            + (f"-clip{args.evidence_clip:g}" if args.evidence_clip else "")
            + (f"-keys{args.record_keys:g}" if args.record_keys else "")
        ),
        checkpoint_every=10**9,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", help="stage checkpoint directory to start every arm from")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--lrs", default="2e-4,1e-3", help="comma-separated learning rates, one arm each")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument(
        "--min-lr",
        type=float,
        default=None,
        help="cosine from each arm's rate down to this one at the last step (a cool-down; default: no decay)",
    )
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--cycle",
        default="",
        help="row shapes taken in turn, e.g. 1024x8x4,2048x4x2 (Phase.cycle; empty: --seq-len x --batch)",
    )
    p.add_argument("--index-topk", type=int, default=512)
    p.add_argument("--mixture", default=DEFAULT_MIXTURE, help="row kind=weight pairs")
    p.add_argument(
        "--lookup-segment", type=int, default=0, help="lookup rows in segments of this many bytes (Mixture)"
    )
    p.add_argument(
        "--evidence-loss", type=float, default=0.0, help="Phase.evidence_loss of every arm (0: off)"
    )
    p.add_argument(
        "--evidence-contrast", action="store_true", help="its contrastive form (Phase.evidence_contrast)"
    )
    p.add_argument(
        "--evidence-rows", default="lookup", help="row kinds whose questions it reads (Phase.evidence_rows)"
    )
    p.add_argument(
        "--evidence-tail", type=int, default=0, help="records by their last N bytes (Phase.evidence_tail)"
    )
    p.add_argument(
        "--evidence-layers",
        default="",
        help="comma-separated layers it teaches (Phase.evidence_layers; empty: every layer with entries)",
    )
    p.add_argument(
        "--evidence-keyed-layers",
        default=None,
        help="the layers it teaches on records keyed by a code, multi-hop, recall and lookup ones "
        "(Phase.evidence_keyed_layers; all: every layer with entries; absent: --evidence-layers)",
    )
    p.add_argument(
        "--evidence-clip",
        type=float,
        default=0.0,
        help="its own gradient norm budget (Phase.evidence_clip; 0: under the recipe's one clip)",
    )
    p.add_argument("--record-keys", type=float, default=0.0, help="Phase.record_keys (0: off)")
    p.add_argument(
        "--record-key-layers",
        default="",
        help="KV sources it reads (Phase.record_key_layers; empty: every one)",
    )
    p.add_argument(
        "--precision", default="auto", help="the training products' precision (auto, float32, bf16)"
    )
    p.add_argument(
        "--seed", type=int, default=small().seed, help="the batches' seed (another one: rows not read before)"
    )
    p.add_argument("--probe-lengths", default="512,1024")
    p.add_argument("--cases", type=int, default=20)
    p.add_argument(
        "--trace-hops",
        action="store_true",
        help="multi-hop rows answer with every code reached (Mixture.trace_hops); probes that cell too",
    )
    p.add_argument(
        "--trace-chains",
        action="store_true",
        help="chain rows answer with the lines behind the value (Mixture.trace_chains); probes the chain cells",
    )
    p.add_argument(
        "--copy-alphabet",
        choices=COPY_ALPHABET_NAMES,
        default="codes",
        help="the copy and repeat rows' strings (Mixture.copy_alphabet; letters: lower case too; lower: lower case alone)",
    )
    p.add_argument("--all-cells", action="store_true", help="also the chain cells of the probe")
    p.add_argument("--kernels", choices=("fused", "eager"), default="fused", help="how a step computes")
    p.add_argument("--skip-start", action="store_true", help="do not score the starting weights")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue each arm from its saved state in OUT/ARM (after SIGTERM)",
    )
    args = p.parse_args()
    cells = CELLS if args.all_cells else CELLS[:2]
    cells += tuple(c for c in TRACE_CELLS if (args.trace_hops and c[1] == "multihop"))
    if args.trace_chains:
        cells += (() if args.all_cells else (CELLS[3],)) + tuple(c for c in TRACE_CELLS if c[1] == "chain")
    heldout = load_corpus()["heldout"]

    def probe(model: Any) -> dict[str, Any]:
        return {
            f"{cell[0]} @ {n}": score_cell(model, cell, n, args.cases, heldout)
            for n in lengths
            for cell in cells
        }

    torch.set_num_threads(2)
    weights = {k: 0.0 for k in Mixture().weights}
    for part in args.mixture.split(","):
        k, v = part.split("=")
        weights[k.strip()] = float(v)
    mixture = Mixture(
        **weights,
        lookup_segment=args.lookup_segment,
        trace_hops=args.trace_hops,
        trace_chains=args.trace_chains,
        copy_alphabet=args.copy_alphabet,
    )
    lengths = [int(x) for x in args.probe_lengths.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"stage": args.stage, "args": vars(args)}
    if args.resume and (out / "pilot.json").exists():
        results = json.loads((out / "pilot.json").read_text()) | results
    # written before the arms train, so an arm stopped in its probe can still be adopted
    (out / "pilot.json").write_text(json.dumps(results, indent=2) + "\n")
    if not args.skip_start:
        print("start:", flush=True)
        results["start"] = probe(load_model(args.stage).float().eval())
    for lr in (float(x) for x in args.lrs.split(",")):
        recipe = pilot_recipe(args, lr, mixture)
        t0 = time.perf_counter()
        r = train(
            recipe,
            out / f"lr{lr:g}",
            init=args.stage,
            resume=args.resume,
            evaluate_at_end=False,
            progress=False,
            precision=args.precision,
            kernels=args.kernels,
        )
        last20 = sum(r.losses[-20:]) / len(r.losses[-20:])
        print(
            f"lr {lr:g}: {r.steps} steps in {time.perf_counter() - t0:.0f} s, last-20 loss {last20:.3f}",
            flush=True,
        )
        model = load_model(args.stage).float()
        model.load_state_dict(torch.load(r.out / STATE, weights_only=False)["model"])
        results[f"lr {lr:g}"] = {
            "loss_last20": last20,
            "probe": probe(model.eval()),
        }
        (out / "pilot.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
