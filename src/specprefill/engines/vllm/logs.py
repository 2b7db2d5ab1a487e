"""Warnings a client can cause once per request (a prompt the speculator cannot read, a failed background prefill),
written at most once per cause and interval: a client sending many such requests cannot flood the server's log. The
next line of a cause says how many were held back since the last."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable

INTERVAL_S = 60.0
_ALL: weakref.WeakSet[Throttled] = weakref.WeakSet()


class Throttled:
    """`warning(cause, message, *args)`: logged when the cause's last line is `interval_s` old or more (or none
    was written), else counted; the cause is a short fixed name ("past window"), never text a client sent."""

    def __init__(
        self, log: logging.Logger, interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.log, self.interval_s, self.clock = log, interval_s, clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        _ALL.add(self)

    def forget(self) -> None:
        """As new: every cause may log at once again."""
        self._last.clear()
        self._held.clear()

    def warning(self, cause: str, message: str, *args) -> bool:
        """Log one line of `cause` unless one was logged within the interval; whether it was logged."""
        now = self.clock()
        last = self._last.get(cause)
        if last is not None and now - last < self.interval_s:
            self._held[cause] = self._held.get(cause, 0) + 1
            return False
        held = self._held.pop(cause, 0)
        self._last[cause] = now
        suffix = (
            f" ({held} more like it in the last {now - last:.0f} s not logged)" if held and last is not None else ""
        )
        self.log.warning(message + suffix, *args)
        return True


def forget_all() -> None:
    """Every throttle as new (tests: a cause logged by one test does not silence it in the next)."""
    for throttle in list(_ALL):
        throttle.forget()
