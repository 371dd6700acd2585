"""The native product (replaykv.model.native.linear, `kernels/linear.cpp`): x @ w.T against a
float64 reference, every output one chain of multiply-adds in input order (so a row alone
gets the same bits as among any rows, on any CPU), the grouped form, the weight's kept form
following its changes, and the torch path where the kernel does not run."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from torch import nn

from replaykv.model import native
from replaykv.model.layers import Linear, linear, native_weight

pytestmark = pytest.mark.skipif(not native.enabled(), reason="native kernel not buildable here")


def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kernel's contract, one output at a time: y = fma(x_k, w_k, y) for k in order, in
    float32 (torch's addcmul on one element rounds the product and the sum once each, as fma)."""
    y = torch.zeros(x.shape[0], w.shape[0])
    for k in range(x.shape[1]):
        y = torch.addcmul(y, x[:, k : k + 1], w[:, k][None])
    return y


@pytest.mark.parametrize(("m", "k", "n"), [(1, 32, 16), (37, 64, 50), (5, 300, 70), (70, 16, 3)])
def test_product_is_the_dot_of_each_row_and_weight_row(m: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(m + k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    got = native.linear(x, w)
    assert got is not None and got.shape == (m, n)
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)


def test_rows_and_outputs_get_the_same_bits_in_any_call() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = (
        torch.randn(2, 45, 280, generator=g),
        torch.randn(83, 280, generator=g),
    )  # past a 256 chunk, 83 = 5·16 + 3
    whole = native.linear(x, w)
    assert whole is not None
    for i in (0, 3, 44):  # one row, as a decode step
        one = native.linear(x[1, i : i + 1], w)
        assert one is not None and torch.equal(one, whole[1, i : i + 1])
    part = native.linear(x[0, 5:11], w[10:17])  # other tiles of rows and outputs
    assert part is not None and torch.equal(part, whole[0, 5:11, 10:17])


def test_each_output_is_one_chain_of_multiply_adds_in_input_order() -> None:
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(6, 40, generator=g), torch.randn(20, 40, generator=g)
    got = native.linear(x, w)
    assert got is not None
    if _has_fma():  # the build fuses each multiply-add (-march=native): bit for bit
        assert torch.equal(got, chain(x, w))
    else:
        torch.testing.assert_close(got, chain(x, w), rtol=2e-6, atol=2e-6)


def _has_fma() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "fma" in flags or platform.machine() in ("aarch64", "arm64")


def test_grouped_form_is_one_product_per_group() -> None:
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, 4, 24, generator=g), torch.randn(4, 10, 24, generator=g)
    got = native.linear(x, w)
    assert got is not None and got.shape == (9, 4, 10)
    for grp in range(4):
        alone = native.linear(x[:, grp], w[grp])
        assert alone is not None and torch.equal(got[:, grp], alone)


def test_kept_weight_follows_changes_and_training_keeps_torch() -> None:
    layer = Linear(32, 20)
    nn.init.normal_(layer.weight)
    x = torch.randn(3, 32)
    with torch.inference_mode():  # the engine's passes
        first = layer(x)
        kept = native_weight(layer, layer.weight)
        assert kept is not None and kept is native_weight(layer, layer.weight)  # built once
    with torch.no_grad():
        layer.weight.mul_(2)  # an optimizer step
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), 2 * first, rtol=1e-6, atol=1e-6)
        assert native_weight(layer, layer.weight) is not kept
    # A training parameter takes torch's product with or without gradients, so a selection
    # computed under no_grad gets the bits of the differentiated pass.
    assert native_weight(layer, layer.weight) is None
    with torch.no_grad():
        assert native_weight(layer, layer.weight) is None
        assert torch.equal(layer(x), linear(x, layer.weight.detach().clone().requires_grad_(True)))
    y = linear(x, layer.weight)
    assert y.requires_grad


def test_bad_shapes_get_a_clear_error() -> None:
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="does not fit"):
        native.linear(torch.randn(2, 15), w)
    with pytest.raises(RuntimeError, match="does not fit"):
        native.linear(torch.randn(2, 3, 16), torch.randn(2, 8, 16))  # 3 groups in x, 2 in w
