"""Native CPU kernels of the model, compiled on first use by torch's C++ extension loader.

`index_topk` is DeepSeek-V4's lightning indexer (`attention.Indexer`): scoring, causal mask and
top-k of every query in one pass (`kernels/index_topk.cpp`): no [Q, H, N] products, no [Q, N]
score tensor, no separate top-k. `hc_collapse` and `hc_expand` are the mHC sites' stream sums
(`kernels/mhc.cpp`), one pass over a token's streams instead of torch's products, batched [n, n] x
[n, D] matrix product and sums over [T, n, D] tensors. `hc_mixes` is an mHC site's mixes
(`kernels/mhc_mixes.cpp`: RMS norm, product, sigmoids, softmax and Sinkhorn) per token in one call
instead of a dozen operations and 2·iters − 1 normalisations. `rms_norm` and `rope`
(`kernels/rows.cpp`) are the RMS norm and the rotary embedding, one call each instead of several
kernels (decode steps make dozens of these calls). `linear` is every matrix product with a weight
(`kernels/linear.cpp`): each output one chain of multiply-adds in input order, so a decode row
equals its prefill row on any CPU without padding a row to the 16 that BLAS needs for that (a
sixteenth of the arithmetic). It reads each weight transposed, a second copy kept per module
(`layers.native_weight`): a CPU float32 model's weights take twice their memory. `joint_attention`
is the attention of every layer (`kernels/attention.cpp`): a query's softmax over its window keys,
compressed entries and sink in one pass, instead of an unfold copy, masks and a dozen products and
reductions per block of queries.

They are built once per machine (under torch's extension cache, `TORCH_EXTENSIONS_DIR`; under a
minute with the system's C++ compiler) for the CPU they run on, and used for every CPU float32
call under `torch.inference_mode` and for any whose operands do not require grad (`usable`), so
prefill, chunks and decode compute a row with the same rounding (which may differ from torch's by
an ulp or so). Where they cannot be built (no compiler, no headers) the model keeps its torch
paths and the log says why, once. `REPLAYKV_NATIVE=0` turns them off for a process; `disabled()`
for a block of code (benchmarks compare both paths in one process).

Not for: CUDA tensors (the torch paths run there); anything autograd differentiates (training
keeps the torch paths); V4.1's indexers, whose two-level candidate selection reads every query's
full scores (they keep their torch path)."""

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

