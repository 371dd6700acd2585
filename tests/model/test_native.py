"""The native index kernel (replaykv.model.native) against a reference written here from its
contract: scores sum_h w_h · relu(q_h · k_j) · post_scale for the entries j < lim, the best k by
score then index (NaN above every number), -1 past the visible ones; and its fallback."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from replaykv.model import native
from replaykv.model.attention import Indexer, sliced_scores
from replaykv.model.compressor import topk_lowest_index
from replaykv.model.layers import HyperConnection
from replaykv.model.presets import v4_tiny

pytestmark = pytest.mark.skipif(not native.enabled(), reason="native kernel not buildable here")


def reference(
    q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, lim: torch.Tensor, k: int, scale: float
) -> torch.Tensor:
    """Plain loops and Python's sort: no torch top-k, no BLAS ordering assumptions."""
    b, nq, h, _ = q.shape
    out = torch.full((b, nq, k), -1, dtype=torch.long)
    for r in range(b):
        for i in range(nq):
            visible = max(0, min(int(lim[r, i]), keys.shape[1]))
            ranked = []
            for j in range(visible):
                s = 0.0
                for hh in range(h):
                    dot = float((q[r, i, hh].double() * keys[r, j].double()).sum())
                    s += float(w[r, i, hh]) * (max(dot, 0.0) if not math.isnan(dot) else dot) * scale
                ranked.append((0 if math.isnan(s) else 1, 0.0 if math.isnan(s) else -s, j))
            best = [j for *_, j in sorted(ranked)[:k]]
            out[r, i, : len(best)] = torch.tensor(best, dtype=torch.long)
    return out


