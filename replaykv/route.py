"""``replaykv route``: one OpenAI-compatible address in front of several ``replaykv serve`` replicas.

For: sending a session's turns to the replica that holds its SWA window snapshot, spreading
new sessions by load, and moving sessions off a replica that fails. Built on sgl-router
(SGLang's router, in Rust; ``pip install 'replaykv[route]'``), which fits as it is:

* ``--policy cache_aware`` (the default) keeps, per replica, a radix tree of the request texts
  it has served. A request goes to the replica with the longest matching prefix when the match
  covers at least ``--cache-threshold`` of its text, else to the least-loaded replica. A
  conversation's next turn starts with the last one, so it lands where the last turn's window
  snapshot is.
* ``--policy manual`` routes by a session key header instead: the same key, the same replica.
* It health-checks ``/health`` on every replica and passes streams through. The circuit of a
  replica opens at its first failed request (``--cb-failure-threshold 1``), so the router's
  retry of that request goes to another replica: a replica's death costs no request that had
  not reached it yet. (With sgl-router's default of 10 failures, the requests sent to a dead
  replica before its circuit opens get a 500.) A session moved to another replica finds its
  global KV in the shared store (``--store-shared``) and its snapshot in a Redis Cluster pool,
  or replays the window.

Not for: the replicas themselves (``replaykv serve``). sgl-router exports its own metrics on
``--metrics-port`` (its names, not ``replaykv_*``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import urllib.parse

from replaykv.cli_parser import ArgumentParser

__all__ = ["build_parser", "main", "router_argv"]

POLICIES = ("cache_aware", "manual", "power_of_two", "round_robin", "random")


def _replica(text: str) -> str:
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise argparse.ArgumentTypeError(f"a replica is http://HOST:PORT; got {text!r}")
    return text.rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="replaykv route",
        description="An OpenAI-compatible router in front of replaykv serve replicas (sgl-router).",
    )
    p.add_argument("--replica", action="append", type=_replica, required=True, metavar="URL",
                   help="a replica's base URL, e.g. http://127.0.0.1:30000 (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30100, help="port to listen on (default 30100)")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware",
                   help="how a replica is chosen (default cache_aware: the longest matching prefix)")
    p.add_argument("--cache-threshold", type=float, default=0.3,
                   help="cache_aware: the share of a request's text a replica must already hold (default 0.3)")
    p.add_argument("--health-check-interval", type=int, default=5, metavar="SECONDS",
                   help="seconds between health checks of each replica (default 5)")
    p.add_argument("--health-failure-threshold", type=int, default=2,
                   help="failed checks before a replica is taken out (default 2)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="port of sgl-router's Prometheus metrics (default: --port + 1)")
    p.add_argument("--log-level", choices=("debug", "info", "warn", "error"), default="info")
    p.add_argument("--print-command", action="store_true", help="print the sgl-router command and exit")
    return p  # fmt: skip


def router_argv(args: argparse.Namespace) -> list[str]:
    """The ``python -m sglang_router.launch_router`` command for ``args``."""
    if not 0.0 <= args.cache_threshold <= 1.0:
        raise ValueError(f"--cache-threshold must be in [0, 1]; got {args.cache_threshold}")
    metrics = args.metrics_port if args.metrics_port is not None else args.port + 1
    return [
        sys.executable, "-m", "sglang_router.launch_router",
        "--worker-urls", *args.replica,
        "--host", args.host, "--port", str(args.port),
        "--policy", args.policy, "--cache-threshold", str(args.cache_threshold),
        "--health-check-endpoint", "/health",
        "--health-check-interval-secs", str(args.health_check_interval),
        "--health-failure-threshold", str(args.health_failure_threshold),
        # A request whose connection to a replica fails opens that replica's circuit at once, so
        # the router's retry goes to another replica instead of the dead one again.
        "--cb-failure-threshold", "1",
        "--prometheus-host", args.host, "--prometheus-port", str(metrics),
        "--log-level", args.log_level,
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        command = router_argv(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.print_command:
        print(" ".join(command))
        return 0
    if importlib.util.find_spec("sglang_router") is None:
        print("error: sgl-router is not installed: pip install 'replaykv[route]'", file=sys.stderr)
        return 2
    print(f"replaykv: routing http://{args.host}:{args.port} to {', '.join(args.replica)} ({args.policy})", flush=True)
    os.execv(command[0], command)  # the router takes over this process (and its signals)
    return 0  # not reached
