"""The engine's health: alive and making progress, stuck (watchdog), dead (a fault), stopped.

The engine loop marks the start and end of every step (``step_started`` / ``step_done``);
a step runs one forward (with overlap: submits one and waits for the previous), so a step that
has not ended after ``watchdog_timeout`` seconds means no forward finished while work was
pending. A fault in the engine itself is recorded once (``die``) and never cleared.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

OK, STUCK, DEAD, STOPPED = "ok", "stuck", "dead", "stopped"


@dataclass(slots=True)
class HealthReport:
    status: str  # ok | stuck | dead | stopped
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK


class EngineHealth:
    """Written by the engine thread, read from any thread (single attribute reads)."""

    def __init__(self, watchdog_timeout: float) -> None:
        self.watchdog_timeout = watchdog_timeout
        self.error: BaseException | None = None
        self.stopped = False
        self._step_since: float | None = None
        self.last_step_end = time.monotonic()

    def step_started(self) -> None:
        self._step_since = time.monotonic()

    def step_done(self) -> None:
        self.last_step_end = time.monotonic()
        self._step_since = None

    def die(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc

    def report(self) -> HealthReport:
        if self.error is not None:
            return HealthReport(DEAD, f"engine failed: {type(self.error).__name__}: {self.error}")
        if self.stopped:
            return HealthReport(STOPPED, "engine shut down")
        since = self._step_since
        if since is not None:
            waited = time.monotonic() - since
            if waited > self.watchdog_timeout:
                return HealthReport(
                    STUCK,
                    f"no forward finished for {waited:.0f} s with work pending "
                    f"(--watchdog-timeout {self.watchdog_timeout:g})",
                )
        return HealthReport(OK)
