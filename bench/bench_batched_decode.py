"""Batched decode throughput: replaykv's engine against transformers' `generate` on the same tiny
DeepSeek-V4 config and the same prompts, at batch 1, 8 and 32 with 4K-token contexts.

Decode tokens/s is measured as a difference, so that prefill does not count: each arm runs the
batch once with 1 new token and once with 1 + N (fresh prompts each run, so no prefix is
cached), and decode tokens/s = B · N / (t(1 + N) − t(1)). Every measurement runs in its own
child process (a clean allocator and peak memory); the arms alternate within each repeat; min and
median over repeats are printed.

    python bench/bench_batched_decode.py [--batches 1,8,32] [--hf-batches 1,8] [--context 4096]
        [--new-tokens 32] [--repeats 2] [--write docs/benchmarks.md]

transformers' eager prefill of B × 4,096 tokens holds B × heads × 4,096² attention scores at
once, so batches past --hf-batches are not run for it (the table says so).
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_v4_vs_transformers import make_checkpoint
from report import replace_section

from replaykv.malloc import MALLOC_ENV

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench_batched_decode:begin -->", "<!-- bench_batched_decode:end -->"


def _prompts(batch: int, context: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 256), (batch, context), generator=g).tolist()


def worker(impl: str, model_dir: str, batch: int, context: int, new: int, seed: int) -> dict[str, float]:
    import torch

    torch.manual_seed(0)
    if impl == "hf":
        from transformers import DeepseekV4ForCausalLM

        model = DeepseekV4ForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
        prompts = _prompts(batch, context, model.config.vocab_size, seed)
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            model.generate(ids[:1, :32], max_new_tokens=2, do_sample=False)  # warm-up
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False)  # fmt: skip
            dt = time.perf_counter() - t0
        return {"seconds": dt, "tokens": float((out.shape[1] - context) * batch)}
    from replaykv.engine.api import Request, SamplingParams
    from replaykv.engine.config import EngineConfig
    from replaykv.engine.engine import Engine

    config = EngineConfig(
        model_dir=model_dir, max_batch=batch, max_context=context + new + 8, store_dir=None, swa_pool=None
    )
    engine = Engine(config)
    try:
        prompts = _prompts(batch, context, engine.model.config.vocab_size, seed)
        sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        engine.generate(Request(tuple(prompts[0][:32]), sp))  # warm-up
        sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        handles = [engine.submit(Request(tuple(p), sp)) for p in prompts]
        results = [h.result() for h in handles]
        dt = time.perf_counter() - t0
    finally:
        engine.shutdown()
    return {"seconds": dt, "tokens": float(sum(len(r.token_ids) for r in results))}


def run_child(impl: str, model_dir: Path, batch: int, context: int, new: int, seed: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--worker", impl, str(model_dir), str(batch), str(context), str(new), str(seed)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), **MALLOC_ENV)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:]}  # type: ignore[dict-item]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=6, metavar=("IMPL", "DIR", "B", "CONTEXT", "NEW", "SEED"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--hf-batches", default="1,8")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--write", default="")
    args = ap.parse_args()
    if args.worker:
        impl, d, b, c, n, s = args.worker
        print(json.dumps(worker(impl, d, int(b), int(c), int(n), int(s))))
        return 0
    batches = [int(x) for x in args.batches.split(",")]
    hf_batches = {int(x) for x in args.hf_batches.split(",") if x}
    rates: dict[tuple[str, int], list[float]] = {}
    errors: dict[tuple[str, int], str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny-v4"
        make_checkpoint(model_dir)
        seed = 0
        for rep in range(args.repeats):
            for b in batches:
                for impl in ("ours", "hf"):
                    if impl == "hf" and b not in hf_batches:
                        continue
                    seed += 1
                    one = run_child(impl, model_dir, b, args.context, 1, seed)
                    seed += 1
                    full = run_child(impl, model_dir, b, args.context, 1 + args.new_tokens, seed)
                    if "error" in one or "error" in full:
                        errors[(impl, b)] = str(one.get("error") or full.get("error"))[-300:]
                        continue
                    rate = b * args.new_tokens / max(1e-9, full["seconds"] - one["seconds"])
                    rates.setdefault((impl, b), []).append(rate)
                    print(f"repeat {rep} {impl} batch {b}: {rate:.1f} decode tokens/s "
                          f"(t(1) {one['seconds']:.1f} s, t(1+N) {full['seconds']:.1f} s)", file=sys.stderr, flush=True)  # fmt: skip

    def cell(impl: str, b: int) -> str:
        r = rates.get((impl, b))
        if not r:
            return "failed" if (impl, b) in errors else "not run"
        return f"{statistics.median(r):,.1f} (min {min(r):,.1f})"

    lines = [
        BEGIN,
        "",
        f"Tiny DeepSeek-V4 (`tiny` preset), float32, {os.cpu_count()} CPU cores; {args.context:,}-token prompts, "
        f"{args.new_tokens} greedy tokens each; decode tokens/s = B · N / (t(1 + N) − t(1)), median (min) over "
        f"{args.repeats} repeats, each arm in its own process, arms alternating. replaykv: the engine with "
        "`max_batch` = B (continuous batching, store and SWA pool off); transformers: `generate` on the "
        "batch, eager attention.",
        "",
        "| batch | replaykv decode tokens/s | transformers decode tokens/s | ratio |",
        "|---:|---:|---:|---:|",
    ]
    for b in batches:
        o, h = rates.get(("ours", b)), rates.get(("hf", b))
        ratio = f"{statistics.median(o) / statistics.median(h):.2f}×" if o and h else "—"
        hf = cell("hf", b) if b in hf_batches else "not run (eager prefill memory)"
        lines.append(f"| {b} | {cell('ours', b)} | {hf} | {ratio} |")
    lines += ["", END]
    table = "\n".join(lines)
    print(table)
    for k, v in errors.items():
        print(f"error {k}: {v}", file=sys.stderr)
    if args.write:
        replace_section(args.write, table, BEGIN, END,
                        "## Batched decode (bench/bench_batched_decode.py)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
