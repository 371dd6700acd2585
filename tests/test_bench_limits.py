"""bench/bench_limits.py: the operand-byte count of matrix products, checked on products whose
operands are known, and the report's arithmetic on given measurements."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from replaykv.model import native

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_limits import BEGIN, END, OperandBytes, gemm_share, matmul_flops, operand_bytes, report


def test_operand_bytes_counts_each_storage_once_per_product() -> None:
    a, b = torch.ones(4, 8), torch.ones(8, 16)
    with OperandBytes() as m:
        torch.mm(a, b)  # 32 + 128 floats
        torch.mm(a, a.t())  # one storage: 32 floats
        (a * 2).sum()  # not a product
    assert (m.products, m.bytes) == (2, (32 + 128 + 32) * 4)


def test_operand_bytes_sees_the_product_inside_linear() -> None:
    x, w, bias = torch.ones(3, 8), torch.ones(5, 8), torch.ones(5)
    with OperandBytes() as m:
        F.linear(x, w, bias)
    assert m.products == 1
    assert m.bytes == (24 + 40 + 5) * 4


@pytest.mark.skipif(not native.enabled(), reason="native kernels not buildable here")
def test_native_products_are_counted_and_profiled() -> None:
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    with torch.inference_mode():
        assert matmul_flops(lambda: native.linear(x, w)) == 2 * 3 * 8 * 5
        assert (
            operand_bytes(lambda: native.linear(x, w)) == (3 * 8 + 8 * 16) * 4
        )  # the weight's 5 outputs padded to 16
        q, win, sinks = torch.randn(2, 3, 4, 8), torch.randn(2, 5 + 3, 8), torch.zeros(4)
        attend = native.joint_attention(q, win, None, sinks, None, None, None, 6, 0.3)
        assert attend is not None
        # scores and weighted sum: 4·H·D per query and window key (2 rows × 3 queries × 6 keys)
        assert matmul_flops(
            lambda: native.joint_attention(q, win, None, sinks, None, None, None, 6, 0.3)
        ) == (4 * 4 * 8 * 2 * 3 * 6)
        share, top = gemm_share(lambda: [native.linear(x, w) for _ in range(20)])
    assert share > 0 and "replaykv::linear" in dict(top)


def test_report_divides_the_measurements_it_is_given() -> None:
    args = argparse.Namespace(preset="v41-small", context=1000, decode_steps=4, repeats=2)
    r = {
        "threads": 2,
        "torch": "x",
        "peak_fp32": 100.0,
        "peak_bf16": 400.0,
        "copy_gbs": 20.0,
        "prefill_flops": 50e9,
        "prefill_s": [1.0, 3.0, 2.0],
        "prefill_gemm_share": 0.5,
        "prefill_top": [("aten::mm", 0.5)],
        "decode_flops": 10e6,
        "decode_s": [0.01, 0.02],
        "decode_operand_bytes": 150 * 2**20,
        "decode_gemm_share": 0.25,
        "decode_top": [("aten::add", 0.1)],
    }
    text = report(args, r)
    assert text.startswith(BEGIN) and text.endswith(END)
    assert (
        "| prefill, 1,000 tokens | 1.00 / 2.00 s | 50.0 GFLOP | 25.0 GFLOP/s | 25.0% | 50% | mm 50% |" in text
    )
    # decode: median 15 ms, 10 MFLOP -> 0.67 GFLOP/s; 150 MiB / 15 ms = 10.49 GB/s, 52.4% of 20
    assert "| 10.49 GB/s" not in text and "10.49 GB/s over the step's median time, 52.4%" in text
