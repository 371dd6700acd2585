"""Chaos with figures: concurrent multi-turn sessions through ``replaykv route`` over several
replicas that share one store directory and one Redis Cluster pool, while faults strike one
at a time.

Faults, in order, each with a before / during / after window of load:

    replica_sigkill        a replica serving streams is SIGKILLed, later restarted on its port
    redis_master_kill      a pool master is killed (its replica takes over), later rejoins
    redis_cluster_restart  every pool node is killed and a new, empty cluster starts on the ports
    redis_client_pause     CLIENT PAUSE 3000 ALL on every master
    redis_debug_sleep      DEBUG SLEEP 2 on one master
    same_prefix_writers    the same new prompt sent to two replicas at once, then to a third
    disk_full              the store's file system (a tmpfs) filled to ENOSPC, later freed

Every completion (greedy, streamed) is compared with a cold run of the same messages on a
reference replica (no pool, its store flushed before each request): with replay off, every path
(store hit, pool hit, exact window rebuild) must give the same text, so any difference is a
wrong answer. A stream that a SIGKILLed replica cuts ends without a finish reason: it is
counted as cut (the client sees it end early), and the session sends that turn again. Any other
non-answer is a failure. All processes listen on loopback; every wait is bounded.

    python bench/chaos.py [--replicas 3] [--sessions 6] [--phase 10] [--max-tokens 12]
        [--preset tiny] [--only FAULT,...] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos_deploy import Deployment
from report import replace_section

from replaykv.malloc import reexec_keeping_freed_memory

MARK_BEGIN = "<!-- chaos:begin -->"
MARK_END = "<!-- chaos:end -->"
WORDS = ["window", "cache", "replay", "snapshot", "prefix", "token", "layer", "decoder", "encoder", "store", "pool", "chunk", "tail", "hit", "miss", "replica", "router", "cluster", "master", "failover", "shard", "slot", "disk", "page"]  # fmt: skip


@dataclass
class Record:
    fault: str
    phase: str
    messages: list[dict[str, str]]
    max_tokens: int
    model: str
    outcome: str = "ok"  # ok | cut | failed
    error: str = ""
    content: str = ""
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    path: str = ""
    reference: str | None = None


@dataclass
class Clock:
    """Which fault and phase a request starting now belongs to."""

    model: str = ""
    fault: str = "warmup"
    phase: str = "before"
    stop: bool = False
    records: list[Record] = field(default_factory=list)
    notes: dict[str, list[str]] = field(default_factory=dict)

    def note(self, text: str) -> None:
        self.notes.setdefault(self.fault, []).append(text)


async def send(client: httpx.AsyncClient, url: str, rec: Record) -> Record:
    """One streamed chat completion; fills ``rec`` (never raises)."""
    body = {"model": rec.model, "messages": rec.messages, "max_tokens": rec.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    text: list[str] = []
    finished, started = False, False
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                rec.outcome, rec.error = "failed", f"HTTP {r.status_code}: {r.text[:160]}"
                return rec
            started = True
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"])[:160])
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece and rec.ttft_s is None:
                        rec.ttft_s = time.perf_counter() - t0
                    text.append(piece)
                    finished |= choice.get("finish_reason") is not None
                if usage := chunk.get("usage"):
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                    rec.path = str((usage.get("replaykv") or {}).get("path", ""))
    except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]
    rec.content = "".join(text)
    if not finished:
        rec.outcome = "cut" if started else "failed"
        rec.error = rec.error or "the stream ended without a finish reason"
    return rec


async def session(i: int, client: httpx.AsyncClient, url: str, clock: Clock, args: argparse.Namespace) -> None:
    """Conversations of up to ``--turns`` turns, one after another; a turn that got no answer is
    sent again (as a client would)."""
    rng = random.Random(i)
    conv = 0
    while not clock.stop:
        conv += 1
        opening = " ".join(rng.choice(WORDS) for _ in range(rng.randint(120, 260)))
        messages = [{"role": "system", "content": f"Session {i}.{conv}. Answer briefly."},
                    {"role": "user", "content": opening}]  # fmt: skip
        for _turn in range(args.turns):
            while not clock.stop:
                rec = Record(clock.fault, clock.phase, [dict(m) for m in messages], args.max_tokens, clock.model)
                clock.records.append(await send(client, url, rec))
                if rec.outcome == "ok":
                    break
                await asyncio.sleep(0.2)
            if clock.stop:
                return
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 30)))
            messages += [{"role": "assistant", "content": rec.content}, {"role": "user", "content": question + "?"}]


# ---------------------------------------------------------------------------------------- faults
Fault = Callable[[Deployment, Clock, httpx.AsyncClient, argparse.Namespace], Awaitable[None]]


async def replica_sigkill(d: Deployment, clock: Clock, client: httpx.AsyncClient, args: argparse.Namespace) -> None:
    victim, busy = d.replicas[0], 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # a replica with streams in flight
        counts = await asyncio.gather(*(asyncio.to_thread(r.running) for r in d.replicas))
        busy = max(counts)
        if busy > 0:
            victim = d.replicas[counts.index(busy)]
            break
        await asyncio.sleep(0.05)
    await asyncio.to_thread(victim.sigkill)
    clock.note(f"SIGKILLed {victim.name} with {busy} requests running")
    await asyncio.sleep(args.phase)
    await asyncio.to_thread(victim.start)
    clock.note(f"{victim.name} restarted on its port")


async def redis_master_kill(d: Deployment, clock: Clock, client: httpx.AsyncClient, args: argparse.Namespace) -> None:
    master = (await asyncio.to_thread(d.cluster.masters))[0]
    t0 = time.monotonic()
    await asyncio.to_thread(master.kill)
    await asyncio.to_thread(d.cluster.wait_healthy)
    clock.note(f"killed master {master.address}; the cluster was healthy again after {time.monotonic() - t0:.1f} s")
    await asyncio.sleep(args.phase / 2)
    await asyncio.to_thread(d.cluster.restart, master)
    await asyncio.to_thread(d.cluster.wait_healthy)
    clock.note(f"{master.address} rejoined")


async def redis_cluster_restart(d: Deployment, clock: Clock, client: httpx.AsyncClient, args: argparse.Namespace) -> None:
    t0 = time.monotonic()
    await asyncio.to_thread(d.cluster.kill)
    await asyncio.sleep(args.phase / 2)
    await asyncio.to_thread(d.cluster.restart_empty)
    clock.note(f"all six nodes killed; a new empty cluster was up {time.monotonic() - t0:.1f} s later")
    await asyncio.sleep(args.phase / 2)


async def redis_client_pause(d: Deployment, clock: Clock, client: httpx.AsyncClient, args: argparse.Namespace) -> None:
    for m in await asyncio.to_thread(d.cluster.masters):
        await asyncio.to_thread(m.client().execute_command, "CLIENT", "PAUSE", "3000", "ALL")
    clock.note("CLIENT PAUSE 3000 ALL on the three masters")
    await asyncio.sleep(args.phase)


async def redis_debug_sleep(d: Deployment, clock: Clock, client: httpx.AsyncClient, args: argparse.Namespace) -> None:
    master = (await asyncio.to_thread(d.cluster.masters))[0]
    await asyncio.to_thread(master.client(timeout_s=10).execute_command, "DEBUG", "SLEEP", "2")
    clock.note(f"DEBUG SLEEP 2 on master {master.address}")
    await asyncio.sleep(args.phase)


async def same_prefix_writers(d: Deployment, clock: Clock, client: httpx.AsyncClient, args: argparse.Namespace) -> None:
    rng = random.Random(7)
    third_hits, rounds = 0, 3
    for k in range(rounds):
        text = " ".join(rng.choice(WORDS) for _ in range(300))
        messages = [{"role": "system", "content": f"Shared {k}."}, {"role": "user", "content": text}]
        a, b, c = d.replicas[0], d.replicas[1], d.replicas[-1]
        pair = [Record(clock.fault, clock.phase, messages, args.max_tokens, clock.model) for _ in range(2)]
        clock.records += pair
        await asyncio.gather(send(client, a.url, pair[0]), send(client, b.url, pair[1]))
        third = Record(clock.fault, clock.phase, messages, args.max_tokens, clock.model)
        clock.records.append(await send(client, c.url, third))
        third_hits += third.cached_tokens > 0
    clock.note(f"{rounds} prompts each sent to two replicas at once; a third replica then found the prefix cached {third_hits} of {rounds} times")
    await asyncio.sleep(args.phase / 2)


async def disk_full(d: Deployment, clock: Clock, client: httpx.AsyncClient, args: argparse.Namespace) -> None:
    written = await asyncio.to_thread(d.disk.fill)
    clock.note(f"store file system filled: {written / 2**20:.0f} MiB of filler until ENOSPC")
    await asyncio.sleep(args.phase)
    await asyncio.to_thread(d.disk.free)
    clock.note("filler removed")


FAULTS: dict[str, Fault] = {f.__name__: f for f in (replica_sigkill, redis_master_kill, redis_cluster_restart,
                                                    redis_client_pause, redis_debug_sleep, same_prefix_writers,
                                                    disk_full)}  # fmt: skip


async def drive(d: Deployment, clock: Clock, args: argparse.Namespace, faults: list[str]) -> None:
    limits = httpx.Limits(max_connections=args.sessions * 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        clock.model = (await client.get(d.router.url + "/v1/models")).json()["data"][0]["id"]
        sessions = [asyncio.create_task(session(i, client, d.router.url, clock, args)) for i in range(args.sessions)]
        await asyncio.sleep(args.phase / 2)  # warm-up, not reported
        for name in faults:
            clock.fault, clock.phase = name, "before"
            await asyncio.sleep(args.phase)
            clock.phase = "during"
            if name == "disk_full" and not d.disk.mounted:
                clock.note(f"not run: no tmpfs for the store ({d.disk.why_not})")
            else:
                await FAULTS[name](d, clock, client, args)
            clock.phase = "after"
            await asyncio.sleep(args.phase)
        clock.stop = True
        await asyncio.gather(*sessions)


def check_answers(d: Deployment, clock: Clock) -> None:
    """Each answered request's cold reference, on the reference replica with everything flushed."""
    d.reference.start()
    memo: dict[str, str] = {}
    with httpx.Client(timeout=120) as client:
        for rec in clock.records:
            if rec.outcome != "ok":
                continue
            key = json.dumps([rec.messages, rec.max_tokens])
            if key not in memo:
                d.reference.flush_all()
                r = client.post(d.reference.url + "/v1/chat/completions", json={
                    "model": rec.model, "messages": rec.messages, "max_tokens": rec.max_tokens, "temperature": 0})  # fmt: skip
                r.raise_for_status()
                memo[key] = r.json()["choices"][0]["message"]["content"] or ""
            rec.reference = memo[key]


