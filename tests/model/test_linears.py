"""`layers.linears`: projections of one input as one product over their stacked weights."""

from __future__ import annotations

import torch
from torch import nn

from replaykv.model.layers import linear, linears


def test_stacked_product_matches_separate_ones_and_follows_weight_changes() -> None:
    g = torch.Generator().manual_seed(0)
    owner = nn.Module()
    a, b = nn.Parameter(torch.randn(24, 32, generator=g)), nn.Parameter(torch.randn(8, 32, generator=g))
    x = torch.randn(3, 5, 32, generator=g)
    with torch.no_grad():
        ya, yb = linears(x, owner, a, b)
        assert ya.shape == (3, 5, 24) and yb.shape == (3, 5, 8)
        torch.testing.assert_close(ya, linear(x, a), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(yb, linear(x, b), rtol=1e-5, atol=1e-5)
        for t in (0, 4):  # one row alone (a decode step) equals its row among many
            one = linears(x[:, t : t + 1], owner, a, b)
            assert torch.equal(one[0], ya[:, t : t + 1]) and torch.equal(one[1], yb[:, t : t + 1])
        b.mul_(2)  # an optimizer step: the stack is rebuilt
        torch.testing.assert_close(linears(x, owner, a, b)[1], 2 * yb, rtol=1e-5, atol=1e-5)
        half = linears(x, owner, a.half(), b.half(), dtype=torch.float32)
        torch.testing.assert_close(half[0], linear(x, a.half().float()), rtol=1e-5, atol=1e-5)


def test_autograd_takes_one_product_per_weight() -> None:
    owner = nn.Module()
    a, b = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(2, 6))
    ya, yb = linears(torch.randn(2, 6), owner, a, b)
    (ya.sum() + 3 * yb.sum()).backward()
    assert (
        a.grad is not None
        and b.grad is not None
        and not any(k.startswith("_stacked") for k in owner.__dict__)
    )
