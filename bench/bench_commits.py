"""Tiny DeepSeek-V4 prefill and decode of two or more commits, side by side on one machine.

    python bench/bench_commits.py --commits eb8574a,HEAD \\
        --plan decode:16384:128:2,prefill:32768:0:2,prefill:131072:0:1

Each plan item is MODE:TOKENS:DECODE_STEPS:ROUNDS. A commit written `C:torch` runs C with its
native CPU kernels off (`REPLAYKV_NATIVE=0`), e.g. `--commits eb8574a,HEAD:torch,HEAD`. Every
commit other than the working tree (`HEAD` means the working tree) is checked out in a temporary
git worktree; in each round the commits run one after the other, each measurement in its own
child process of that commit's `bench/bench_v4_vs_transformers.py --worker ours` (glibc told to
keep freed memory), on one checkpoint made once. Prints one JSON line per run and a summary (min per commit).
`--system-malloc` runs the children with glibc's default settings instead, which return freed
memory to the system (peaks of the live data rather than of what the allocator keeps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_v4_vs_transformers import make_checkpoint

from replaykv.malloc import MALLOC_ENV

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> dict[str, dict[str, list[dict[str, float]]]]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--commits", default="HEAD")
    ap.add_argument("--plan", default="prefill:32768:0:2")
    ap.add_argument("--system-malloc", action="store_true", help="children without MALLOC_ENV")
    args = ap.parse_args(argv)
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="replaykv-commits-") as tmp:
        trees = {}
        for c in args.commits.split(","):
            commit = c.removesuffix(":torch")
            if commit == "HEAD":
                trees[c] = ROOT
            elif (Path(tmp) / commit).exists():  # C and C:torch share one worktree
                trees[c] = Path(tmp) / commit
            else:
                trees[c] = Path(tmp) / commit
                subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(trees[c]), commit],
                               check=True)  # fmt: skip
        try:
            model_dir = Path(tmp) / "tiny-v4"
            make_checkpoint(model_dir)
            for item in args.plan.split(","):
                mode, n, steps, rounds = item.split(":")
                for r in range(int(rounds)):
                    for c, tree in trees.items():
                        malloc = {} if args.system_malloc else MALLOC_ENV
                        env = {**os.environ, **malloc, "PYTHONPATH": str(tree)}
                        if c.endswith(":torch"):
                            env["REPLAYKV_NATIVE"] = "0"
                        cmd = [sys.executable, str(tree / "bench" / "bench_v4_vs_transformers.py"), "--worker",
                               "ours", str(model_dir), mode, n, steps]  # fmt: skip
                        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
                        if p.returncode != 0:
                            raise SystemExit(f"{c} {item}: {p.stderr[-500:]}")
                        res = json.loads(p.stdout.strip().splitlines()[-1])
                        results.setdefault(f"{mode} {n}", {}).setdefault(c, []).append(res)
                        print(json.dumps({"run": f"{mode} {n}", "round": r, "commit": c, **res}), flush=True)
        finally:
            for tree in set(trees.values()):
                if tree != ROOT:
                    subprocess.run(
                        ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False
                    )
    for run, by_commit in results.items():
        for c, rs in by_commit.items():
            key = "decode_ms_per_token" if run.startswith("decode") else "prefill_s"
            print(f"{run:>16} {c:>10}: min {min(r[key] for r in rs):.3f} ({key}), "
                  f"peak {max(r['peak_bytes'] for r in rs) / 2**30:.2f} GiB")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
