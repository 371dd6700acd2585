"""Building blocks shared by the DeepSeek-V4 family: products, norms and mHC hyper-connections.

Parameter names follow transformers' `deepseek_v4` modules so state dicts load directly.
Not for: attention or caches (see :mod:`replaykv.model.attention`), the MoE (:mod:`replaykv.model.moe`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from replaykv.model import native
from replaykv.model.config import DeepseekV4Config

# BLAS computes fewer than this many rows with other kernels than many rows, which round
# differently; padding small inputs to this many rows makes a row's value independent of the
# rows it came with (decode steps, small chunks, an expert that got few tokens).
MIN_GEMM_ROWS = 16


# CPU kernels run an elementwise function in vector code over runs of 32 floats (two AVX-512
# or four AVX2 registers) and in scalar code over what is left at the end of a contiguous
# tensor, and the two round transcendental functions differently: a row whose width is not a
# multiple of 32 would get other bits alone (a decode step) than among other rows.
VECTOR_RUN = 32


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, each row (last axis) computed the same whatever rows come
    with it: rows of a width that is not a multiple of `VECTOR_RUN` are padded (with zeros) to
    one, so every element runs in the vector code."""
    pad = -x.shape[-1] % VECTOR_RUN
    if pad == 0:
        return fn(x.contiguous())
    return fn(F.pad(x, (0, pad)))[..., : x.shape[-1]]


def pad_rows(x: torch.Tensor, rows: int = MIN_GEMM_ROWS) -> tuple[torch.Tensor, int]:
    """x [M, K] padded (by repeating its first row) to at least `rows` rows; returns (x, M)."""
    m = x.shape[0]
    if m >= rows or m == 0:
        return x, m
    return torch.cat([x, x[:1].expand(rows - m, -1)]), m


