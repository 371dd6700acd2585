"""`replaykv train --contrastive`: the image–caption contrastive stage in P processes.

Each process (gloo on CPU; NCCL with one GPU each under ``--device cuda``, a path not run on
the machines this is developed on; spawned here or started by torchrun) holds the same
model: the language model with `text_proj`, and beside it the tower with `image_proj` (the
tower outside the LM's parameter tree, with its own optimizer). Every step draws a global batch
of generated pairs from the step's seed, takes its slice, runs :func:`.contrastive_step`
(gathers overlapped, or blocking with ``--blocking-gathers``), sums gradients over the
processes and steps both optimizers. Process 0 writes ``contrastive.json`` (loss, exposed
gather time and phase times per step) and the result: the LM export with the tower joined
(``config.json``, ``model.safetensors``) and, under ``vision/``, the tower's own checkpoint
``vision.safetensors`` + ``vision_optimizer.pt`` and ``projections.safetensors``. With ``dump_gradients`` it also writes the first step's summed
gradients (``gradients.pt``), which the tests compare with one process on the whole batch.

Not for: language-model stages (:mod:`replaykv.train.loop`).
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from replaykv.model.checkpoint import build_model, load_model, save_pretrained
from replaykv.model.init import init_weights
from replaykv.model.presets_v41 import get_preset_v41
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.train.multimodal.contrastive import (
    ContrastiveConfig,
    GatherTimes,
    contrastive_step,
    sum_gradients,
)
from replaykv.train.multimodal.data import make_pairs
from replaykv.train.multimodal.phases import VisionTrainer, join_tower, split_tower
from replaykv.train.spawn import spawn

REPORT = "contrastive.json"
VISION_DIR = "vision"  # the tower's own checkpoint and optimizer state, and the projections


class ContrastiveError(RuntimeError):
    """A process of the stage failed; the message is its own error."""


@dataclass(frozen=True)
class ContrastiveArgs:
    """Everything a process needs (picklable)."""

    preset: str
    out: str
    processes: int = 2
    steps: int = 10
    pairs: int = 4  # per process
    overlap: bool = True
    lr: float = 1e-3
    seed: int = 0
    init: str | None = None
    threads: int | None = None
    dump_gradients: bool = False
    dim: int = 64
    device: str = "cpu"  # cuda: one GPU per process (LOCAL_RANK or the rank), NCCL


def projections(model: DeepseekV41ForCausalLM, dim: int, seed: int) -> tuple[nn.Linear, nn.Linear]:
    """(text_proj, image_proj), drawn from `seed`."""
    vc = model.config.vision_config
    assert vc is not None
    gen = torch.Generator().manual_seed(seed + 7)
    text_proj = nn.Linear(model.config.hidden_size, dim, bias=False)
    image_proj = nn.Linear(model.config.hidden_size, dim, bias=False)
    with torch.no_grad():
        for proj in (text_proj, image_proj):
            proj.weight.copy_(torch.randn(proj.weight.shape, generator=gen) * proj.in_features**-0.5)
    return text_proj, image_proj


def build(args: ContrastiveArgs) -> DeepseekV41ForCausalLM:
    """The model of the stage: the preset drawn from `seed`, with `init`'s weights loaded over it
    when given (its text weights, and its tower's if it has one)."""
    config = get_preset_v41(args.preset)
    if config.vision_config is None:
        raise ValueError(f"preset {args.preset!r} has no vision tower; the contrastive stage needs one")
    model = build_model(config)
    assert isinstance(model, DeepseekV41ForCausalLM)
    init_weights(model, seed=args.seed)
    if args.init is not None:
        text = load_model(args.init)
        try:
            missing = model.load_state_dict(text.state_dict(), strict=False).missing_keys
        except RuntimeError as e:  # tensors of other shapes
            raise ValueError(
                f"--init {args.init}: its weights do not fit preset {args.preset!r} ({e})"
            ) from e
        if any(not k.startswith("model.vision.") for k in missing):
            raise ValueError(f"--init {args.init}: its weights do not fit preset {args.preset!r}")
    model.float().train()
    return model


def launch(args: ContrastiveArgs) -> dict[str, Any] | None:
    """Run the stage in `args.processes` processes (here when torchrun started us)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return worker(int(os.environ["RANK"]), args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return spawn(worker, args, args.processes, Path(args.out) / REPORT, ContrastiveError, "process")


def worker(rank: int, args: ContrastiveArgs) -> dict[str, Any] | None:
    torch.set_num_threads(args.threads or 1)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=args.processes)
    try:
        return _train(rank, args, dev)
    finally:
        dist.destroy_process_group()


def _train(rank: int, args: ContrastiveArgs, dev: torch.device) -> dict[str, Any] | None:
    model = build(args).to(dev)
    cfg = ContrastiveConfig(dim=args.dim)
    text_proj, image_proj = (p.to(dev) for p in projections(model, args.dim, args.seed))
    lm, tower = split_tower(model)
    vc = model.config.vision_config
    assert vc is not None
    lm_opt = torch.optim.AdamW([*lm.parameters(), *text_proj.parameters()], lr=args.lr, weight_decay=0.0)
    vision = VisionTrainer(tower, lr=args.lr)
    vision.optimizer.add_param_group({"params": list(image_proj.parameters()), "weight_decay": 0.0})
    log: list[dict[str, float]] = []
    n = args.pairs
    for step in range(args.steps):
        batch = make_pairs(args.seed * 100_003 + step, n * args.processes, vc)
        rows = slice(rank * n, (rank + 1) * n)
        times = GatherTimes()
        loss = contrastive_step(
            lm, text_proj, tower, image_proj, batch.ids[rows].to(dev), batch.mask[rows].to(dev),
            batch.images[rows], cfg,
            overlap=args.overlap, times=times,
        )  # fmt: skip
        sum_gradients(lm, text_proj, tower, image_proj)
        if step == 0 and args.dump_gradients and rank == 0:
            grads = {
                f"{prefix}.{k}": p.grad.detach().cpu().clone()
                for prefix, module in (
                    ("lm", lm),
                    ("text_proj", text_proj),
                    ("tower", tower),
                    ("image_proj", image_proj),
                )
                for k, p in module.named_parameters()
                if p.grad is not None
            }
            torch.save({"loss": loss, "grads": grads}, Path(args.out) / "gradients.pt")
        lm_opt.step()
        lm_opt.zero_grad(set_to_none=True)
        vision.step()
        log.append({"step": step, "loss": float(loss), **asdict(times)})
    if rank != 0:
        return None
    out = Path(args.out)
    save_pretrained(join_tower(lm, tower), out)
    vision.save(str(out / VISION_DIR))
    from safetensors.torch import save_file

    save_file(
        {"text_proj.weight": text_proj.weight.detach(), "image_proj.weight": image_proj.weight.detach()},
        str(out / VISION_DIR / "projections.safetensors"),
    )
    med = {k: statistics.median(e[k] for e in log) for k in log[0] if k != "step"}
    report = {"args": asdict(args), "steps": log, "median": med}
    (out / REPORT).write_text(json.dumps(report, indent=1))
    return report