def integer_case(seed: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Small integers and power-of-two weights: every score is exact in float32 whatever the
    order of the sums, and ties (zeros above all) are frequent."""
    g = torch.Generator().manual_seed(seed)
    b, nq, h = int(torch.randint(1, 3, (), generator=g)), int(torch.randint(1, 40, (), generator=g)), 4
    n = int(torch.randint(1, 200, (), generator=g))
    q = torch.randint(-3, 4, (b, nq, h, d), generator=g).float()
    keys = torch.randint(-2, 3, (b, n, d), generator=g).float()
    sign = torch.where(torch.rand(b, nq, h, generator=g) < 0.5, -1.0, 1.0)
    w = 2.0 ** torch.randint(-2, 3, (b, nq, h), generator=g).float() * sign
    lim = torch.randint(-2, n + 5, (b, nq), generator=g)
    return q, w, keys, lim


@pytest.mark.parametrize("seed", range(12))
def test_kernel_selects_what_the_reference_selects(seed: int) -> None:
    q, w, keys, lim = integer_case(seed, d=(16, 32, 48)[seed % 3])
    k = (1, 7, 64, 300)[seed % 4]  # 300: more than any row sees
    scale = (1.0, 0.5)[seed % 2]
    got = native.index_topk(q, w, keys, lim, k, scale)
    assert torch.equal(got, reference(q, w, keys, lim, k, scale))


def test_nan_ranks_first_and_ties_go_to_the_lower_index() -> None:
    q = torch.ones(1, 1, 1, 16)
    keys = torch.ones(1, 10, 16)
    keys[0, 6, 0] = float("nan")
    keys[0, 3, 0] = float("nan")
    keys[0, 8] = 2.0  # the best number
    w = torch.ones(1, 1, 1)
    got = native.index_topk(q, w, keys, torch.tensor([[10]]), 5)
    assert got.tolist() == [[[3, 6, 8, 0, 1]]]


def test_a_query_selects_the_same_in_any_call() -> None:
    """Prefill, chunks and decode call the kernel with different sets of queries: a query's
    selection, on random (inexact) floats, does not depend on which others came with it."""
    g = torch.Generator().manual_seed(5)
    q, w = torch.randn(2, 100, 4, 32, generator=g), torch.randn(2, 100, 4, generator=g)
    keys = torch.randn(2, 1000, 32, generator=g)
    lim = torch.randint(0, 1001, (2, 100), generator=g)
    whole = native.index_topk(q, w, keys, lim, 64)
    for lo, hi in ((0, 1), (37, 38), (3, 70), (99, 100)):
        part = native.index_topk(
            q[:, lo:hi], w[:, lo:hi], keys[:, : int(lim[:, lo:hi].max())], lim[:, lo:hi], 64
        )
        assert torch.equal(part, whole[:, lo:hi])


def test_the_kernel_and_the_torch_path_select_alike_on_floats() -> None:
    """On random floats the two paths' dot products may round an ulp apart, so they agree on
    every pick but near-ties: V4's indexer scoring (sliced scores, the causal mask, top-k with
    ties to the lower index) against the kernel."""
    g = torch.Generator().manual_seed(9)
    ix = Indexer(v4_tiny(), ratio=4)
    q, w = torch.randn(1, 64, 4, 32, generator=g), torch.randn(1, 64, 4, generator=g)
    keys = torch.randn(1, 3000, 32, generator=g)
    lim = torch.randint(1, 3001, (1, 64), generator=g)
    scores = sliced_scores(ix._scores, q, w, keys).masked_fill_(
        torch.arange(3000) >= lim[..., None], float("-inf")
    )
    slow = topk_lowest_index(scores, 64)
    slow = slow.masked_fill(slow >= lim[..., None], -1)
    fast = native.index_topk(q, w, keys, lim, 64)
    assert (fast == slow).float().mean().item() > 0.999


def test_switches_turn_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.zeros(1)
    assert native.usable(t)
    with native.disabled():
        assert not native.usable(t)
        with pytest.raises(RuntimeError, match="not usable"):
            native.index_topk(
                torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 1), torch.zeros(1, 1, 16), torch.ones(1, 1), 1
            )
    assert native.usable(t) and not native.usable(t.double())
    monkeypatch.setenv("REPLAYKV_NATIVE", "0")  # read when a process first asks: ask afresh
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_failed", None)
    assert not native.usable(t)
    with pytest.raises(RuntimeError, match="REPLAYKV_NATIVE=0"):
        native.index_topk(
            torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 1), torch.zeros(1, 1, 16), torch.ones(1, 1), 1
        )


def test_a_failed_build_falls_back_and_says_why(tmp_path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    for name in native._SOURCES:
        (kernels / name).write_text("this is not C++\n")
    monkeypatch.setattr(native, "_KERNELS", kernels)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_failed", None)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "build"))
    with caplog.at_level(logging.WARNING, logger="replaykv.model.native"):
        assert not native.usable(torch.zeros(1))
    assert "native kernels unavailable" in caplog.text and "error" in caplog.text


def mhc_case(seed: int, tokens: int = 50, n: int = 4, d: int = 40) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    streams, out = torch.randn(2, tokens, n, d, generator=g), torch.randn(2, tokens, d, generator=g)
    pre, post = torch.rand(2, tokens, n, generator=g), 2 * torch.rand(2, tokens, n, generator=g)
    comb = torch.softmax(torch.randn(2, tokens, n, n, generator=g), dim=-1)
    return streams, out, pre, post, comb


def test_mhc_collapse_and_expand_compute_their_formulas() -> None:
    streams, out, pre, post, comb = mhc_case(1)
    s64 = streams.double()
    want_x = (pre.double()[..., None] * s64).sum(dim=2)
    want_y = post.double()[..., None] * out.double()[..., None, :] + torch.einsum(
        "btjk,btjd->btkd", comb.double(), s64
    )
    torch.testing.assert_close(native.hc_collapse(streams, pre).double(), want_x, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        native.hc_expand(streams, out, post, comb).double(), want_y, rtol=1e-6, atol=1e-6
    )


def test_mhc_rows_do_not_depend_on_the_call() -> None:
    """A decode row is computed in a call of one token, its prefill row in a call of many."""
    streams, out, pre, post, comb = mhc_case(2, tokens=300, d=128)
    x, y = native.hc_collapse(streams, pre), native.hc_expand(streams, out, post, comb)
    for t in (0, 1, 150, 299):
        sl = slice(t, t + 1)
        assert torch.equal(native.hc_collapse(streams[:, sl], pre[:, sl]), x[:, sl])
        assert torch.equal(native.hc_expand(streams[:, sl], out[:, sl], post[:, sl], comb[:, sl]), y[:, sl])


def test_mhc_sites_keep_the_torch_path_where_autograd_records() -> None:
    from replaykv.model.layers import hc_collapse, hc_expand

    streams, out, pre, post, comb = mhc_case(3)
    streams.requires_grad_(True)
    assert not native.usable(streams, pre)
    (hc_expand(streams, out, post, comb).sum() + hc_collapse(streams, pre).sum()).backward()
    assert streams.grad is not None
    with torch.no_grad():  # the same path as with gradients: no_grad does not change the bits
        assert not native.usable(streams, pre)
        assert native.usable(streams.detach(), pre)
    with torch.inference_mode():  # the engine's passes: parameters require grad, nothing records
        assert native.usable(streams, pre)


def mixes_site(seed: int, n: int = 4, d: int = 40, iters: int = 20) -> tuple[HyperConnection, torch.Tensor]:
    """An mHC site with drawn weights (softmax inputs of a few units, so Sinkhorn has work) and
    streams [2, 70, n, d] (70 tokens: four blocks of 16 and a ragged fifth)."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(seed)
    cfg = SimpleNamespace(hc_mult=n, hc_sinkhorn_iters=iters, hc_eps=1e-6, rms_norm_eps=1e-6, hidden_size=d)
    site = HyperConnection(cfg)
    with torch.no_grad():
        site.fn.copy_(torch.randn(site.fn.shape, generator=g) * 0.1)
        site.base.copy_(torch.randn(site.base.shape, generator=g))
        site.scale.copy_(torch.rand(3, generator=g) + 0.5)
    return site, torch.randn(2, 70, n, d, generator=g) * 3


