"""Starting a training job's processes on this machine and reading back process 0's report.

For: the multi-process modes of `replaykv train` (pipeline stages, the contrastive stage) when
no launcher (torchrun) started them: a free loopback port, one spawned process per rank with
RANK / WORLD_SIZE set, the failing process's own error (its last line) instead of the
spawner's wrapper, and the JSON report process 0 wrote. Not for: what the processes compute.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from replaykv.cache.redis_local import free_port

__all__ = ["free_port", "spawn"]


def _entry(rank: int, worker: Callable[[int, Any], Any], args: Any, processes: int) -> None:
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(processes)
    worker(rank, args)


def spawn(
    worker: Callable[[int, Any], Any],
    args: Any,
    processes: int,
    report: Path,
    error: Callable[[str], Exception],
    what: str,
) -> dict[str, Any] | None:
    """Run `worker(rank, args)` in `processes` spawned processes (a module-level function: it is
    pickled by name) and return the JSON `report` process 0 wrote (None if it wrote none). A
    failure raises `error("<what> <rank>: <its last line>")`."""
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    report.unlink(missing_ok=True)
    try:
        mp.spawn(_entry, args=(worker, args, processes), nprocs=processes, join=True)
    except mp.ProcessRaisedException as e:
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        raise error(f"{what} {e.error_index}: {lines[-1] if lines else e}") from e
    return json.loads(report.read_text()) if report.exists() else None
