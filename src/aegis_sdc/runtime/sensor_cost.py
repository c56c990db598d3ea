"""What the state sensors cost, measured while they run, and the cadence an overhead budget lets
them keep.

The replica vote, the optimizer-update replay and the peer replay (sensors/state_vote.py,
sensors/update_replay.py, distributed/peer_replay.py) each fire on some steps: the vote every step,
a replay slice every `UpdateReplayConfig.every`, a peer replay every
`DistributedConfig.peer_replay_period`. Each firing is timed between two events recorded on the
device's stream around its work (runtime/timing.py). When the device runs behind the host the interval is the firing's
device work; when the host runs behind (the device waits for the launches) it is the host's time —
what the firing adds to the step either way. Intervals are read without waiting, once the device has
passed their closing event; on the CPU the wall clock times them.

A sensor's cost per step is its median cost per firing (over its last `KEEP` firings) divided by
its period. Under `SamplingConfig.budget` the sensors are paid from the budget first, up to
`SENSOR_SHARE` of it (runtime/budget.py hands the rest to the GEMM and attention checks). When their
cost at the configured periods exceeds that share, every sensor's period is stretched by one integer
factor — the smallest that fits, at most `MAX_STRETCH` (a floor of coverage, like the sites'
rotation floor) — so that the budget, not a fixed constant, chooses how often they fire. Under data
parallelism the ranks must fire on the same steps (the vote and the peer replay are collective):
each rank proposes its factor in the step's exchange and all adopt the largest, from the next step on.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from aegis_sdc.runtime.timing import DeviceIntervals

SENSOR_SHARE = 0.5  # of the budget, at most, for the state sensors; the rest buys op checks
MAX_STRETCH = 16  # the longest a sensor's period grows under a budget: ×16
KEEP = 16  # firings per sensor whose cost is remembered


@dataclass(frozen=True)
class SensorCost:
    """One sensor's measured cost, for the summary and the budget's log line."""

    ms_per_firing: float | None  # None: not fired (or not timed) yet
    period_steps: int  # fires every this many steps (the configured period × the stretch in force)
    firings_timed: int

    @property
    def ms_per_step(self) -> float:
        return (self.ms_per_firing or 0.0) / self.period_steps

    def to_dict(self) -> dict[str, float | int | None]:
        return {"ms_per_firing": self.ms_per_firing, "period_steps": self.period_steps,
                "ms_per_step": self.ms_per_step, "firings_timed": self.firings_timed}  # fmt: skip


class SensorClock:
    """Times the sensors' firings (see the module docstring). A firing may be several spans (the
    update replay copies its inputs before the update and replays after it): spans of one sensor at
    one step add up."""

    def __init__(self, device: torch.device) -> None:
        self._intervals = DeviceIntervals(device)
        self._ms: dict[str, dict[int, float]] = {}  # sensor → step → ms of its spans read so far
        self._timed: dict[str, int] = {}

    def begin(self, sensor: str, step: int) -> tuple:
        """A span of `sensor`'s firing at `step` starts (on the current stream)."""
        return (sensor, step, self._intervals.mark())

    def end(self, span: tuple) -> None:
        sensor, step, start = span
        self._intervals.add(start, self._intervals.mark(), (sensor, step))
        self.poll()

    def poll(self) -> None:
        """Take the spans the device has finished."""
        for (sensor, step), ms in self._intervals.finished():
            steps = self._ms.setdefault(sensor, {})
            if step not in steps:
                self._timed[sensor] = self._timed.get(sensor, 0) + 1
                if len(steps) >= KEEP:
                    del steps[min(steps)]
            steps[step] = steps.get(step, 0.0) + ms

    def ms_per_firing(self, sensor: str) -> float | None:
        """The median cost of the sensor's recent firings (the newest left out while older ones are
        known: its later spans may still be on the device)."""
        self.poll()
        steps = self._ms.get(sensor)
        if not steps:
            return None
        values = [ms for step, ms in steps.items() if step != max(steps)] or list(steps.values())
        return statistics.median(values)

    def cost(self, sensor: str, period_steps: int) -> SensorCost:
        return SensorCost(self.ms_per_firing(sensor), period_steps, self._timed.get(sensor, 0))


def stretch_for(ms_per_step_at_base: float, allowed_ms: float) -> int:
    """The smallest integer factor on every sensor's period that keeps their cost per step within
    `SENSOR_SHARE` of `allowed_ms` (1 when it fits; at most `MAX_STRETCH`)."""
    share = SENSOR_SHARE * allowed_ms
    if ms_per_step_at_base <= share:
        return 1
    if share <= 0:
        return MAX_STRETCH
    return min(MAX_STRETCH, math.ceil(ms_per_step_at_base / share))