# ---------------------------------------------------------------------------------------- report
def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))] if s else float("nan")


def row(name: str, recs: list[Record]) -> list[str]:
    by = {p: [r for r in recs if r.phase == p] for p in ("before", "during", "after")}
    ok = [r for r in recs if r.outcome == "ok"]
    wrong = sum(r.reference is not None and r.content != r.reference for r in ok)

    def share(p: str) -> str:
        rs = [r for r in by[p] if r.outcome == "ok"]
        prompt = sum(r.prompt_tokens for r in rs)
        return f"{sum(r.cached_tokens for r in rs) / prompt:.0%}" if prompt else "-"

    def ttft(p: str, q: float) -> str:
        v = [r.ttft_s * 1000 for r in by[p] if r.outcome == "ok" and r.ttft_s is not None]
        return f"{pct(v, q):.0f}" if v else "-"

    checked = sum(r.reference is not None for r in ok)
    paths = Counter(r.path or "?" for r in by["during"] if r.outcome == "ok")
    return [name, " / ".join(str(len(v)) for v in by.values()), str(sum(r.outcome == "cut" for r in recs)), str(sum(r.outcome == "failed" for r in recs)),
            f"{wrong} of {checked}", " / ".join(share(p) for p in by), ", ".join(f"{p} {n}" for p, n in paths.most_common()),
            " / ".join(ttft(p, 50) for p in by), " / ".join(ttft(p, 99) for p in by)]  # fmt: skip


