"""Batched decode throughput: replaykv's engine against transformers' `generate` on the same tiny
DeepSeek-V4 config and the same prompts, at batch 1, 8 and 32 with 4K-token contexts.

Decode tokens/s counts only the steps in which every row of the batch decodes, timed token by
token: for transformers, a logits processor stamps the time of each generation step (the first
stamp follows the prefill), so rate = B · (N − 1) / (last stamp − first); for the engine, every
request is streamed and each token stamped as it arrives, the prompts are prefilled in one
engine step (`prefill_token_budget` = B × context, so no row decodes while another prefills),
and rate = tokens stamped after the last row's first token and up to the first row's last token,
over that interval. The engine runs twice: with its default `decode_threads` = 1 and with decode
on torch's thread count (`decode_threads` = 0), side by side. Every measurement runs in its own
child process (a clean allocator); the arms alternate within each repeat; median and min over repeats are printed.

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
import threading
import time
from pathlib import Path
from typing import Any

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
        from transformers import DeepseekV4ForCausalLM, LogitsProcessor, LogitsProcessorList

        class Stamp(LogitsProcessor):
            """Records the time of every generation step; leaves the scores as they are."""

            def __init__(self) -> None:
                self.times: list[float] = []

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                self.times.append(time.perf_counter())
                return scores

        model = DeepseekV4ForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
        ids = torch.tensor(_prompts(batch, context, model.config.vocab_size, seed))
        stamp = Stamp()
        with torch.inference_mode():
            model.generate(ids[:1, :32], max_new_tokens=2, do_sample=False)  # warm-up
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, logits_processor=LogitsProcessorList([stamp]))  # fmt: skip
        t = stamp.times
        return {"decode_s": t[-1] - t[0], "decode_tokens": float(batch * (len(t) - 1))}
    from replaykv.engine.api import Request, SamplingParams
    from replaykv.engine.config import EngineConfig
    from replaykv.engine.engine import Engine

    config = EngineConfig(
        model_dir=model_dir,
        max_batch=batch,
        max_context=context + new + 8,
        store_dir=None,
        swa_pool=None,
        prefill_token_budget=batch * context,
        decode_threads=0 if impl == "ours-torch" else 1,
    )
    engine = Engine(config)
    try:
        prompts = _prompts(batch, context, engine.model.config.vocab_size, seed)
        sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        engine.generate(Request(tuple(prompts[0][:32]), sp))  # warm-up
        sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        stamps: list[list[float]] = [[] for _ in prompts]

        def consume(i: int, handle: Any) -> None:
            for delta in handle:
                stamps[i].extend([time.perf_counter()] * len(delta.token_ids))

        handles = [engine.submit(Request(tuple(p), sp)) for p in prompts]
        threads = [threading.Thread(target=consume, args=(i, h)) for i, h in enumerate(handles)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        engine.shutdown()
    start, end = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    tokens = sum(1 for s in stamps for t in s if start < t <= end)
    if end <= start or tokens == 0:
        raise SystemExit("no interval in which every row decodes")
    return {"decode_s": end - start, "decode_tokens": float(tokens)}


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
                for impl in ("ours", "ours-torch", "hf"):
                    if impl == "hf" and b not in hf_batches:
                        continue
                    seed += 1
                    got = run_child(impl, model_dir, b, args.context, args.new_tokens, seed)
                    if "error" in got:
                        errors[(impl, b)] = str(got["error"])[-300:]
                        continue
                    rate = got["decode_tokens"] / got["decode_s"]
                    rates.setdefault((impl, b), []).append(rate)
                    print(f"repeat {rep} {impl} batch {b}: {rate:.1f} decode tokens/s "
                          f"({got['decode_tokens']:.0f} tokens in {got['decode_s']:.2f} s)", file=sys.stderr, flush=True)  # fmt: skip

    def cell(impl: str, b: int) -> str:
        r = rates.get((impl, b))
        if not r:
            return "failed" if (impl, b) in errors else "not run"
        return f"{statistics.median(r):,.1f} (min {min(r):,.1f})"

    lines = [
        BEGIN,
        "",
        f"Tiny DeepSeek-V4 (`tiny` preset), float32, {os.cpu_count()} CPU cores; {args.context:,}-token prompts, "
        f"{args.new_tokens} greedy tokens each; decode tokens/s over the steps in which every row decodes, "
        f"timed token by token, median (min) over {args.repeats} repeats, each arm in its own process, arms "
        "alternating. replaykv: the engine with `max_batch` = B, the prompts prefilled in one engine step, "
        "store and SWA pool off, decode steps on one intra-op thread (`decode_threads` = 1, the default) "
        f"or on torch's {os.cpu_count()}; transformers: `generate` on the batch, eager attention.",
        "",
        "| batch | replaykv decode tokens/s | replaykv, decode on torch's threads | transformers decode tokens/s | ratio |",
        "|---:|---:|---:|---:|---:|",
    ]
    for b in batches:
        o, h = rates.get(("ours", b)), rates.get(("hf", b))
        ratio = f"{statistics.median(o) / statistics.median(h):.2f}×" if o and h else "—"
        hf = cell("hf", b) if b in hf_batches else "not run (eager prefill memory)"
        lines.append(f"| {b} | {cell('ours', b)} | {cell('ours-torch', b)} | {hf} | {ratio} |")
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
