"""Tests for :func:`replaykv.model.compressor.topk_lowest_index`, the top-k of the indexers and of
the candidate blocks: the k largest scores, ties to the lower index, in rank order.

The reference sorts each row in plain Python by (NaN first, score descending, index ascending);
the inputs are built to tie often (rounded scores, ReLU zeros), across the edge of the set and
inside it, with masked (-inf) tails and NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

from replaykv.model.compressor import topk_lowest_index


def reference(row: list[float], k: int) -> list[int]:
    def key(i: int) -> tuple[int, float, int]:
        x = row[i]
        return (0, 0.0, i) if math.isnan(x) else (1, -x, i)

    return sorted(range(len(row)), key=key)[:k]


def scores(kind: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(*shape, generator=gen)
    if kind == "ties":
        x = (x * 2).round()
    elif kind == "zeros":
        x = torch.relu(x).round() * 0.5
    elif kind == "masked":
        x = x.round()
        x[..., shape[-1] // 2 :] = float("-inf")
    elif kind == "nan":
        x = x.round()
        x.view(-1, shape[-1])[::3, 1] = float("nan")
    return x


@pytest.mark.parametrize("kind", ["distinct", "ties", "zeros", "masked", "nan"])
def test_topk_lowest_index_matches_a_sorted_reference(kind: str) -> None:
    gen = torch.Generator().manual_seed(7)
    for trial in range(60):
        n = int(torch.randint(2, 200, (1,), generator=gen))
        k = int(torch.randint(1, n, (1,), generator=gen))  # k < n: the rank-order contract
        x = scores(kind, (3, 4, n), gen)
        got = topk_lowest_index(x, k)
        assert got.shape == (3, 4, k) and got.dtype == torch.long
        for row, out in zip(x.view(-1, n).tolist(), got.view(-1, k).tolist(), strict=True):
            want = reference(row, k)
            masked = [i for i in want if row[i] == float("-inf")]
            # -inf entries (masked by every caller) are in the set but in no particular order
            assert out[: k - len(masked)] == want[: k - len(masked)], (trial, kind, n, k)
            assert sorted(out[k - len(masked) :]) == sorted(masked), (trial, kind, n, k)


def test_topk_lowest_index_edges() -> None:
    x = torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0]])
    assert topk_lowest_index(x, 2).tolist() == [[0, 2]]  # a tie across the edge: lowest first
    assert topk_lowest_index(x, 4).tolist() == [[0, 2, 4, 3]]
    assert topk_lowest_index(x, 0).shape == (1, 0)
    assert topk_lowest_index(x, 5).tolist() == [[0, 2, 4, 3, 1]]  # k >= N: every index, ranked
    assert topk_lowest_index(x, 9).tolist() == [[0, 2, 4, 3, 1]]
    # -0.0 and 0.0 are one score
    assert topk_lowest_index(torch.tensor([[-1.0, 0.0, -0.0, 0.0]]), 2).tolist() == [[1, 2]]


@pytest.mark.parametrize("width", [1, 5, 8, 31, 32, 45])
def test_rowwise_gives_a_row_the_same_bits_alone_and_among_rows(width: int) -> None:
    """Elementwise exponentials run in vector code on runs of 32 floats and in scalar code on
    what is left at the end of a tensor; `rowwise` gives a row the bits it gets among other rows
    when it comes alone (a decode step)."""
    from replaykv.model.layers import rowwise

    gen = torch.Generator().manual_seed(width)
    x = torch.randn(203, width, generator=gen) * 4
    x[7, 0] = float("-inf")
    for fn in (torch.exp, torch.sigmoid, torch.nn.functional.softplus):
        together = rowwise(fn, x)
        assert together.shape == x.shape
        alone = torch.cat([rowwise(fn, x[i : i + 1]) for i in range(x.shape[0])])
        assert torch.equal(together, alone), fn
        assert torch.allclose(together, fn(x), rtol=1e-6, atol=0)  # the function's value


def test_rope_tables_of_a_position_alone_equal_its_tables_among_others() -> None:
    from replaykv.model.rope import rope_table

    freqs = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    positions = torch.arange(0, 200_000, 997)[None]
    cos, sin = rope_table(freqs, positions)
    for i in range(positions.shape[1]):
        c, s = rope_table(freqs, positions[:, i : i + 1])
        assert torch.equal(c[0, 0], cos[0, i]) and torch.equal(s[0, 0], sin[0, i]), int(positions[0, i])
