"""The native joint attention (replaykv.model.native.joint_attention, `kernels/attention.cpp`)
against a reference written here from the spec (one query at a time in float64: its readable
window rows, its visible or selected entries and its head's sink share one softmax; the keys
are the values), a query's result independent of the call it runs in, the model's torch path
(`native.disabled()`) within float32 rounding, and its fallbacks."""

from __future__ import annotations

import pytest
import torch

from replaykv.model import native
from replaykv.model.attention import joint_attention
from replaykv.model.compressor import write_ring
from replaykv.model.step import RopeTables, Step

pytestmark = pytest.mark.skipif(not native.enabled(), reason="native kernel not buildable here")


def reference(
    q: torch.Tensor,
    win: torch.Tensor,
    key_ok: torch.Tensor | None,
    sinks: torch.Tensor,
    entries: torch.Tensor | None,
    limit: torch.Tensor | None,
    sel: torch.Tensor | None,
    w: int,
) -> torch.Tensor:
    b, s, h, d = q.shape
    out = torch.zeros(b, s, h, d, dtype=torch.float64)
    for r in range(b):
        for i in range(s):
            keys = [win[r, j] for j in range(i, i + w) if key_ok is None or bool(key_ok[r, j])]
            if entries is not None and sel is not None:
                keys += [entries[r, int(e)] for e in sel[r, i] if e >= 0]
            elif entries is not None and limit is not None:
                keys += [entries[r, e] for e in range(min(int(limit[r, i]), entries.shape[1]))]
            if not keys:  # only the sink: weight 1 on no value
                continue
            k = torch.stack(keys).double()
            logits = q[r, i].double() @ k.T * d**-0.5
            z = torch.cat([logits, sinks.double()[:, None]], dim=1).softmax(dim=1)
            out[r, i] = z[:, :-1] @ k
    return out


def operands(case: str, d: int, seed: int = 0) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    b, s, h, w, n = 2, 23, 5, 16, 30
    ops: dict[str, torch.Tensor | None] = {
        "q": torch.randn(b, s, h, d, generator=g),
        "win": torch.randn(b, w - 1 + s, d, generator=g) * 2,
        "key_ok": None,
        "sinks": torch.randn(h, generator=g),
        "entries": None,
        "limit": None,
        "sel": None,
    }
    if case == "floors":  # a replay's first rows: window rows before the floor unreadable
        ops["key_ok"] = torch.arange(w - 1 + s)[None] >= torch.tensor([[3], [19]])
    if case in ("dense", "sparse"):
        ops["entries"] = torch.randn(b, n, d, generator=g)
        ops["limit"] = torch.tensor([[0], [7]]) + torch.arange(s)  # entries visible, up to past N
    if case == "sparse":
        picks = torch.stack([torch.randperm(n, generator=g)[:9] for _ in range(b * s)]).view(b, s, 9)
        ops["sel"] = picks.masked_fill(torch.rand(b, s, 9, generator=g) < 0.3, -1)
    return ops


def call(ops: dict[str, torch.Tensor | None]) -> torch.Tensor:
    q, win, sinks = ops["q"], ops["win"], ops["sinks"]
    assert q is not None and win is not None and sinks is not None
    out = native.joint_attention(
        q, win, ops["key_ok"], sinks, ops["entries"], ops["limit"], ops["sel"], 16, q.shape[-1] ** -0.5
    )
    assert out is not None
    return out


