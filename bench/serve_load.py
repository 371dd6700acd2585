"""The server under load: concurrent multi-turn chat sessions against `replaykv serve`, once with
SWA bounded replay on and once with it off (two server processes, one after the other), side by
side in one Markdown table.

Each session sends a shared system prompt plus its own questions, turn after turn, streaming, with
a random think time between turns; the SWA pool TTL is shorter than the longer think times, so
some turns find their window snapshot expired and take the miss path (bounded replay when on, the
exact rebuild when off). Every server listens on its own free loopback port and is stopped at the
end; every run is bounded in time.

    python bench/serve_load.py [--preset small] [--sessions 4] [--turns 4] [--duration 30]
        [--max-tokens 16] [--think 2.0] [--swa-pool-ttl 1.0] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2 as httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import interrupt
from report import replace_section

ROOT = Path(__file__).resolve().parents[1]
MARK_BEGIN = "<!-- serve_load:begin -->"
MARK_END = "<!-- serve_load:end -->"
REPLAY_OFF = ["--disable-encoder-swa-bounded-replay", "--disable-decoder-swa-bounded-replay"]
REPLAY_ON = ["--enable-encoder-swa-bounded-replay", "--enable-decoder-swa-bounded-replay"]
SYSTEM = (
    "You are the replaykv assistant. You answer questions about DeepSeek-V4.1's KV cache: the global "
    "KV kept on device and in the persistent store, the SWA window snapshots in the host pool, and "
    "bounded replay when a snapshot is gone. Keep answers short and precise."
)
WORDS = [
    "window",
    "cache",
    "replay",
    "snapshot",
    "prefix",
    "token",
    "layer",
    "decoder",
    "encoder",
    "store",
    "pool",
    "chunk",
    "tail",
    "hit",
    "miss",
]


@dataclass
class Turn:
    ttft_s: float
    latency_s: float
    completion_tokens: int
    usage: dict[str, Any]


@dataclass
class Run:
    label: str
    turns: list[Turn] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0


class Server:
    """`replaykv serve` in a subprocess on a free loopback port (port 0, read back from its output)."""

    def __init__(self, args: argparse.Namespace, flags: list[str], cache_dir: str) -> None:
        cmd = [sys.executable, "-m", "replaykv", "serve", "--preset", args.preset, "--port", "0",
               "--cache-dir", cache_dir, "--swa-pool-ttl", str(args.swa_pool_ttl), "--log-level", "warning",
               "--max-running-requests", str(args.sessions), *flags]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAYKV_")}
        env["PYTHONPATH"] = str(ROOT)
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
        )
        self.url, self.model = "", ""
        deadline = time.monotonic() + 180
        assert self.proc.stdout is not None
        while time.monotonic() < deadline and not self.model:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the server exited with {self.proc.wait()}")
            if m := re.search(r"serving at (http://\S+)", line):
                self.url = m.group(1)
            if m := re.search(r'model="([^"]+)", messages', line):
                self.model = m.group(1)
        if not self.model:
            self.stop()
            raise RuntimeError("the server did not start within 180 s")

    def stop(self) -> None:
        interrupt(self.proc)


async def one_turn(
    client: httpx.AsyncClient, model: str, messages: list[dict[str, str]], max_tokens: int
) -> Turn:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}  # fmt: skip
    t0 = time.perf_counter()
    ttft, text, n = None, [], 0
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids", [])
                if ids and ttft is None:
                    ttft = time.perf_counter() - t0
                n += len(ids)
                text.append(choice["delta"].get("content") or "")
            usage = chunk.get("usage") or usage
    messages.append({"role": "assistant", "content": "".join(text)})
    return Turn(ttft if ttft is not None else time.perf_counter() - t0, time.perf_counter() - t0, n, usage)


async def session(
    i: int, client: httpx.AsyncClient, model: str, args: argparse.Namespace, deadline: float, run: Run
) -> None:
    rng = random.Random(i)
    while time.monotonic() < deadline:
        messages = [{"role": "system", "content": SYSTEM}]
        for t in range(args.turns):
            if time.monotonic() >= deadline:
                return
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
            messages.append({"role": "user", "content": f"Session {i}, turn {t}: {question}?"})
            try:
                run.turns.append(await one_turn(client, model, messages, args.max_tokens))
            except (RuntimeError, httpx.HTTPError) as e:
                run.errors[type(e).__name__] += 1
                messages.pop()
                await asyncio.sleep(0.5)
            await asyncio.sleep(rng.uniform(0, args.think))


async def load(server: Server, args: argparse.Namespace, label: str) -> Run:
    run = Run(label)
    limits = httpx.Limits(max_connections=args.sessions * 2)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
        t0 = time.monotonic()
        deadline = t0 + args.duration
        await asyncio.gather(
            *(session(i, client, server.model, args, deadline, run) for i in range(args.sessions))
        )
        run.wall_s = time.monotonic() - t0
    return run


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def column(run: Run) -> dict[str, str]:
    ttft = [t.ttft_s * 1000 for t in run.turns]
    prompt = sum(t.usage.get("prompt_tokens", 0) for t in run.turns)
    cached = sum(t.usage.get("prompt_tokens_details", {}).get("cached_tokens", 0) for t in run.turns)
    ext = [t.usage.get("replaykv", {}) for t in run.turns]
    work = sum(e.get("prefill_work", 0) for e in ext)
    full = sum(e.get("full_prefill_work", 0) for e in ext)
    paths = Counter(e.get("path", "?") for e in ext)
    tokens = sum(t.completion_tokens for t in run.turns)
    return {
        "requests (errors)": f"{len(run.turns)} ({sum(run.errors.values())})",
        "TTFT p50 / p95 / p99 (ms)": f"{pct(ttft, 50):.0f} / {pct(ttft, 95):.0f} / {pct(ttft, 99):.0f}",
        "completion tokens / s (all sessions)": f"{tokens / run.wall_s:.1f}" if run.wall_s else "-",
        "cache hit rate (cached / prompt tokens)": f"{cached / prompt:.1%}" if prompt else "-",
        "replayed tokens (sum)": str(sum(e.get("replayed_tokens", 0) for e in ext)),
        "prefill work run / cold (layer·tokens)": f"{work / full:.2f}" if full else "-",
        "paths": ", ".join(f"{p} {n}" for p, n in paths.most_common()),
    }


def table(runs: list[Run], args: argparse.Namespace) -> str:
    cols = [column(r) for r in runs]
    lines = [
        MARK_BEGIN,
        "",
        f"Preset `{args.preset}` (random weights), {args.sessions} concurrent sessions of up to {args.turns} "
        f"chat turns for {args.duration:g} s per server, {args.max_tokens} new tokens a turn (greedy, "
        f"streamed), think time U(0, {args.think:g}) s, SWA pool TTL {args.swa_pool_ttl:g} s; "
        f"{os.cpu_count()} CPU cores, server and load generator on one machine.",
        "",
        "| | " + " | ".join(r.label for r in runs) + " |",
        "|---|" + "---|" * len(runs),
    ]
    for key in cols[0]:
        lines.append(f"| {key} | " + " | ".join(c[key] for c in cols) + " |")
    lines += ["", MARK_END]
    return "\n".join(lines)


def write(path: Path, section: str) -> None:
    heading = "## Serving under load: replay on versus off\n\n`python bench/serve_load.py --write docs/benchmarks.md`"
    replace_section(path, section, MARK_BEGIN, MARK_END, heading)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load per server")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--think", type=float, default=2.0, help="think time between turns: U(0, THINK) s")
    ap.add_argument("--swa-pool-ttl", type=float, default=1.0)
    ap.add_argument("--write", default="")
    args = ap.parse_args()
    runs = []
    for label, flags in (("replay on", REPLAY_ON), ("replay off", REPLAY_OFF)):
        with tempfile.TemporaryDirectory(prefix="serve_load_") as cache_dir:
            server = Server(args, flags, cache_dir)
            try:
                print(f"{label}: {server.model} at {server.url}", flush=True)
                runs.append(asyncio.run(load(server, args, label)))
            finally:
                server.stop()
    section = table(runs, args)
    print(section)
    if args.write:
        write(Path(args.write), section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
