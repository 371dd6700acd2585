"""Training-only fused forms of the mHC sites, compiled with `torch.compile` on first use.

A V4.1 layer's two mHC sites are elementwise work over the [B, S, hc_mult, hidden] streams: the
mixes (an RMS norm over n·hidden, one small product, sigmoids, a softmax and 2·iters − 1
Sinkhorn normalisations), the collapse into the sublayer's input (with its RMSNorm) and the
expand (post · out + combᵀ · streams). Eagerly each is a dozen passes over the streams forward
and as many backward, about half of a `small` training step on a CPU. Here each site is two
compiled functions whose forward and backward inductor fuses into a few loops:

    mix_collapse(streams, pre_prev) -> pre, post, comb, RMSNorm(collapse(streams, pre_prev))
    expand(streams, out, post, comb) -> new streams

The norm before the mixes' product is folded: rms(x)⁻¹ · (x · fnᵀ), the same function as
fnᵀ applied to the normed x without materialising it. Values equal the eager forms up to float
rounding (tests/model/test_fused.py); the engine never uses them: they are active only inside
:func:`fused_training` and only where autograd records (`torch.is_grad_enabled()` and streams
that require grad), so every inference path keeps its batch-invariant eager form.

Where `torch.compile` cannot run (no C++ compiler, an unsupported platform) the first call logs
a warning and the layers keep their eager forms for the rest of the process.

The same switch turns on the sparse attention's dense scoring of small visible prefixes
(`replaykv.model.attention.joint_attention`), another training-only form.

Not for: the attention or expert code itself (their training-only forms live with them).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_state: dict[str, Any] = {"on": False, "broken": False, "compiled": {}}


@contextlib.contextmanager
def fused_training(enabled: bool = True) -> Iterator[None]:
    """Within this block, layers recording autograd use the compiled mHC forms."""
    before = _state["on"]
    _state["on"] = enabled
    try:
        yield
    finally:
        _state["on"] = before


def enabled() -> bool:
    """Whether the training-only forms are switched on (see :func:`fused_training`)."""
    return bool(_state["on"])


def active(streams: torch.Tensor) -> bool:
    """Whether a layer should take the fused forms for these streams."""
    return bool(_state["on"]) and not _state["broken"] and torch.is_grad_enabled() and streams.requires_grad


def _mix_collapse(
    streams: torch.Tensor,
    pre_prev: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_weight: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    out_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """HyperConnection.mixes(streams) and RMSNorm(hc_collapse(streams, pre_prev)) in one graph."""
    n = streams.shape[-2]
    flat = streams.flatten(-2)
    inv_rms = torch.rsqrt(flat.square().mean(dim=-1, keepdim=True) + norm_eps)
    scales = torch.cat([scale[0:1].expand(n), scale[1:2].expand(n), scale[2:3].expand(n * n)])
    z = F.linear(flat, fn) * inv_rms * scales + base
    pre_z, post_z, comb_z = z.split([n, n, n * n], dim=-1)
    pre = torch.sigmoid(pre_z) + hc_eps
    post = 2 * torch.sigmoid(post_z)
    comb = torch.softmax(comb_z.unflatten(-1, (n, n)), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    x = (pre_prev.unsqueeze(-1) * streams).sum(dim=-2)
    x = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + out_eps) * norm_weight
    return pre, post, comb, x


def _expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """new_k = post_k · out + Σ_j comb[j, k] · stream_j, written as a sum of n broadcasts."""
    n = streams.shape[-2]
    new = post.unsqueeze(-1) * out.unsqueeze(-2)
    for j in range(n):
        new = new + comb[..., j, :].unsqueeze(-1) * streams[..., j : j + 1, :]
    return new


def _attend_block(
    qb: torch.Tensor,
    kw: torch.Tensor,
    win_masked: torch.Tensor,
    sink: torch.Tensor,
    kc: torch.Tensor | None,
    entry_masked: torch.Tensor | None,
    scale: float,
    gathered: bool,
) -> torch.Tensor:
    """One block of `joint_attention`'s training form: queries qb [B, Q, H, D] against their
    2W - 1 window rows kw [B, Q+W-1, D] (win_masked [B|1, Q, Q+W-1]: True outside a query's
    window) and compressed entries kc, either shared by the block ([B, N, D]) or gathered per
    query ([B·Q, K, D], `gathered`), entry_masked [B, Q, N|K]; one softmax with the sink."""
    b, nq, h, d = qb.shape
    lw = torch.matmul(qb.reshape(b, nq * h, d), kw.transpose(1, 2)).float() * scale
    lw = lw.view(b, nq, h, -1).masked_fill(win_masked[:, :, None], float("-inf"))
    mx = torch.maximum(lw.amax(dim=-1), sink)
    lc = None
    if kc is not None and entry_masked is not None:
        if gathered:
            lc = torch.bmm(qb.reshape(b * nq, h, d), kc.transpose(1, 2))
        else:
            lc = torch.matmul(qb.reshape(b, nq * h, d), kc.transpose(1, 2))
        lc = (lc.view(b, nq, h, -1).float() * scale).masked_fill(entry_masked[:, :, None], float("-inf"))
        mx = torch.maximum(mx, lc.amax(dim=-1))
    pw = torch.exp(lw - mx[..., None])
    den = pw.sum(dim=-1) + torch.exp(sink - mx)
    o = torch.matmul(pw.to(qb.dtype).view(b, nq * h, -1), kw).view(b, nq, h, d)
    if lc is not None and kc is not None:
        pc = torch.exp(lc - mx[..., None])
        den = den + pc.sum(dim=-1)
        if gathered:
            o = o + torch.bmm(pc.to(qb.dtype).view(b * nq, h, -1), kc).view(b, nq, h, d)
        else:
            o = o + torch.matmul(pc.to(qb.dtype).view(b, nq * h, -1), kc).view(b, nq, h, d)
    return o / den[..., None].to(o.dtype)


_HALF = (torch.bfloat16, torch.float16)
RECOMPILE_LIMIT = 64
_EAGER: dict[str, Callable[..., Any]] = {
    "mix_collapse": _mix_collapse,
    "expand": _expand,
    "attend_block": _attend_block,
}


def _compiled(name: str) -> Callable[..., Any]:
    fns: dict[str, Callable[..., Any]] = _state["compiled"]
    if name not in fns:
        # Each layer kind (window only, shared or gathered entries) and each row shape of a
        # recipe that cycles lengths is a variant; past dynamo's default of 8 a function falls
        # back to eager for every new one.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        fns[name] = torch.compile(_EAGER[name], dynamic=None)
    return fns[name]


def _call(name: str, *args: Any, full_precision: bool = True) -> Any:
    try:
        if not full_precision:
            return _compiled(name)(*args)
        # The mixes and the residual streams stay float32 under autocast.
        args = tuple(a.float() if isinstance(a, torch.Tensor) and a.dtype in _HALF else a for a in args)
        with torch.autocast(args[0].device.type, enabled=False):
            return _compiled(name)(*args)
    except Exception as exc:  # a missing compiler surfaces here, at the first call
        if _state["broken"]:
            raise
        _state["broken"] = True
        log.warning(
            "torch.compile of the fused mHC forms failed (%s: %s); training continues eagerly",
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
        return _EAGER[name](*args)


def mix_collapse(
    hc: Any, norm: Any, streams: torch.Tensor, pre_prev: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre, post, comb) of site `hc` over `streams`, and `norm`(collapse(streams, pre_prev))."""
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] = _call(
        "mix_collapse", streams, pre_prev, hc.fn, hc.scale, hc.base, norm.weight,
        hc.iters, hc.hc_eps, hc.norm_eps, norm.eps,
    )  # fmt: skip
    return out


def expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """hc_expand's value, fused."""
    new: torch.Tensor = _call("expand", streams, out, post, comb)
    return new


def attend_block(
    qb: torch.Tensor,
    kw: torch.Tensor,
    win_masked: torch.Tensor,
    sink: torch.Tensor,
    kc: torch.Tensor | None,
    entry_masked: torch.Tensor | None,
    scale: float,
    gathered: bool,
) -> torch.Tensor:
    """A training block of joint attention, fused (products under the caller's autocast)."""
    # Contiguous inputs: slices of longer tensors keep their parents' strides, which compiled
    # graphs with dynamic shapes guard on.
    kc = None if kc is None else kc.contiguous()
    out: torch.Tensor = _call(
        "attend_block", qb.contiguous(), kw.contiguous(), win_masked.contiguous(), sink, kc,
        entry_masked, scale, gathered, full_precision=False,
    )  # fmt: skip
    return out
