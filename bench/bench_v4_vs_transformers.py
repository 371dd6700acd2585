"""replaykv versus transformers on the same tiny DeepSeek-V4 config and the same tokens.

Prefill at 1K / 4K / 8K / 16K tokens for both, 2K and 32K–128K for replaykv alone, and 128
decode steps after a 16K prefill. Every measurement runs in its own child process (glibc told to
keep freed memory, `replaykv.malloc.MALLOC_ENV`) so its peak memory (the process's peak resident
set above its level just before the timed call) is clean.

    python bench/bench_v4_vs_transformers.py [--sizes 1024,4096,8192,16384]
        [--ours-only 2048,32768,65536,131072] [--decode-context 16384] [--decode-steps 128]
        [--decode-rounds 3]
        [--skip-hf] [--write docs/benchmarks.md] [--plot docs/img/v4_prefill_per_token.png]

Decode is timed at torch's thread count and at one thread (what replaykv's engine runs its decode
steps on, `EngineConfig.decode_threads`), for both engines; the faster counts. Each engine's
decode runs in --decode-rounds processes, the engines alternating which goes first (a process
right after transformers' 19 GB prefill can meet a slower machine); the table gives the median
and the fastest round. After the timed
decode steps each decode worker profiles a few more: the operators a step
dispatches (counted below autograd with a `TorchDispatchMode`, views included), the share of
its self CPU time in matrix products and the operators that take the most (torch.profiler).
The prefill curve (time per token against length, next to the [S, S/4] index scores of one
CSA layer, the term DeepSeek's design makes quadratic) is plotted to --plot. `--profile-prefill N`
only profiles one replaykv prefill of N tokens and prints where its time goes.

Prints a Markdown table; with --write, replaces the section between the markers in that file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import replace_section

ROOT = Path(__file__).resolve().parents[1]
MARK_BEGIN = "<!-- bench_v4_vs_transformers:begin -->"
MARK_END = "<!-- bench_v4_vs_transformers:end -->"
PROFILED_STEPS = 8


def decode_profile(step: Callable[[], None]) -> dict[str, Any]:
    """Operators per decode step (and native kernel calls, which are not operators), share of
    self CPU time in matrix products, top operators."""
    from bench_limits import gemm_share
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.ops += 1
            return func(*args, **(kwargs or {}))

    def steps() -> None:
        for _ in range(PROFILED_STEPS):
            step()

    class Calls:  # counts the native kernel calls (the profiler sees only aten operators)
        def __init__(self, module: Any) -> None:
            self.module, self.calls = module, 0

        def __getattr__(self, name: str) -> Any:
            fn = getattr(self.module, name)

            def counted(*args: Any) -> Any:
                self.calls += 1
                return fn(*args)

            return counted

    native: Any = sys.modules.get("replaykv.model.native")  # loaded in replaykv's worker only
    loaded = native is not None and native.enabled()
    calls = Calls(native._module if native is not None else None)
    if loaded:
        native._module = calls
    try:
        with Count() as counter:
            steps()
    finally:
        if loaded:
            native._module = calls.module
    share, top = gemm_share(steps, top=5)
    return {
        "ops_per_step": counter.ops / PROFILED_STEPS,
        "native_calls_per_step": calls.calls / PROFILED_STEPS if loaded else 0.0,
        "gemm_share": share,
        "top": [[k.removeprefix("aten::"), v] for k, v in top],
    }


def _rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def make_checkpoint(directory: Path) -> None:
    """Random transformers model of the `tiny` preset's shape, saved with save_pretrained."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from replaykv.model.presets import v4_tiny

    cfg = v4_tiny().to_dict()
    for key in ("architectures", "model_type", "qk_rope_head_dim"):
        cfg.pop(key, None)
    torch.manual_seed(0)
    config = DeepseekV4Config(**cfg)
    config._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, model.config.n_routed_experts, b.shape))
    model.save_pretrained(directory)


