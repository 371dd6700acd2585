"""Rate-limited logging of a component's failures: one line when a kind of failure starts, at
most one per ``every_s`` while it persists (with how many were not logged), one on recovery.

For: tiers that fail many times a second during one outage (Redis down, a full disk) and
must not flood the log, yet must say when trouble starts, that it goes on, and when it ends.
Not for: counting failures (the tiers' :class:`~replaykv.cache.metrics.TierMetrics` do that)
or deciding what a failure means.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["FaultLog"]


@dataclass
class _Open:
    first_at: float
    logged_at: float
    count: int = 1
    unlogged: int = 0


class FaultLog:
    """Failures of one subject (``"Redis SWA pool at redis://…"``), by kind.

    ``failed(kind, message)`` logs at ``level`` when `kind` is not already failing, or when
    ``every_s`` have passed since it was last logged; ``recovered()`` logs one warning naming the
    kinds that were failing and how often, and forgets them. Safe to call from several threads.
    """

    def __init__(
        self,
        logger: logging.Logger,
        subject: str,
        *,
        every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger, self.subject, self.every_s, self._clock = logger, subject, every_s, clock
        self._open: dict[str, _Open] = {}
        self._lock = threading.Lock()

    @property
    def failing(self) -> tuple[str, ...]:
        """The kinds failing now (since their first failure, with no recovery after it)."""
        with self._lock:
            return tuple(sorted(self._open))

    def failed(self, kind: str, message: str, *, level: int = logging.WARNING) -> None:
        now = self._clock()
        with self._lock:
            state = self._open.get(kind)
            if state is None:
                self._open[kind] = _Open(now, now)
                text = f"{self.subject}: {message}"
            elif now - state.logged_at >= self.every_s:
                state.count += 1
                text = (
                    f"{self.subject}: {message} (still failing: {state.count} times in "
                    f"{now - state.first_at:.0f} s, {state.unlogged} not logged)"
                )
                state.logged_at, state.unlogged = now, 0
            else:
                state.count += 1
                state.unlogged += 1
                return
        self.logger.log(level, "%s", text)

    def recovered(self) -> None:
        if not self._open:  # the common case, without the lock
            return
        now = self._clock()
        with self._lock:
            closed, self._open = self._open, {}
        if closed:
            what = ", ".join(f"{kind} ×{s.count}" for kind, s in sorted(closed.items()))
            since = now - min(s.first_at for s in closed.values())
            self.logger.warning("%s: recovered after %.0f s (failures: %s)", self.subject, since, what)
