"""Child processes of the bench scripts (servers they start and stop).

Not for: writing results (``bench/report.py``).
"""

from __future__ import annotations

import signal
import subprocess
from typing import Any


def interrupt(proc: subprocess.Popen[Any], grace_s: float = 60.0) -> None:
    """SIGINT (a server flushes its write-back and exits), SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