def worker(impl: str, model_dir: str, mode: str, n: int, steps: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(1)
    if impl == "hf":
        from transformers import DeepseekV4ForCausalLM
        from transformers.cache_utils import DynamicCache

        model = DeepseekV4ForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
        vocab = model.config.vocab_size
    else:
        from replaykv.cache.views import advance, allocate_view
        from replaykv.engine.oneshot import prefill
        from replaykv.model.checkpoint import load_model
        from replaykv.model.spec import ModelSpec

        model = load_model(model_dir)
        vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, n))
    result: dict[str, Any] = {}
    with torch.inference_mode():
        # warm-up on a short input so one-time costs do not count
        if impl == "hf":
            model(ids[:, :64])
        else:
            prefill(model, ids[:, :64], allocate_view(ModelSpec.from_config(model.config), 1, 64))
        base = _rss_now()
        _reset_peak()
        t0 = time.perf_counter()
        if impl == "hf":
            cache = DynamicCache(config=model.config) if mode == "decode" else None
            out = model(ids, cache=cache, use_cache=mode == "decode", logits_to_keep=1)
            nxt = out.logits[:, -1:].argmax(-1)
        else:
            view = allocate_view(
                ModelSpec.from_config(model.config), 1, n + 2 * steps + 2 * PROFILED_STEPS + 1
            )
            logits = prefill(model, ids, view, logits_rows="last")
            nxt = logits[:, -1:].argmax(-1)
        result["prefill_s"] = time.perf_counter() - t0
        result["peak_bytes"] = float(max(0, _peak_rss() - base))
        if mode == "profile" and impl == "ours":  # where a long prefill's time goes
            from bench_limits import gemm_share

            fresh = allocate_view(ModelSpec.from_config(model.config), 1, n + 1)
            share, top = gemm_share(lambda: prefill(model, ids, fresh, logits_rows="last"), top=8)
            result["prefill_profile"] = {
                "gemm_share": share,
                "top": [[k.removeprefix("aten::"), v] for k, v in top],
            }
        if mode == "decode":
            done = 0

            def step() -> None:
                nonlocal nxt, done
                if impl == "hf":
                    pos = torch.tensor([[n + done]])
                    out = model(nxt, cache=cache, use_cache=True, position_ids=pos)
                    nxt = out.logits[:, -1:].argmax(-1)
                else:
                    logits = model(nxt, view, logits_rows="last")
                    advance(view, 1)
                    nxt = logits[:, -1:].argmax(-1)
                done += 1

            # Each engine's decode at torch's thread count and at one thread (replaykv's engine
            # runs its decode steps on `EngineConfig.decode_threads` = 1): the faster one counts.
            by_threads: dict[int, float] = {}
            for threads in sorted({torch.get_num_threads(), 1}, reverse=True):
                torch.set_num_threads(threads)
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                by_threads[threads] = (time.perf_counter() - t0) / steps * 1000
            best = min(by_threads, key=lambda t: by_threads[t])
            torch.set_num_threads(best)
            result["decode_ms_per_token"] = by_threads[best]
            result["decode_threads"] = best
            result["decode_ms_by_threads"] = by_threads
            result["decode_profile"] = decode_profile(step)
    return result


def decode_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's decode rounds: the median and fastest ms per token, each round's, the median
    per thread count and the first round's profile."""
    ok = [r for r in runs if "decode_ms_per_token" in r]
    if not ok:
        return runs[0] if runs else {}
    per_round = [r["decode_ms_per_token"] for r in ok]
    threads = sorted({t for r in ok for t in r["decode_ms_by_threads"]})
    return {
        "decode_ms_per_token": statistics.median(per_round),
        "decode_ms_min": min(per_round),
        "rounds": per_round,
        "decode_ms_by_threads": {
            t: statistics.median(r["decode_ms_by_threads"][t] for r in ok if t in r["decode_ms_by_threads"])
            for t in threads
        },
        "decode_profile": ok[0].get("decode_profile"),
    }


