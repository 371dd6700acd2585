"""How close the engine's prefill and decode run to this machine's limits, measured in one run.

    python bench/bench_limits.py [--preset v41-small] [--context 16384] [--decode-steps 16]
        [--repeats 2] [--threads N] [--write docs/benchmarks.md]

In one process (glibc keeping freed memory, `replaykv.malloc`):

- the machine's references: torch.mm's peak (square products, float32 and bf16, best of several)
  and a copy's bandwidth (a 256 MiB float32 tensor copied, bytes read + written, best of several);
- a prefill of `--context` tokens of the preset (random weights, float32 as the engine runs them)
  into an empty cache, and `--decode-steps` single-token steps after it: time (min / median over
  `--repeats`), the floating-point work of the matrix products (`FlopCounterMode`, with the
  native products' and the native attention's and indexer's dot products, counted on a
  separate untimed call) and so the achieved GFLOP/s; for a decode step also the bytes its matrix
  products read (their operands, each storage once per product: `OperandBytes`), a lower bound of
  what the step moves, over the copy's bandwidth;
- where the time goes (torch.profiler, one more call each): the share of self CPU time in matrix
  products (`GEMM_OPS`) against everything else, and the operators that take the most.

The native kernels are not aten operators: `NativeCalls` gives each of their calls a profiler
range of its own (`replaykv::linear`, `replaykv::joint_attention`, ...) and counts the native
products' work and operand bytes with aten's.

Ratios only mean something within one run: the references and the model share the machine's state.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from report import replace_section  # noqa: E402

from replaykv.cache.views import advance, allocate_view  # noqa: E402
from replaykv.malloc import reexec_keeping_freed_memory  # noqa: E402
from replaykv.model import native  # noqa: E402
from replaykv.model.init import init_weights  # noqa: E402
from replaykv.model.presets_v41 import get_preset_v41  # noqa: E402
from replaykv.model.spec import ModelSpec  # noqa: E402
from replaykv.model.v41 import DeepseekV41ForCausalLM  # noqa: E402

BEGIN, END = "<!-- bench_limits:begin -->", "<!-- bench_limits:end -->"
# The matrix products as the profiler names them (a `linear` or `matmul` dispatches one of these;
# the native product runs in a range of its own name, see `NativeCalls`).
GEMM_OPS = frozenset(
    {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_int_mm", "replaykv::linear"}
)
_GEMM_FUNCS = ("mm", "addmm", "bmm", "baddbmm")


class NativeCalls:
    """Makes the native kernels (`replaykv.model.native`, C++ calls that are not aten operators)
    visible for the duration of a measurement: each call runs inside a profiler range named
    `replaykv::<kernel>`; with `count`, each product (`linear`) adds its work (2·rows·K·N) and its
    operands' bytes (x and the kernel's form of the weight) to `flops` and `bytes`, and the
    attention and index kernels their dot products' work (`joint_attention`: 4·H·D per query and
    key it reads, scores and weighted sum; `index_topk`: 2·H·D per query and visible entry)."""

    def __init__(self, count: bool = False) -> None:
        self.count = count
        self.flops = 0
        self.bytes = 0
        self._module: Any = None

    def __enter__(self) -> NativeCalls:
        if native.enabled():
            self._module, native._module = native._module, self
        return self

    def __exit__(self, *exc: object) -> None:
        if self._module is not None:
            native._module, self._module = self._module, None

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._module, name)

        def call(*args: Any) -> Any:
            if self.count:
                self.flops += _native_flops(name, args)
            if self.count and name == "linear":
                x, wt, _ = args
                self.bytes += (x.numel() + wt.numel()) * x.element_size()
            with record_function(f"replaykv::{name}"):
                return fn(*args)

        return call


def _native_flops(name: str, args: tuple[Any, ...]) -> int:
    """The dot products' work of one native call (see `NativeCalls`); 0 for other kernels."""
    if name == "linear":
        x, wt, n = args
        k = wt.shape[-2]
        return 2 * (x.numel() // max(1, k)) * k * n
    if name == "joint_attention":
        q, _, _, key_ok, _, entries, limit, sel, window, _ = args
        b, s, h, d = q.shape
        if key_ok.numel():  # readable rows of each query's window [i, i + W)
            sums = F.pad(key_ok.long().cumsum(1), (1, 0))
            keys = int((sums[:, window : window + s] - sums[:, :s]).sum())
        else:
            keys = b * s * window
        if sel.numel():
            keys += int((sel >= 0).sum())
        elif limit.numel():
            keys += int(limit.clamp(0, entries.shape[1]).sum())
        return 4 * h * d * keys
    if name == "index_topk":
        q, _, keys_t, lim = args[:4]
        return 2 * q.shape[2] * q.shape[3] * int(lim.clamp(0, keys_t.shape[1]).sum())
    return 0


class OperandBytes(TorchDispatchMode):
    """Sums the bytes of the tensor operands of every matrix product dispatched inside it (each
    storage once per product): what the products must read at least."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.products = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ in _GEMM_FUNCS:
            seen: set[int] = set()
            for a in args:
                if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() not in seen:
                    seen.add(a.untyped_storage().data_ptr())
                    self.bytes += a.numel() * a.element_size()
            self.products += 1
        return func(*args, **(kwargs or {}))


def best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def mm_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of an n × n × n product, best of `repeats`."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / best_seconds(lambda: torch.mm(a, b), repeats) / 1e9


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """GB/s of a float32 copy (bytes read + bytes written), best of `repeats`."""
    src = torch.randn(mib << 18)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / best_seconds(lambda: dst.copy_(src), repeats) / 1e9


def matmul_flops(fn: Callable[[], Any]) -> int:
    """The floating-point work of fn's matrix products, aten's and the native ones."""
    with FlopCounterMode(display=False) as counter, NativeCalls(count=True) as calls:
        fn()
    return int(counter.get_total_flops()) + calls.flops


def operand_bytes(fn: Callable[[], Any]) -> int:
    with OperandBytes() as mode, NativeCalls(count=True) as calls:
        fn()
    return mode.bytes + calls.bytes


def gemm_share(fn: Callable[[], Any], top: int = 6) -> tuple[float, list[tuple[str, float]]]:
    """Share of self CPU time in `GEMM_OPS` over one call, and the `top` operators by self time
    (name, share)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof, NativeCalls():
        fn()
    rows = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    total = sum(t for _, t in rows) or 1.0
    gemm = sum(t for k, t in rows if k in GEMM_OPS)
    ranked = sorted(rows, key=lambda r: -r[1])[:top]
    return gemm / total, [(k, t / total) for k, t in ranked]


class Runs:
    """The preset's model and fresh cache views of the run's shape."""

    def __init__(self, preset: str, context: int, decode_steps: int) -> None:
        torch.manual_seed(0)
        model = DeepseekV41ForCausalLM(get_preset_v41(preset))
        init_weights(model, seed=0)
        self.model = model.float().eval()
        self.spec = ModelSpec.from_config(self.model.config)
        self.context, self.steps = context, decode_steps
        self.ids = torch.randint(0, self.model.config.vocab_size, (1, context + decode_steps + 2))

    def fresh_view(self) -> Any:
        return allocate_view(self.spec, 1, self.context + self.steps + 2)

    def prefill(self, view: Any) -> None:
        self.model(self.ids[:, : self.context], view, logits_rows="last")
        advance(view, self.context)

    def decode(self, view: Any, at: int) -> None:
        self.model(self.ids[:, at : at + 1], view, logits_rows="last")
        advance(view, 1)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    r: dict[str, Any] = {"threads": torch.get_num_threads(), "torch": torch.__version__}
    r["peak_fp32"] = mm_peak(torch.float32)
    r["peak_bf16"] = mm_peak(torch.bfloat16, n=1024, repeats=3)  # without bf16 units it is slow
    r["copy_gbs"] = copy_bandwidth()
    runs = Runs(args.preset, args.context, args.decode_steps)
    c = args.context
    with torch.inference_mode():
        r["prefill_flops"] = matmul_flops(lambda: runs.prefill(runs.fresh_view()))
        prefill_s, decode_s = [], []
        for _ in range(args.repeats):
            view = runs.fresh_view()
            t0 = time.perf_counter()
            runs.prefill(view)
            prefill_s.append(time.perf_counter() - t0)
            runs.decode(view, c)  # warm-up step
            t0 = time.perf_counter()
            for i in range(args.decode_steps):
                runs.decode(view, c + 1 + i)
            decode_s.append((time.perf_counter() - t0) / args.decode_steps)
        r["prefill_s"], r["decode_s"] = prefill_s, decode_s
        view = runs.fresh_view()
        r["prefill_gemm_share"], r["prefill_top"] = gemm_share(lambda: runs.prefill(view))
        runs.decode(view, c)
        at = c + 1
        r["decode_flops"] = matmul_flops(lambda: runs.decode(view, at))
        r["decode_operand_bytes"] = operand_bytes(lambda: runs.decode(view, at + 1))
        r["decode_gemm_share"], r["decode_top"] = gemm_share(lambda: runs.decode(view, at + 2))
    return r


def report(args: argparse.Namespace, r: dict[str, Any]) -> str:
    p_min, p_med = min(r["prefill_s"]), statistics.median(r["prefill_s"])
    d_min, d_med = min(r["decode_s"]), statistics.median(r["decode_s"])
    p_gf = r["prefill_flops"] / p_med / 1e9
    d_gf = r["decode_flops"] / d_med / 1e9
    d_bw = r["decode_operand_bytes"] / d_med / 1e9

    def top(rows: list[tuple[str, float]]) -> str:
        return ", ".join(f"{k.removeprefix('aten::')} {share:.0%}" for k, share in rows)

    lines = [
        BEGIN,
        "",
        f"`python bench/bench_limits.py --preset {args.preset} --context {args.context} --decode-steps "
        f"{args.decode_steps} --repeats {args.repeats}` ({r['threads']} torch threads, torch {r['torch']}): "
        f"references in the same run: torch.mm peak {r['peak_fp32']:.0f} GFLOP/s float32 and "
        f"{r['peak_bf16']:.0f} bf16 (2,048² and 1,024² products), copy {r['copy_gbs']:.1f} GB/s (256 MiB, read + write).",
        "",
        "| | time (min / median) | matrix-product work | achieved | share of the float32 peak | in matrix products | other top operators (self time) |",
        "|---|---:|---:|---:|---:|---:|---|",
        f"| prefill, {args.context:,} tokens | {p_min:.2f} / {p_med:.2f} s | {r['prefill_flops'] / 1e9:.1f} GFLOP "
        f"| {p_gf:.1f} GFLOP/s | {p_gf / r['peak_fp32']:.1%} | {r['prefill_gemm_share']:.0%} | {top(r['prefill_top'])} |",
        f"| decode step after it | {d_min * 1e3:.2f} / {d_med * 1e3:.2f} ms | {r['decode_flops'] / 1e6:.1f} MFLOP "
        f"| {d_gf:.2f} GFLOP/s | {d_gf / r['peak_fp32']:.2%} | {r['decode_gemm_share']:.0%} | {top(r['decode_top'])} |",
        "",
        f"A decode step's matrix products read at least {r['decode_operand_bytes'] / 2**20:.1f} MiB (their operands): "
        f"{d_bw:.2f} GB/s over the step's median time, {d_bw / r['copy_gbs']:.1%} of the copy's bandwidth.",
        "",
        END,
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="v41-small")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--write", default="")
    args = ap.parse_args()
    reexec_keeping_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    section = report(args, measure(args))
    print(section)
    if args.write:
        replace_section(
            args.write, section, BEGIN, END, "## Closeness to the machine's limits (bench/bench_limits.py)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
