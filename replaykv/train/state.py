"""A run's resumable state and its log: model, AdamW and RNG states saved atomically, SIGTERM
turned into "save at the end of this step and stop", one JSON line per logged step, and the
median step time per phase read back from that log.

Not for: stage checkpoints (see :mod:`replaykv.train.stages`), which carry weights only.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from replaykv.train.recipes import Recipe

STATE = "train_state/state.pt"


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore `rng_state()`; its tensors may have been loaded onto another device (a state file
    read with ``map_location="cuda"``): the generators take CPU byte tensors."""
    torch.set_rng_state(state["torch"].cpu())
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.cpu() for t in state["cuda"]])


def save_state(path: Path, model: nn.Module, opt: torch.optim.Optimizer, meta: dict[str, Any]) -> None:
    """Atomically write model, optimiser, RNG states and `meta` (step, timing, recipe)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state(), **meta}, tmp)
    os.replace(tmp, path)


def saved_progress(path: Path) -> tuple[str, int] | None:
    """(recipe name, step) of the state saved at `path`, read without loading its tensors; None
    when there is none."""
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    return str(state["recipe"]), int(state["step"])


class StopOnSigterm:
    """While installed (main thread only), SIGTERM sets ``requested`` instead of killing, so the
    loop can save its state at the end of the current step and return."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def log_record(out: Path, record: dict[str, Any]) -> None:
    with (out / "train_log.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")


def median_step_seconds(out: Path, recipe: Recipe) -> dict[str, float]:
    """Per phase, the median time of a logged step in OUT/train_log.jsonl (the last record of a
    step counts: a resumed run logs again the steps it redid). Unlike the sum of step times, it
    does not count a step that ran while the process was stopped or the machine was busy."""
    path = out / "train_log.jsonl"
    if not path.exists():
        return {}
    last: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("tokens_per_s"):
            last[record["step"]] = record
    phases = {p.name: p for p in recipe.phases}
    times: dict[str, list[float]] = {}
    for record in last.values():
        phase = phases.get(record.get("phase", ""))
        if phase is not None:
            times.setdefault(phase.name, []).append(phase.tokens / phase.steps / record["tokens_per_s"])
    return {name: statistics.median(ts) for name, ts in times.items()}
