"""What a run says on the console: one summary line per step that had something to say, each
confirmed incident on a line of its own, and a rate limit over all of them.

Every verdict kind reaches the console, not only the store: confirmed SDCs, proven corruptions no
device is blamed for, replays that could not judge, non-deterministic segments, NaN/Inf in the data,
rank-outlier warnings and false alarms are counted on the step's line. A storm (thousands of
incidents) must not flood a job's log: lines past the limit are counted and the next line that is
written says how many were held back. The store keeps every record either way.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

from aegis_sdc.events import Incident, Verdict, VerdictKind

log = logging.getLogger("aegis_sdc")

# A token bucket: up to BURST lines at once, refilled at PER_MINUTE lines a minute. 20 at once shows
# the start of a storm in full; 30 a minute keeps an hour of one at 1 800 lines.
BURST = 20
PER_MINUTE = 30.0
# Incidents named on lines of their own per step; the step's summary line counts the rest.
INCIDENT_LINES_PER_STEP = 3

_VERDICT_WORDS = {  # (one, several)
    VerdictKind.CONFIRMED_SDC: ("confirmed SDC", "confirmed SDCs"),
    VerdictKind.UNATTRIBUTED: ("corruption no device is blamed for", "corruptions no device is blamed for"),
    VerdictKind.NOT_VERIFIABLE: ("not verifiable", "not verifiable"),
    VerdictKind.NOT_DETERMINISTIC: ("not deterministic", "not deterministic"),
    VerdictKind.NONFINITE_INPUT: ("NaN/Inf input (from the data)", "NaN/Inf inputs (from the data)"),
    VerdictKind.FALSE_ALARM: ("false alarm", "false alarms"),
}


class RateLimiter:
    """A token bucket over console lines; `clock` is injectable for tests."""

    def __init__(self, burst: int = BURST, per_minute: float = PER_MINUTE,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.burst = burst
        self.rate = per_minute / 60.0
        self.clock = clock
        self.tokens = float(burst)
        self.last = clock()
        self.suppressed = 0  # lines held back since the last one written
        self.suppressed_total = 0

    def allow(self) -> bool:
        now = self.clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        self.suppressed += 1
        self.suppressed_total += 1
        return False

    def take_suppressed(self) -> str:
        """A note for the line being written about the lines held back before it ('' if none)."""
        held, self.suppressed = self.suppressed, 0
        return f" ({held} earlier console line{'s' if held != 1 else ''} held back by the rate limit)" if held else ""


class StepConsole:
    """Writes a step's findings to the `aegis_sdc` logger under one rate limit."""

    def __init__(self, limiter: RateLimiter | None = None) -> None:
        self.limiter = limiter or RateLimiter()

    def emit(self, level: int, message: str) -> bool:
        """Log `message` at `level` if the rate limit allows; False when it was held back."""
        if not log.isEnabledFor(level):
            return False
        if not self.limiter.allow():
            return False
        log.log(level, "aegis-sdc: %s%s", message, self.limiter.take_suppressed())
        return True

    def close(self) -> None:
        """The run's last word on what the rate limit held back (written whatever the limit)."""
        held = self.limiter.suppressed
        if held:
            self.limiter.suppressed = 0
            log.warning("aegis-sdc: %d console line%s held back by the rate limit since the last one written; the "
                        "store has every record (aegis incidents RUN_DIR)", held, "s" if held != 1 else "")  # fmt: skip

    def step(self, step: int, verdicts: Sequence[Verdict], incidents: Sequence[Incident], alarms: int,
             outlier_warnings: int, store_backlog: int = 0) -> None:  # fmt: skip
        """The step's lines: its incidents (a few by name) and one summary of everything it found."""
        for incident in incidents[:INCIDENT_LINES_PER_STEP]:
            self.emit(logging.ERROR, incident.describe())
        kinds = Counter(v.kind for v in verdicts if v.same_fault_as is None)
        order = list(_VERDICT_WORDS)
        parts = [f"{n} {_VERDICT_WORDS[kind][n != 1]}"
                 for kind, n in sorted(kinds.items(), key=lambda item: order.index(item[0]))]  # fmt: skip
        again = sum(v.same_fault_as is not None for v in verdicts)
        if again:  # a backward check or a recomputation that met a confirmed forward's wrong output
            parts.append(f"{again} more finding{'s' if again != 1 else ''} of a confirmed fault")
        if alarms:
            parts.insert(0, f"{alarms} alarm{'s' if alarms != 1 else ''} raised")
        if outlier_warnings:
            parts.append(f"{outlier_warnings} rank-outlier warning{'s' if outlier_warnings != 1 else ''}")
        if len(incidents) > INCIDENT_LINES_PER_STEP:
            parts.append(f"{len(incidents) - INCIDENT_LINES_PER_STEP} more incidents in the store")
        if store_backlog:
            parts.append(f"{store_backlog} record{'s' if store_backlog != 1 else ''} waiting for the store")
        if not parts:
            return
        serious = kinds[VerdictKind.CONFIRMED_SDC] or kinds[VerdictKind.UNATTRIBUTED]
        doubtful = (kinds[VerdictKind.NOT_VERIFIABLE] or kinds[VerdictKind.NOT_DETERMINISTIC]
                    or kinds[VerdictKind.NONFINITE_INPUT] or outlier_warnings or store_backlog)  # fmt: skip
        level = logging.ERROR if serious else logging.WARNING if doubtful else logging.INFO
        self.emit(level, f"step {step}: " + ", ".join(parts))
