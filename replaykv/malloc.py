"""glibc allocator settings for long numeric runs (training, benchmarks).

glibc keeps what a run frees (no trimming, no per-buffer mappings under 32 MiB), so a step does
not page-fault the buffers the step before it returned. Twelve hits at a 32K prefix (reduced
widths) took 0.94-1.63 s, medians 1.29 s and 1.44 s in two processes without these, and
0.96-1.30 s, median 1.01 s, with them; a training step of 8 × 512 tokens scattered between 3.9
and 8.5 s without them. glibc reads them at start-up only, so a process re-executes itself.
Not for: other allocators (the variables are ignored there).
"""

from __future__ import annotations

import os
import sys

MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
    "MALLOC_TOP_PAD_": str(1 << 30),
}


def keeps_freed_memory() -> bool:
    """Whether this process started with :data:`MALLOC_ENV`."""
    return all(os.environ.get(k) == v for k, v in MALLOC_ENV.items())


def reexec_keeping_freed_memory(argv: list[str] | None = None) -> None:
    """Re-execute this Python process with :data:`MALLOC_ENV` unless it already has it
    (`REPLAYKV_NO_REEXEC=1` leaves the process as it is, e.g. under a debugger)."""
    if keeps_freed_memory() or os.environ.get("REPLAYKV_NO_REEXEC") == "1":
        return
    args = sys.argv if argv is None else argv
    os.execve(sys.executable, [sys.executable, *args], {**os.environ, **MALLOC_ENV})