def mixes_reference(site: HyperConnection, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The mixes from the formula, in float64 (HyperConnection's docstring and mhc_mixes.cpp)."""
    n, eps = site.hc_mult, site.hc_eps
    x = streams.double().flatten(2)
    x = x / (x.pow(2).mean(-1, keepdim=True) + site.norm_eps).sqrt()
    scales = torch.cat(
        [site.scale[0].expand(n), site.scale[1].expand(n), site.scale[2].expand(n * n)]
    ).double()
    z = x @ site.fn.double().T * scales + site.base.double()
    pre = torch.sigmoid(z[..., :n]) + eps
    post = 2 * torch.sigmoid(z[..., n : 2 * n])
    c = torch.softmax(z[..., 2 * n :].unflatten(-1, (n, n)), dim=-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(site.iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return pre, post, c


@pytest.mark.parametrize(("n", "d", "iters"), [(4, 40, 20), (4, 128, 20), (2, 24, 3), (3, 8, 1)])
def test_mhc_mixes_compute_their_formula(n: int, d: int, iters: int) -> None:
    """n = 4 fills the kernel's register chunks of eight outputs exactly; n = 2 and 3 leave a
    remainder ((2 + n) · n = 8 and 15 outputs)."""
    site, streams = mixes_site(4, n, d, iters)
    with torch.inference_mode():
        assert native.usable(streams, site.fn)
        got = site.mixes(streams)
        want = mixes_reference(site, streams)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


def test_mhc_mixes_rows_do_not_depend_on_the_call() -> None:
    """A token's mixes are the same alone, at any place in a block of 16 and in a long call."""
    site, streams = mixes_site(5)
    with torch.inference_mode():
        whole = site.mixes(streams)
        for t in (0, 1, 15, 16, 37, 69):
            alone = site.mixes(streams[:, t : t + 1])
            for a, w in zip(alone, whole, strict=True):
                assert torch.equal(a, w[:, t : t + 1])
        shifted = site.mixes(streams[:, 3:])  # every token in another lane of its block
        for a, w in zip(shifted, whole, strict=True):
            assert torch.equal(a, w[:, 3:])


def test_mhc_mixes_keep_the_torch_path_where_autograd_records() -> None:
    site, streams = mixes_site(6)
    pre, post, comb = site.mixes(streams)  # grad enabled, fn requires grad: the torch path
    (pre.sum() + post.sum() + comb.pow(2).sum()).backward()
    assert site.fn.grad is not None and site.fn.grad.abs().sum() > 0
    with torch.inference_mode():  # the native mixes against the torch path's
        torch.testing.assert_close(site.mixes(streams)[2], comb.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("d", [64, 128, 40, 7])
def test_rms_norm_computes_its_formula_and_rows_do_not_depend_on_the_call(d: int) -> None:
    """d = 40 and 7 leave a tail after the runs of 16 the sum of squares takes."""
    g = torch.Generator().manual_seed(d)
    x, w = torch.randn(3, 33, d, generator=g) * 5, torch.rand(d, generator=g) + 0.5
    for weight in (w, None):
        got = native.rms_norm(x, weight, 1e-6)
        x64 = x.double()
        want = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * (1 if weight is None else w.double())
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
        for r in (0, 17, 32):
            assert torch.equal(native.rms_norm(x[:, r : r + 1], weight, 1e-6), got[:, r : r + 1])


def test_rope_computes_the_torch_rotation_per_row_and_per_head() -> None:
    from replaykv.model.rope import apply_rope, rope_table

    g = torch.Generator().manual_seed(8)
    cos, sin = rope_table(torch.rand(8, generator=g), torch.arange(40).view(2, 20) * 7)  # [2, 20, 16]
    x_heads, x_rows = torch.randn(2, 20, 4, 64, generator=g), torch.randn(2, 20, 64, generator=g)
    for x, c, s in ((x_heads, cos[:, :, None], sin[:, :, None]), (x_rows, cos, sin)):
        for inverse in (False, True):
            got = native.rope(x, c, s, inverse)
            assert got is not None
            with native.disabled():
                want = apply_rope(x, c, s, inverse)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            assert torch.equal(got[..., :48], x[..., :48])  # leading channels pass through
            alone = native.rope(x[:, 5:6], c[:, 5:6], s[:, 5:6], inverse)
            assert alone is not None and torch.equal(alone, got[:, 5:6])
            assert torch.equal(apply_rope(x, c, s, inverse), got)  # the model's path takes it
    # tables broadcast over the batch: not a per-row table, so the torch path answers
    assert native.rope(x_rows, cos[:1], sin[:1]) is None
    wide = apply_rope(x_rows, cos[:1].expand(2, -1, -1), sin[:1].expand(2, -1, -1))  # native
    torch.testing.assert_close(apply_rope(x_rows, cos[:1], sin[:1]), wide, rtol=1e-6, atol=1e-6)


def test_mismatched_operands_get_a_clear_error() -> None:
    streams, out, pre, post, comb = mhc_case(9)
    with pytest.raises(RuntimeError, match=r"hc_collapse pre: shape .* does not match"):
        native.hc_collapse(streams, pre[:, :-1])
    with pytest.raises(RuntimeError, match=r"hc_expand comb: shape .* does not match"):
        native.hc_expand(streams, out, post, comb[..., :-1])
    with pytest.raises(RuntimeError, match="rope: tables do not match"):
        native.rope(torch.zeros(2, 3, 8), torch.zeros(2, 3, 10), torch.zeros(2, 3, 10))