_KERNELS = Path(__file__).with_name("kernels")
_SOURCES = (
    "module.cpp",
    "index_topk.cpp",
    "mhc.cpp",
    "mhc_mixes.cpp",
    "rows.cpp",
    "attention.cpp",
    "linear.cpp",
)
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
    if _module is not None or _failed is not None:  # the hot path: no lock once decided
        return _module
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        if os.environ.get("REPLAYKV_NATIVE", "1") == "0":  # read once, on the first call that asks
            _failed = "turned off by REPLAYKV_NATIVE=0"
            return None
        try:
            from torch.utils import cpp_extension

            log.info("loading the native CPU kernels (the first load on a machine compiles them)")
            _module = cpp_extension.load(
                name=f"replaykv_native_{_cpu_tag()}",
                sources=[str(_KERNELS / name) for name in _SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],  # at::parallel_for is OpenMP in headers
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as exc:  # no compiler, no headers, a failed build: keep the torch path
            lines = str(exc).strip().splitlines()
            _failed = next(
                (line.strip() for line in lines if "error:" in line), lines[-1] if lines else repr(exc)
            )
            log.warning("native kernels unavailable (%s); the model uses its torch paths", _failed)
        return _module


def enabled() -> bool:
    """Whether this thread's CPU calls go through the native kernels (they load on the first
    call that asks)."""
    if getattr(_off, "depth", 0):
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


def usable(*tensors: torch.Tensor) -> bool:
    """Whether a native kernel runs for these operands: CPU float32 tensors none of which
    requires grad (a training parameter), or any under `torch.inference_mode` (the engine's
    passes), kernels not turned off and buildable. Whether autograd is recording does not
    enter: a computation takes the same path, and so gets the same bits, under `no_grad` as with
    gradients (training's selections under `no_grad` match its differentiated passes)."""
    inference = torch.is_inference_mode_enabled()
    for t in tensors:  # the cheapest tests first, no generators: a decode step asks this often
        if t.dtype is not torch.float32 or not t.is_cpu or (t.requires_grad and not inference):
            return False
    return enabled()


def _unusable() -> RuntimeError:
    return RuntimeError(
        f"native kernels not usable here: {_failed or 'turned off, or not CPU float32 without autograd'}"
    )


def index_topk(
    q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, lim: torch.Tensor, k: int, post_scale: float = 1.0
) -> torch.Tensor:
    """sum_h w_h · relu(q_h · k_j) · post_scale per query and visible entry j < lim, the best `k`
    ranked by score (descending) then index: q [B, Q, H, D], w [B, Q, H], keys [B, N, D] float32,
    lim [B, Q] -> [B, Q, k] long, -1 where fewer than k are visible. Only where `usable(q)`."""
    if not usable(q, w, keys):
        raise _unusable()
    fn: Callable[..., torch.Tensor] = _module.index_topk
    return fn(q, w, keys, lim.to(torch.long), k, post_scale)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor | None:
    """sum_k pre[..., k] * streams[..., k, :]: [..., n, D] x [..., n] -> [..., D]; None where
    not `usable` (the caller keeps its torch path)."""
    if not usable(streams, pre):
        return None
    out: torch.Tensor = _module.hc_collapse(streams, pre)
    return out


def hc_expand(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor | None:
    """post[..., k] * out + sum_j comb[..., j, k] * streams[..., j, :] for every k:
    streams [..., n, D], out [..., D], post [..., n], comb [..., n, n] -> [..., n, D]; None
    where not `usable`."""
    if not usable(streams, out, post, comb):
        return None
    new: torch.Tensor = _module.hc_expand(streams, out, post, comb)
    return new


def hc_mixes(
    streams: torch.Tensor,
    fn_t: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """An mHC site's (pre, post, comb) from streams [..., n, D] with fn_t [n·D, (2+n)·n] (the
    site's `fn` transposed), scale and base [(2+n)·n]: pre [..., n], post [..., n], comb [..., n,
    n] (see `kernels/mhc_mixes.cpp` for the formula); None where not `usable`."""
    if not usable(streams, fn_t, scale, base):
        return None
    mixes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = _module.hc_mixes(
        streams, fn_t, scale, base, norm_eps, hc_eps, iters
    )
    return mixes


_EMPTY = torch.empty(0)
_EMPTY_BOOL = torch.empty(0, dtype=torch.bool)
_EMPTY_LONG = torch.empty(0, dtype=torch.long)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor | None:
    """x / sqrt(mean(x²) + eps) over the last axis, times `weight` [D] when given; None where
    not `usable`."""
    if not usable(x, x if weight is None else weight):
        return None
    out: torch.Tensor = _module.rms_norm(x, _EMPTY if weight is None else weight, eps)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor | None:
    """`rope.apply_rope` where the tables are per row of x ([..., r] for x [..., D]) or per row
    with a head axis of one ([..., 1, r] for x [..., H, D]); None for any other broadcast and
    where not `usable` (the caller keeps its torch path)."""
    if sin.shape != cos.shape or not usable(x, cos, sin):
        return None
    if cos.shape[:-1] == x.shape[:-1]:
        heads = 1
    elif cos.dim() == x.dim() and cos.shape[-2] == 1 and cos.shape[:-2] == x.shape[:-2]:
        heads = x.shape[-2]
    else:
        return None
    out: torch.Tensor = _module.rope(x, cos, sin, heads, inverse)
    return out


def joint_attention(
    q: torch.Tensor,
    win_keys: torch.Tensor,
    key_ok: torch.Tensor | None,
    sinks: torch.Tensor,
    entries: torch.Tensor | None,
    limit: torch.Tensor | None,
    selection: torch.Tensor | None,
    window: int,
    scale: float,
    ring_first: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """`attention.joint_attention` for inference, one pass per query (`kernels/attention.cpp`):
    q [B, S, H, D], win_keys [B, W-1+S, D] (or with `ring_first` [B] a ring [B, R, D] whose slot
    (ring_first + j) % R holds window row j), key_ok [B, W-1+S] bool (None: all readable), sinks
    [H], entries [B, N, D] with `limit` [B, S] (dense: entries visible per query) or `selection`
    [B, S, k] (sparse, -1 none) -> [B, S, H, D]; None where not `usable`."""
    if not usable(q, win_keys, sinks) or (entries is not None and not usable(entries)):
        return None
    out: torch.Tensor = _module.joint_attention(
        q,
        win_keys,
        _EMPTY_LONG if ring_first is None else ring_first.to(torch.long),
        _EMPTY_BOOL if key_ok is None else key_ok,
        sinks,
        _EMPTY if entries is None else entries,
        _EMPTY_LONG if entries is None or selection is not None or limit is None else limit.to(torch.long),
        _EMPTY_LONG if entries is None or selection is None else selection.to(torch.long),
        window,
        scale,
    )
    return out


def linear_weight(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (or [G, N, K]) as `linear` reads it: transposed, N padded with zeros to a
    multiple of 16 ([K, Np] or [G, K, Np]). For a weight used more than once, keep it
    (`layers.native_weight`). Only where `usable(w)`."""
    with torch.no_grad():
        wt: torch.Tensor = _module.linear_weight(w.detach())
    return wt


def linear(x: torch.Tensor, weight: torch.Tensor, wt: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] @ weight [N, K].T (or x [..., G, K] with weight [G, N, K], each group its own
    product) with every output one chain of multiply-adds in input order (`kernels/linear.cpp`),
    so a row's values do not depend on the rows it comes with; `wt`: `linear_weight(weight)`
    when the caller keeps it (`layers.native_weight`, which has checked the weight). None where
    not `usable`."""
    if not (usable(x) if wt is not None else usable(x, weight)):
        return None
    out: torch.Tensor = _module.linear(x, linear_weight(weight) if wt is None else wt, weight.shape[-2])
    return out