def log_summary(logdir: Path, limit: int = 10) -> list[str]:
    """The replicas' warnings and errors, digits folded, most frequent first: how each tier's
    failure was reported."""
    seen: Counter[str] = Counter()
    for path in sorted(logdir.glob("replica*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if m := re.search(r"\b(WARNING|ERROR|CRITICAL)\b.*", line):
                seen[re.sub(r"\d+(\.\d+)?", "N", m.group(0))[:160]] += 1
    return [f"- {n} × `{text}`" for text, n in seen.most_common(limit)]


def table(clock: Clock, args: argparse.Namespace, faults: list[str], store_note: str, logs: list[str]) -> str:
    head = ["fault", "requests b / d / a", "cut streams", "failed", "wrong answers (of checked)", "cached share before / during / after",
            "paths during", "TTFT p50 (ms) b / d / a", "TTFT p99 (ms) b / d / a"]  # fmt: skip
    lines = [MARK_BEGIN, "",
             f"Preset `{args.preset}` (random weights), {args.replicas} replicas behind `replaykv route` "
             f"(cache_aware), one Redis Cluster pool (3 masters + 3 replicas), one shared store ({store_note}); "
             f"{args.sessions} concurrent sessions of up to {args.turns} turns, {args.max_tokens} new tokens a turn "
             f"(greedy, streamed), replay off so that every path must equal the cold answer; windows of "
             f"{args.phase:g} s before / during / after each fault; {os.cpu_count()} CPU cores for everything.",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    for name in faults:
        lines.append("| " + " | ".join(row(name, [r for r in clock.records if r.fault == name])) + " |")
    lines += ["", "What happened:", ""]
    lines += [f"- `{name}`: " + "; ".join(clock.notes.get(name, ["-"])) + "." for name in faults]
    errors = sorted({r.error for r in clock.records if r.outcome != "ok" and r.fault in faults})
    if errors:
        lines += ["", "Errors seen by clients: " + "; ".join(f"`{e}`" for e in errors[:8]) + "."]
    if logs:
        lines += ["", "Replica logs, warnings and errors (digits as N, the most frequent first):", "", *logs]
    lines += ["", MARK_END]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--phase", type=float, default=10.0, help="seconds of load before, during and after a fault")
    ap.add_argument("--store-mb", type=int, default=48, help="--store-capacity of the replicas (MB)")
    ap.add_argument("--only", default="", help="comma-separated faults (default: all)")
    ap.add_argument("--logs", default="", help="copy every process's log into this directory")
    ap.add_argument("--write", default="")
    args = ap.parse_args()
    if args.replicas < 3:
        ap.error("--replicas must be at least 3 (same_prefix_writers uses three)")
    faults = args.only.split(",") if args.only else list(FAULTS)
    if unknown := [f for f in faults if f not in FAULTS]:
        ap.error(f"unknown faults {unknown}; choose from {', '.join(FAULTS)}")
    reexec_keeping_freed_memory()  # the replicas inherit the allocator settings
    clock = Clock()
    with tempfile.TemporaryDirectory(prefix="chaos_") as tmp:
        d = Deployment(Path(tmp), args.replicas, args.preset, args.store_mb)
        try:
            store_note = f"a {args.store_mb + 16} MiB tmpfs" if d.disk.mounted else "a local directory"
            print(f"router {d.router.url} over {', '.join(r.url for r in d.replicas)}; store on {store_note}", flush=True)
            asyncio.run(drive(d, clock, args, faults))
            for r in d.replicas:
                r.stop()
            print(f"{len(clock.records)} requests; checking answers against cold runs", flush=True)
            check_answers(d, clock)
            logs = log_summary(d.logs)
            if args.logs:
                shutil.copytree(d.logs, args.logs, dirs_exist_ok=True)
        finally:
            d.close()
    section = table(clock, args, faults, store_note, logs)
    print(section)
    if args.write:
        heading = "## Chaos: replicas, a router and faults (bench/chaos.py)\n\n`sudo python bench/chaos.py --write docs/benchmarks.md` (root only to mount the store's tmpfs)"
        replace_section(Path(args.write), section, MARK_BEGIN, MARK_END, heading)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
