"""Native CPU kernels of the model, compiled on first use by torch's C++ extension loader.

`index_topk` is DeepSeek-V4's lightning indexer (`attention.Indexer`): scoring, causal mask and
top-k of every query in one pass (`kernels/index_topk.cpp`): no [Q, H, N] products, no [Q, N]
score tensor, no separate top-k. It is built once per machine (under torch's extension cache,
`TORCH_EXTENSIONS_DIR`; under a minute with the system's C++ compiler) for the CPU it runs on,
and used for every CPU float32 call, so prefill, chunks and decode select with the same rounding.
Where it cannot be built (no compiler, no headers) the indexer keeps its torch path and the log
says why, once. `REPLAYKV_NATIVE=0` turns it off for a process; `disabled()` for a block of code
(benchmarks compare both paths in one process).

Not for: CUDA tensors (the torch path runs there); anything autograd must differentiate (the
kernel returns entry ids only); V4.1's indexers, whose two-level candidate selection reads every
query's full scores (they keep their torch path).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("kernels") / "index_topk.cpp"
_lock = threading.Lock()
_module: Any = None
_failed: str | None = None
_off = threading.local()


def _cpu_tag() -> str:
    """The CPU's feature flags, hashed: a build uses -march=native, so it belongs to its CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def _load() -> Any:
    global _module, _failed
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        try:
            from torch.utils import cpp_extension

            _module = cpp_extension.load(
                name=f"replaykv_index_topk_{_cpu_tag()}",
                sources=[str(_SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],  # at::parallel_for is OpenMP in headers
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as exc:  # no compiler, no headers, a failed build: keep the torch path
            lines = str(exc).strip().splitlines()
            _failed = next(
                (line.strip() for line in lines if "error:" in line), lines[-1] if lines else repr(exc)
            )
            log.warning("native index kernel unavailable (%s); the indexers use their torch path", _failed)
        return _module


def enabled() -> bool:
    """Whether CPU indexer calls of this thread go through the native kernel (it loads on the
    first call that asks)."""
    if getattr(_off, "depth", 0) or os.environ.get("REPLAYKV_NATIVE", "1") == "0":
        return False
    return _load() is not None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the block with the torch paths (this thread only)."""
    _off.depth = getattr(_off, "depth", 0) + 1
    try:
        yield
    finally:
        _off.depth -= 1


def usable(t: torch.Tensor) -> bool:
    """Whether `index_topk` runs for operands like `t` (CPU float32, not turned off, buildable)."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and enabled()


def index_topk(
    q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, lim: torch.Tensor, k: int, post_scale: float = 1.0
) -> torch.Tensor:
    """sum_h w_h · relu(q_h · k_j) · post_scale per query and visible entry j < lim, the best `k`
    ranked by score (descending) then index: q [B, Q, H, D], w [B, Q, H], keys [B, N, D] float32,
    lim [B, Q] -> [B, Q, k] long, -1 where fewer than k are visible. Only where `usable(q)`."""
    if not usable(q):
        raise RuntimeError(
            f"native index kernel not usable here: {_failed or 'turned off or not CPU float32'}"
        )
    fn: Callable[..., torch.Tensor] = _module.index_topk
    return fn(q.detach(), w.detach(), keys.detach(), lim.to(torch.long), k, post_scale)