def run_child(impl: str, model_dir: Path, mode: str, n: int, steps: int = 0) -> dict[str, Any]:
    from replaykv.malloc import MALLOC_ENV

    cmd = [sys.executable, __file__, "--worker", impl, str(model_dir), mode, str(n), str(steps)]
    env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": 1.0, "wall": time.perf_counter() - t0, "stderr": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plot_curve(rows: list[tuple[int, dict[str, Any], dict[str, Any] | None]], path: Path) -> None:
    """Microseconds per prefill token against length (both engines where run), and on a second
    axis the [S, S/4] index scores one CSA layer computes per token (S/4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, which, style in (("replaykv", 0, "o-"), ("transformers", 1, "s--")):
        pts = []
        for n, *results in rows:
            res = results[which]
            if res is not None and "error" not in res:
                pts.append((n, res["prefill_s"] / n * 1e6))
        if pts:
            ax.plot(*zip(*pts, strict=True), style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefill tokens S")
    ax.set_ylabel("µs per token")
    twin = ax.twinx()
    ns = [r[0] for r in rows]
    twin.plot(ns, [n / 4 for n in ns], ":", color="gray", label="index scores per token (S/4)")
    twin.set_yscale("log")
    twin.set_ylabel("index scores per token, one CSA layer")
    lines = ax.get_legend_handles_labels()
    extra = twin.get_legend_handles_labels()
    ax.legend(lines[0] + extra[0], lines[1] + extra[1], loc="upper left")
    ax.set_title("tiny DeepSeek-V4 prefill")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt_s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f} s"


def fmt_gb(x: float | None) -> str:
    return "—" if x is None else f"{x / 2**30:.2f} GiB"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=5, metavar=("IMPL", "DIR", "MODE", "N", "STEPS"))
    ap.add_argument("--sizes", default="1024,4096,8192,16384")
    ap.add_argument("--ours-only", default="2048,32768,65536,131072")
    ap.add_argument("--decode-context", type=int, default=16384)
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--decode-rounds", type=int, default=3,
                    help="decode measurements per engine, alternating which engine goes first")  # fmt: skip
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--profile-prefill", type=int, default=0, metavar="N",
                    help="only profile one replaykv prefill of N tokens (torch.profiler) and print its top operators")  # fmt: skip
    ap.add_argument("--write", default="")
    ap.add_argument("--plot", default="", help="PNG of the prefill curve (default with --write: "
                    "docs/img/v4_prefill_per_token.png next to the written file)")  # fmt: skip
    args = ap.parse_args()
    if args.worker:
        impl, model_dir, mode, n, steps = args.worker
        print(json.dumps(worker(impl, model_dir, mode, int(n), int(steps))))
        return 0

    if args.profile_prefill:
        with tempfile.TemporaryDirectory() as tmp:
            make_checkpoint(Path(tmp) / "tiny-v4")
            got = run_child("ours", Path(tmp) / "tiny-v4", "profile", args.profile_prefill)
        if "prefill_profile" not in got:
            raise SystemExit(str(got.get("stderr", got)))
        prof = got["prefill_profile"]
        top = ", ".join(f"{k} {v:.0%}" for k, v in prof["top"])
        print(f"replaykv prefill of {args.profile_prefill:,} tokens: {got['prefill_s']:.2f} s untraced; "
              f"under torch.profiler {prof['gemm_share']:.0%} of self CPU time in matrix products; top: {top}")  # fmt: skip
        return 0
    sizes = [int(s) for s in args.sizes.split(",") if s]
    ours_only = [int(s) for s in args.ours_only.split(",") if s]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny-v4"
        make_checkpoint(model_dir)
        for n in sorted(sizes + ours_only):
            ours = run_child("ours", model_dir, "prefill", n)
            hf = None if (args.skip_hf or n in ours_only) else run_child("hf", model_dir, "prefill", n)
            rows.append((n, ours, hf))
            print(n, ours, hf, file=sys.stderr, flush=True)
        # Decode rounds alternate which engine goes first: a process that follows transformers'
        # 16K prefill (19 GB) can run in a slower phase of the machine.
        runs: dict[str, list[dict[str, Any]]] = {"ours": [], "hf": []}
        for r in range(args.decode_rounds):
            order = ["ours"] if args.skip_hf else (["ours", "hf"] if r % 2 == 0 else ["hf", "ours"])
            for impl in order:
                runs[impl].append(
                    run_child(impl, model_dir, "decode", args.decode_context, args.decode_steps)
                )
                print("decode", impl, r, runs[impl][-1], file=sys.stderr, flush=True)
        dec_ours = decode_summary(runs["ours"])
        dec_hf = decode_summary(runs["hf"]) if runs["hf"] else None

    lines = [
        MARK_BEGIN,
        "",
        f"Tiny DeepSeek-V4 (`tiny` preset: 6 layers — 2 sliding, 2 CSA, 2 HCA — hidden 128, window 128, "
        f"~3.8M parameters), float32, {os.cpu_count()} CPU cores, one process per measurement. "
        "Peak memory is the peak resident set of that process above its level just before the timed call. "
        "transformers runs its eager forward (the only attention it ships for V4).",
        "",
        "| prefill tokens | replaykv | transformers | speed-up | replaykv peak | transformers peak | memory ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, ours, hf in rows:
        o_t = None if "error" in ours else ours["prefill_s"]
        o_m = None if "error" in ours else ours["peak_bytes"]
        h_t = None if (hf is None or "error" in hf) else hf["prefill_s"]
        h_m = None if (hf is None or "error" in hf) else hf["peak_bytes"]
        speed = f"{h_t / o_t:.1f}×" if (h_t and o_t) else ("not run" if hf is None else "failed")
        mem = f"{h_m / o_m:.1f}×" if (h_m and o_m) else "—"
        lines.append(
            f"| {n:,} | {fmt_s(o_t)} | {fmt_s(h_t)} | {speed} | {fmt_gb(o_m)} | {fmt_gb(h_m)} | {mem} |"
        )
    lines += [
        "",
        f"Decode after a {args.decode_context:,}-token prefill ({args.decode_steps} greedy steps):",
        "",
    ]
    o_d = dec_ours.get("decode_ms_per_token")
    h_d = None if dec_hf is None else dec_hf.get("decode_ms_per_token")
    ratio = f"{h_d / o_d:.2f}×" if (o_d and h_d) else "—"
    o_min = dec_ours.get("decode_ms_min")
    h_min = None if dec_hf is None else dec_hf.get("decode_ms_min")
    ratio_min = f"{h_min / o_min:.2f}×" if (o_min and h_min) else "—"

    def by_threads(d: dict[str, Any] | None) -> str:
        if not d or "decode_ms_by_threads" not in d:
            return "—"
        return " / ".join(f"{v:.2f} ({k} thr.)" for k, v in sorted(d["decode_ms_by_threads"].items()))

    def ms(v: float | None) -> str:
        return "—" if v is None else f"{v:.2f}"

    rounds = len(runs["ours"])
    hf_rounds = [] if dec_hf is None else dec_hf.get("rounds", [])
    pairs = [h / o for o, h in zip(dec_ours.get("rounds", []), hf_rounds, strict=False)]
    paired = f"{statistics.median(pairs):.2f}× ({' / '.join(f'{p:.2f}×' for p in pairs)})" if pairs else "—"
    lines += [
        "| | replaykv | transformers | speed-up |",
        "|---|---:|---:|---:|",
        f"| ms per decoded token (the faster thread count), median of {rounds} rounds | {ms(o_d)} | "
        f"{ms(h_d)} | {ratio} |",
        f"| the same, fastest round | {ms(o_min)} | {ms(h_min)} | {ratio_min} |",
        f"| each round (engines alternating which goes first) | "
        f"{' / '.join(ms(v) for v in dec_ours.get('rounds', []))} | "
        f"{'—' if dec_hf is None else ' / '.join(ms(v) for v in dec_hf.get('rounds', []))} | |",
        f"| speed-up of each round (its two processes), median | | | {paired} |",
        f"| ms per decoded token by intra-op threads (median of rounds) | {by_threads(dec_ours)} | "
        f"{by_threads(dec_hf)} | |",
    ]
    profiles = [d.get("decode_profile") if d else None for d in (dec_ours, dec_hf)]
    if any(profiles):

        def cell(prof: dict[str, Any] | None, key: str) -> str:
            if prof is None:
                return "—"
            if key == "top":
                return ", ".join(f"{k} {v:.0%}" for k, v in prof["top"])
            native = prof.get("native_calls_per_step", 0.0)
            if key == "ops_per_step":
                return f"{prof[key]:,.0f}" + (f" + {native:,.0f} native calls" if native else "")
            return f"{prof[key]:.0%}"  # native products count too (`bench_limits.NativeCalls`)

        lines += [
            f"| operators dispatched per step | {cell(profiles[0], 'ops_per_step')} | "
            f"{cell(profiles[1], 'ops_per_step')} | |",
            f"| self CPU time in matrix products | {cell(profiles[0], 'gemm_share')} | "
            f"{cell(profiles[1], 'gemm_share')} | |",
            f"| operators taking the most (self CPU) | {cell(profiles[0], 'top')} | {cell(profiles[1], 'top')} | |",
        ]
    plot = args.plot or (
        str(Path(args.write).parent / "img" / "v4_prefill_per_token.png") if args.write else ""
    )
    if plot:
        plot_curve(rows, Path(plot))
        rel = os.path.relpath(plot, Path(args.write).parent) if args.write else plot
        lines += [
            "",
            f"Prefill time per token against length, with the index scores of one CSA layer: ![]({rel})",
        ]
    lines += ["", MARK_END]
    table = "\n".join(lines)
    print(table)
    if args.write:
        heading = "## DeepSeek-V4: replaykv versus transformers\n\n`python bench/bench_v4_vs_transformers.py --write docs/benchmarks.md`"
        replace_section(args.write, table, MARK_BEGIN, MARK_END, heading)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
