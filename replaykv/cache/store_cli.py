"""``replaykv store stats|verify|gc``: inspect and maintain a global-KV store directory.

For: operators and tests: print the store's counters, check every entry's digest (and
optionally quarantine bad ones), apply retention and a capacity bound offline. The main
CLI dispatches ``replaykv store ...`` to :func:`main`.

Not for: serving, or writing entries. ``stats`` and ``verify`` without ``--quarantine``
open the store read-only (nothing on disk changes); ``verify --quarantine`` and ``gc``
also sweep orphaned temp files, as any writable open does. Run those while no engine
writes to the directory, or accept that the engine sees some entries vanish (a miss).

``stats`` of a pack store also prints the damage its scan found: ``cut_batches`` (packs ending in
a batch a crash cut short: not damage), ``corrupt_batches`` (damaged batches with intact ones
kept around them), ``corrupt_packs`` (packs with no batch that checks out) and ``missing_packs``
(packs their ``.idx`` lists that are gone).

Exit status: 0 success, 1 ``verify`` found bad entries, damaged batches or missing packs, 2 usage
error or no store there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from replaykv.cache.stores import detect_format, make_store
from replaykv.cli_parser import ArgumentParser
from replaykv.engine.config import default_store_dir

__all__ = ["main"]

_UNBOUNDED = 1 << 62
_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _size(text: str) -> int:
    """``123``, ``64K``, ``10G``, ``1.5T`` (binary units) → bytes."""
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = raw[-1:] if raw[-1:] in _SUFFIXES else ""
    number = raw[: -len(unit)] if unit else raw
    try:
        value = int(float(number) * _SUFFIXES[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 500G, 1T, 123456)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0: {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    common = ArgumentParser(add_help=False)
    common.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(default_store_dir()),
        help="the store's root directory (default: the one `replaykv serve` uses, %(default)s)",
    )
    common.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser = ArgumentParser(
        prog="replaykv store", description="Inspect and maintain a global-KV store."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("stats", parents=[common], help="entries, bytes, quarantine and temp files")
    verify = sub.add_parser(
        "verify",
        parents=[common],
        help="check every entry's header and payload digest (and, for packs, every batch and that no pack is missing)",
    )
    verify.add_argument("--quarantine", action="store_true", help="move bad entries to quarantine/")
    gc = sub.add_parser("gc", parents=[common], help="apply retention and capacity, purge old quarantine")
    gc.add_argument(
        "--capacity-bytes", type=_size, default=None, help="evict oldest-accessed above this (e.g. 500G)"
    )
    gc.add_argument(
        "--retention-hours", type=float, default=72.0, help="expire entries idle longer (default 72)"
    )
    return parser


def _emit(result: dict[str, object], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2, sort_keys=True, default=str))
        return
    for name, value in result.items():
        if isinstance(value, dict):
            inner = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
            print(f"{name}: {inner}")
        elif isinstance(value, list):
            print(f"{name}: {len(value)}")
            for item in value:
                print(f"  {item}")
        else:
            print(f"{name}: {value}")


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse already printed the message
        return exc.code if isinstance(exc.code, int) else 2
    root: Path = args.cache_dir
    try:
        fmt = detect_format(root)
    except ValueError as exc:
        print(f"replaykv store: {exc}", file=sys.stderr)
        return 2
    if fmt is None:
        print(
            f"replaykv store: no store at {root} (expected {root / 'packs'} or {root / 'entries'})",
            file=sys.stderr,
        )
        return 2

    if args.command == "stats":
        store = make_store(fmt, root, _UNBOUNDED, retention_s=None, read_only=True)
        stats = store.stats()
        result = {"format": fmt} | {
            k: stats[k]
            for k in (
                "root",
                "entries",
                "bytes_resident",
                "quarantine_files",
                "temp_files_seen",
                "unknown_files",
                "cut_batches",
                "corrupt_batches",
                "corrupt_packs",
                "missing_packs",
                "oldest_access",
                "newest_access",
            )
            if k in stats
        }
        _emit(result, args.json)
        return 0

    if args.command == "verify":
        store = make_store(fmt, root, _UNBOUNDED, retention_s=None, read_only=not args.quarantine)
        report = store.verify(quarantine=args.quarantine)
        _emit(
            {
                "checked": report.checked,
                "ok": report.ok,
                "bytes_checked": report.bytes_checked,
                "bad_count": len(report.bad),
                "quarantined": report.quarantined,
                "bad": [{"file": name, "reason": reason} for name, reason in report.bad],
            },
            args.json,
        )
        return 1 if report.bad else 0

    capacity = args.capacity_bytes or _UNBOUNDED
    if args.retention_hours <= 0:
        print("replaykv store gc: --retention-hours must be > 0", file=sys.stderr)
        return 2
    store = make_store(fmt, root, capacity, retention_s=args.retention_hours * 3600)
    before = store.stats()
    gc_report = store.gc()
    after = store.stats()
    _emit(
        {
            "expired": gc_report.expired,
            "evicted": gc_report.evicted,
            "bytes_freed": gc_report.bytes_freed,
            "quarantine_purged": gc_report.quarantine_purged,
            "orphans_swept": store.orphans_swept,
            "entries_before": before["entries"],
            "entries_after": after["entries"],
            "bytes_resident_after": after["bytes_resident"],
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
