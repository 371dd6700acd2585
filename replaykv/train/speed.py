"""How a training step computes: kernels (eager or fused) and the precision of matrix products.

Neither changes what is trained, only float rounding and speed:

    kernels    eager   every layer as the engine runs it (plus the training-only band form of
                       window attention, always on)
               fused   the compiled mHC sites and dense scoring of small sparse prefixes
                       (replaykv.model.fused); the default
    precision  float32 every product in float32
               bf16    matrix products under torch.autocast(bfloat16); master weights, AdamW
                       moments, gradients, the mHC mixes and residual streams, norms, the
                       router's logits and the losses (the evidence-attention loss's logits
                       and softmax too) stay float32 (autocast's cast cache keeps one bf16
                       copy of each weight per optimiser step)
               auto    bf16 where this device multiplies bf16 at least twice as fast as float32
                       (CUDA with bf16; CPUs with AVX512-BF16 or AMX), float32 elsewhere (an
                       AVX2-only CPU multiplies bf16 about a hundred times slower)

Either way a step runs under torch's deterministic algorithms (`deterministic`): without them,
two runs of the same steps of `small` with the fused kernels, the evidence loss and a cycle of
row shapes parted in the fourth decimal of the loss at the seventh step; with them, in separate
processes, they gave the same bits (the eager kernels did either way), at a cost within the
steps' noise.

`bench/bench_train.py` times the settings side by side. Not for: what the recipe trains.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from replaykv.model.fused import fused_training

KERNELS = ("fused", "eager")
PRECISIONS = ("auto", "float32", "bf16")


def mm_gflops(dtype: torch.dtype, device: torch.device, n: int = 512, repeats: int = 3) -> float:
    """GFLOP/s of an n × n × n torch.mm in `dtype` on `device` (best of `repeats`)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first call warms up
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def choose_precision(precision: str, device: torch.device) -> str:
    """float32 or bf16 for `precision` (auto measures this device's products)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "float32"
    if device.type != "cpu":
        return "float32"
    fp32 = mm_gflops(torch.float32, device)
    bf16 = mm_gflops(torch.bfloat16, device)
    return "bf16" if bf16 >= 2 * fp32 else "float32"


@dataclass(frozen=True)
class StepSettings:
    """The kernels and the (resolved) precision of a run's steps."""

    kernels: str = "fused"
    precision: str = "float32"

    def __post_init__(self) -> None:
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, not {self.kernels!r}")
        if self.precision not in ("float32", "bf16"):
            raise ValueError(f"a step's precision is float32 or bf16, not {self.precision!r}")

    @classmethod
    def resolve(cls, kernels: str, precision: str, device: torch.device) -> StepSettings:
        return cls(kernels, choose_precision(precision, device))

    @contextlib.contextmanager
    def applied(self, device: torch.device) -> Iterator[None]:
        """Run a step's forward and backward under these settings."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(deterministic(device))
            stack.enter_context(fused_training(self.kernels == "fused"))
            if self.precision == "bf16":
                stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
            yield

    @property
    def name(self) -> str:
        return self.kernels if self.precision == "float32" else f"{self.kernels}-{self.precision}"


@contextlib.contextmanager
def deterministic(device: torch.device) -> Iterator[None]:
    """torch's deterministic algorithms (an operation without one warns and runs as it is), the
    earlier setting restored after; on CUDA, cuBLAS's fixed workspace that they need, unless the
    environment already sets one."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