def linear(x: torch.Tensor, weight: torch.Tensor, wt: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T whose value for a row does not depend on how many rows come with it: natively
    where `native.usable` (`wt`: the weight as the kernel reads it, `native_weight`), else BLAS
    with fewer than `MIN_GEMM_ROWS` rows padded to that many."""
    out = native.linear(x, weight, wt)
    if out is not None:
        return out
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if rows >= MIN_GEMM_ROWS or rows == 0:
        return F.linear(x, weight)
    if rows == 1:  # decode: one op to widen, one to narrow
        return F.linear(x.reshape(1, k).expand(MIN_GEMM_ROWS, k), weight)[:1].view(*x.shape[:-1], -1)
    padded, m = pad_rows(x.reshape(rows, k))
    return F.linear(padded, weight)[:m].view(*x.shape[:-1], -1)


def linears(
    x: torch.Tensor, owner: nn.Module, *weights: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, ...]:
    """`linear(x, w)` for each of `weights` (cast to `dtype` when given): where autograd does not
    record, one product over the weights stacked (the stack is kept on `owner` until a weight
    changes), split by output; otherwise one product each. Every path, prefill and decode,
    takes the same product for the same weights, so a row does not depend on the call."""
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return tuple(linear(x, w if dtype is None else cast(w, dtype)) for w in weights)
    stacked = derived(
        owner,
        f"_stacked_{dtype}",
        lambda: torch.cat([w.detach() if dtype is None else cast(w.detach(), dtype) for w in weights]),
        *weights,
    )
    wt = native_weight(owner, stacked, f"_stacked_native_{dtype}")
    return tuple(linear(x, stacked, wt).split([w.shape[0] for w in weights], dim=-1))


def native_weight(
    owner: nn.Module, weight: torch.Tensor, name: str = "_native_weight"
) -> torch.Tensor | None:
    """`native.linear_weight(weight)`, kept on `owner` until the weight changes; None where the
    native product does not run for it (autograd records it, not CPU float32, kernels off)."""
    if not native.usable(weight):
        return None
    return derived(owner, name, lambda: native.linear_weight(weight), weight)


def derived(
    owner: nn.Module, name: str, build: Callable[[], torch.Tensor], *sources: torch.Tensor
) -> torch.Tensor:
    """`build()`, kept on `owner` under `name` until one of `sources` changes (its version
    counter, storage or device: an optimizer step, a load, a move). Built without autograd and
    outside inference mode, so a later autograd pass may save it."""
    key = tuple((t._version, t.data_ptr(), t.device) for t in sources)
    cached = owner.__dict__.get(name)
    if cached is None or cached[0] != key:
        with torch.inference_mode(False), torch.no_grad():
            cached = owner.__dict__[name] = (key, build())
    return cached[1]


class Linear(nn.Linear):
    """A bias-free nn.Linear computed with :func:`linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, native_weight(self, self.weight))


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 with a float32 weight; casts back to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = native.rms_norm(x, self.weight, self.eps)
        if out is not None:
            return out
        return cast(F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps), x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, computed in float32, cast back to x's dtype (natively in one
    call where `native.usable`)."""
    out = native.rms_norm(x, None, eps)
    if out is not None:
        return out
    return cast(F.rms_norm(x.float(), (x.shape[-1],), None, eps), x.dtype)


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype, without a dispatch when it already is."""
    return t if t.dtype == dtype else t.to(dtype)


class HyperConnection(nn.Module):
    """One mHC site: from the hc_mult residual streams, compute (pre, post, comb) mixes.

    `fn` [(2+n)·n, n·hidden], `base` [(2+n)·n], `scale` [3]; comb is projected onto doubly
    stochastic matrices by Sinkhorn-Knopp (one column pass, then iters-1 row/column passes).
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        n = config.hc_mult
        self.hc_mult = n
        self.iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * config.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def _scales(self) -> torch.Tensor:
        """One scale per output: (pre ×n, post ×n, comb ×n²), applied with the bias as one
        elementwise pass. Without autograd it is kept until `scale` changes (version counter)."""
        n, scale = self.hc_mult, self.scale
        if torch.is_grad_enabled() and scale.requires_grad:
            return scale.repeat_interleave(torch.tensor([n, n, n * n], device=scale.device))
        return derived(
            self,
            "_scales_cached",
            lambda: scale.repeat_interleave(torch.tensor([n, n, n * n], device=scale.device)),
            scale,
        )

    def _fn_t(self) -> torch.Tensor:
        """`fn` transposed and contiguous, for the native mixes; kept until `fn` changes."""
        fn = self.fn
        return derived(self, "_fn_t_cached", lambda: fn.detach().t().contiguous(), fn)

    def mixes(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B, S, n, D] -> pre [B, S, n], post [B, S, n], comb [B, S, n, n] (float32);
        in one native call per site where `native.usable` (inference on CPU float32)."""
        n = self.hc_mult
        if native.usable(streams, self.fn, self.scale, self.base):  # before building `_fn_t`
            mixed = native.hc_mixes(
                streams, self._fn_t(), self._scales(), self.base, self.norm_eps, self.hc_eps, self.iters
            )
            if mixed is not None:
                return mixed
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        scales = self._scales()
        z = linear(flat, self.fn) * scales + self.base
        pre_z, post_z, comb_z = z.split([n, n, n * n], dim=-1)
        pre = torch.sigmoid(pre_z) + self.hc_eps
        post = 2 * torch.sigmoid(post_z)
        comb = torch.softmax(comb_z.unflatten(-1, (n, n)), dim=-1) + self.hc_eps
        return pre, post, sinkhorn(comb, self.iters, self.hc_eps)


# Below this many elements a CPU Sinkhorn runs in NumPy: the same float32 operations, with a
# fraction of torch's per-operation cost (decode steps are dominated by it).
_SMALL_SINKHORN = 4096


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Normalise columns once, then rows and columns iters-1 times, each sum + eps. [..., n, n]."""
    if comb.device.type == "cpu" and comb.numel() <= _SMALL_SINKHORN and not comb.requires_grad:
        c = (comb.detach() if comb.requires_grad else comb).numpy().copy()
        e = np.float32(eps)
        col = np.empty((*c.shape[:-2], 1, c.shape[-1]), dtype=c.dtype)
        row = np.empty((*c.shape[:-1], 1), dtype=c.dtype)
        np.add.reduce(c, axis=-2, keepdims=True, out=col)
        col += e
        c /= col
        for _ in range(iters - 1):
            np.add.reduce(c, axis=-1, keepdims=True, out=row)
            row += e
            c /= row
            np.add.reduce(c, axis=-2, keepdims=True, out=col)
            col += e
            c /= col
        return torch.from_numpy(c)
    if comb.requires_grad:
        out: torch.Tensor = _Sinkhorn.apply(comb, iters, eps)
        return out
    mixed = _sinkhorn_matrix_first(comb.movedim((-2, -1), (0, 1)).contiguous(), iters, eps)[0]
    # Back to [..., n, n] in memory too: a strided view (each matrix's elements numel/n² apart)
    # sends the batched matmul of `hc_expand` and its backward down a per-matrix loop.
    return mixed.movedim((0, 1), (-2, -1)).contiguous()


def _sinkhorn_dims(iters: int) -> list[int]:
    """The dimension each normalisation sums over, matrix-first layout [n, n, ...]: 0 (columns),
    then 1 (rows) and 0 per further iteration."""
    return [0] + [1, 0] * (iters - 1)


def _sinkhorn_matrix_first(
    c: torch.Tensor, iters: int, eps: float, keep: bool = False
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Sinkhorn on [n, n, ...] (the matrix dimensions first, so that every sum adds n contiguous
    vectors instead of reducing n strided elements: several times faster on [..., 4, 4] and the
    same float32 additions in the same order). Returns the result and, with `keep`, each
    normalisation's output and denominator (for the backward)."""
    outs, dens = [], []
    for dim in _sinkhorn_dims(iters):
        d = c.sum(dim=dim, keepdim=True) + eps
        c = c / d
        if keep:
            outs.append(c)
            dens.append(d)
    return c, outs, dens


class _Sinkhorn(torch.autograd.Function):
    """Sinkhorn with a hand-written backward: the forward is :func:`sinkhorn`'s own operations
    (same values); the backward walks the normalisations in reverse, three operations each.

    For y = x / d with d = sum(x) + eps along one dimension, dL/dx = (g - sum(g * y)) / d.
    Autograd through the 2·iters - 1 unrolled divisions takes several times as many operations.
    """

    @staticmethod
    def forward(ctx: Any, comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        c, outs, dens = _sinkhorn_matrix_first(
            comb.movedim((-2, -1), (0, 1)).contiguous(), iters, eps, keep=True
        )
        ctx.save_for_backward(*outs, *dens)
        ctx.iters = iters
        return c.movedim((0, 1), (-2, -1)).contiguous()  # see `sinkhorn`

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        saved = ctx.saved_tensors
        n = len(saved) // 2
        g = grad.movedim((-2, -1), (0, 1)).contiguous()
        steps = zip(
            reversed(saved[:n]), reversed(saved[n:]), reversed(_sinkhorn_dims(ctx.iters)), strict=True
        )
        for y, d, dim in steps:
            g = (g - (g * y).sum(dim=dim, keepdim=True)) / d
        return g.movedim((0, 1), (-2, -1)), None, None


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Weighted sum of the streams: [B, S, n, D] x [B, S, n] -> [B, S, D] (natively in one pass
    where `native.usable`)."""
    out = native.hc_collapse(streams, pre)
    if out is not None:
        return out
    return cast((pre.unsqueeze(-1) * streams).sum(dim=2), streams.dtype)


def hc_expand(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """new_k = post_k * out + sum_j comb[j, k] * stream_j  -> [B, S, n, D] (natively in one pass
    where `native.usable`)."""
    new = native.hc_expand(streams, out, post, comb)
    if new is not None:
        return new
    dtype = streams.dtype
    return cast(post, dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        cast(comb, dtype).transpose(-1, -2), streams
    )


class HyperHead(nn.Module):
    """Final stream collapse of DeepSeek-V4 (`hc_head`): sigmoid mixes, no Sinkhorn."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        n = config.hc_mult
        self.eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * config.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        pre = rowwise(
            torch.sigmoid,
            linear(flat, fn := self.hc_fn.float(), native_weight(self, fn)) * self.hc_scale.float()
            + self.hc_base.float(),
        )
        return hc_collapse(streams, pre + self.eps)