@pytest.mark.parametrize("case", ["window", "floors", "dense", "sparse"])
@pytest.mark.parametrize("d", [64, 40, 7])  # whole 64-float chunks, a 16-float tail, scalar only
def test_kernel_computes_the_spec(case: str, d: int) -> None:
    ops = operands(case, d)
    want = reference(*(ops[k] for k in ("q", "win", "key_ok", "sinks", "entries", "limit", "sel")), w=16)
    torch.testing.assert_close(call(ops).double(), want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("case", ["floors", "dense", "sparse"])
def test_a_query_gets_the_same_bits_in_any_call(case: str) -> None:
    ops = operands(case, 64, seed=1)
    whole = call(ops)
    for i0, i1 in ((0, 1), (5, 6), (3, 17), (22, 23)):  # decode-like single queries and a chunk
        part = {
            "q": ops["q"][:, i0:i1],  # type: ignore[index]
            "win": ops["win"][:, i0 : i1 + 15],  # type: ignore[index]
            "key_ok": None if ops["key_ok"] is None else ops["key_ok"][:, i0 : i1 + 15],
            "sinks": ops["sinks"],
            "entries": ops["entries"],
            "limit": None if ops["limit"] is None else ops["limit"][:, i0:i1],
            "sel": None if ops["sel"] is None else ops["sel"][:, i0:i1],
        }
        assert torch.equal(call(part), whole[:, i0:i1])


def test_large_logits_and_an_overwhelming_sink() -> None:
    ops = operands("dense", 64, seed=2)
    ops["q"] = ops["q"] * 40  # type: ignore[operator]  # logits in the hundreds: exp underflows for most keys
    want = reference(*(ops[k] for k in ("q", "win", "key_ok", "sinks", "entries", "limit", "sel")), w=16)
    torch.testing.assert_close(call(ops).double(), want, rtol=2e-5, atol=2e-5)
    ops["q"], ops["sinks"] = ops["q"] / 1000, torch.full((5,), 80.0)  # type: ignore[operator]
    assert call(ops).abs().max() < 1e-20  # the sink takes (almost) all the weight


def test_the_model_path_uses_it_and_matches_its_torch_path() -> None:
    g = torch.Generator().manual_seed(4)
    b, s, h, d, w, ratio = 2, 40, 4, 64, 16, 4
    start = torch.tensor([0, 9])
    positions = start[:, None] + torch.arange(s)
    step = Step(positions, start, (0, 9), torch.tensor([0, 5]), (0, 5), RopeTables.build({}, positions))
    q = torch.randn(b, s, h, d, generator=g)
    win = torch.randn(b, w - 1 + s, d, generator=g)
    sinks = torch.randn(h, generator=g)
    entries = torch.randn(b, (9 + s) // ratio, d, generator=g)
    with torch.inference_mode():
        fast = joint_attention(q, win, step, w, sinks, entries, ratio)
        with native.disabled():
            slow = joint_attention(q, win, step, w, sinks, entries, ratio)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)
    assert not torch.equal(fast, slow)  # the native pass ran: its rounding is its own


def test_autograd_and_other_dtypes_keep_the_torch_path() -> None:
    q = torch.randn(1, 3, 2, 8, requires_grad=True)
    win = torch.randn(1, 4 + 3, 8)
    assert native.joint_attention(q, win, None, torch.zeros(2), None, None, None, 5, 0.3) is None
    assert (
        native.joint_attention(
            q.detach().double(), win.double(), None, torch.zeros(2), None, None, None, 5, 0.3
        )
        is None
    )


def test_bad_operands_get_a_clear_error() -> None:
    ops = operands("sparse", 16)
    ops["sel"] = ops["sel"].clone()  # type: ignore[union-attr]
    ops["sel"][0, 3, 0] = 30  # past the 30 entries
    with pytest.raises(RuntimeError, match="past the entries"):
        call(ops)
    with pytest.raises(RuntimeError, match="win"):
        native.joint_attention(
            torch.zeros(1, 3, 2, 8), torch.zeros(1, 5, 8), None, torch.zeros(2), None, None, None, 4, 1.0
        )


def test_a_ring_read_in_place_equals_its_rows_in_order() -> None:
    """A decode step reads the cache's window ring in place: slot (ring_first + j) % R is row j."""
    g = torch.Generator().manual_seed(5)
    b, h, d, w, ratio = 2, 4, 64, 16, 4
    start = torch.tensor([40, 7])  # one row wrapped around the ring, one not yet full
    floors = torch.tensor([0, 3])
    history = torch.randn(b, 41, d, generator=g)
    ring = torch.zeros(b, w, d)
    for r, p in enumerate(start.tolist()):  # positions 0 .. p of each row
        write_ring(ring[r : r + 1], history[r : r + 1, : p + 1], torch.zeros(1, dtype=torch.long))
    rows = torch.stack([history[r, int(p) + 1 - w + torch.arange(w)] for r, p in enumerate(start)])
    positions = start[:, None]
    step = Step(positions, start, (40, 7), floors, (0, 3), RopeTables.build({}, positions))
    q, sinks = torch.randn(b, 1, h, d, generator=g), torch.randn(h, generator=g)
    entries = torch.randn(b, 11, d, generator=g)
    with torch.inference_mode():
        in_order = joint_attention(q, rows, step, w, sinks, entries, ratio)
        in_place = joint_attention(q, ring, step, w, sinks, entries, ratio, ring_first=start + 1 - w)
        assert torch.equal(in_place, in_order)
        with native.disabled():  # the torch path puts the rows in order first
            torch_order = joint_attention(q, rows, step, w, sinks, entries, ratio)
            torch_ring = joint_attention(q, ring, step, w, sinks, entries, ratio, ring_first=start + 1 - w)
        assert torch.equal(torch_ring, torch_order)
    torch.testing.assert_close(in_place, torch_order, rtol=1e-5, atol=1e-6)
