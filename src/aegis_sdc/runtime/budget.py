"""Sampling to an overhead budget (AEGIS §6): which sites to check, and how often, for a step that
may grow by at most `budget` × its unprotected time.

Given per site (a GEMM site, or an attention module: forward and backward of a call together) its
FLOPs per call f, calls per step c and the measured cost of one check e (ms, ops/cost.py), choose
probabilities p to maximize the checked FLOPs Σ p·c·f subject to
Σ p·c·e ≤ budget × step time and p_floor ≤ p ≤ cap. That is a fractional knapsack: after every
site's rotation floor (checked about once per `rotation_steps` steps), sites are raised to their
cap in order of FLOPs per millisecond of check, the last one partly. If even the floors do not fit,
all floors shrink alike. The step time the budget is a fraction of is measured on steps run without
sampling (`BudgetController`), and what the plan really cost corrects the cost model each cycle, as
far as the step times' noise resolves it (`resolved_cost_ratio`). The state sensors (replica vote,
update replay, peer replay) are paid first, from their measured cost, up to a share of the budget
that stretches their periods when they cost more (runtime/sensor_cost.py).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np
import torch

from aegis_sdc.runtime.sensor_cost import stretch_for
from aegis_sdc.runtime.timing import DeviceIntervals


@dataclass(frozen=True)
class BudgetPlan:
    probabilities: np.ndarray  # [sites]
    allowed_ms: float  # checking time the plan may spend per step
    expected_ms: float  # what it is expected to spend
    checked_flops_fraction: float  # expected share of the planned FLOPs (GEMM sites, attention modules) checked


def plan_budget(
    flops: np.ndarray, calls: np.ndarray, cost_ms: np.ndarray, caps: np.ndarray, *, allowed_ms: float,
    rotation_steps: int,
) -> BudgetPlan:  # fmt: skip
    """Probabilities per site (all arrays [sites]; see the module docstring)."""
    calls = np.maximum(calls, 1.0)
    per_step_cost = calls * cost_ms  # ms if the site were checked at every call
    floor = np.minimum(caps, 1.0 / (rotation_steps * calls))
    floor_ms = float((floor * per_step_cost).sum())
    if floor_ms > allowed_ms:
        p = floor * (allowed_ms / floor_ms if floor_ms > 0 else 0.0)
    else:
        p = floor.copy()
        left = allowed_ms - floor_ms
        value = np.where(per_step_cost > 0, calls * flops / np.maximum(per_step_cost, 1e-12), np.inf)
        for site in np.argsort(-value, kind="stable"):
            room = caps[site] - p[site]
            if room <= 0:
                continue
            if per_step_cost[site] <= 0:
                p[site] = caps[site]  # a free check (measured no slower): take it
                continue
            take = min(room, left / per_step_cost[site])
            if take <= 0:
                break
            p[site] += take
            left -= take * per_step_cost[site]
    total = float((calls * flops).sum())
    checked = float((p * calls * flops).sum())
    return BudgetPlan(p, allowed_ms, float((p * per_step_cost).sum()), checked / total if total else 0.0)


class StepTimer:
    """Step times from events recorded at each step's start, read without waiting: an interval is
    taken once the GPU has passed its closing event (CUDA), or from the wall clock (CPU). Each
    interval carries the tag given when it began."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._intervals = DeviceIntervals(device)
        self._last: tuple[object, str] | None = None
        self.times_ms: dict[str, list[float]] = {}

    def mark(self, tag: str) -> None:
        """A step begins (and the previous one ends); `tag` names the kind of the step beginning."""
        now = self._intervals.mark()
        if self._last is not None:
            self._intervals.add(self._last[0], now, self._last[1])  # the previous step, under its tag
        self._last = (now, tag)
        self.poll()

    def poll(self) -> None:
        """Take the intervals the device has finished."""
        for kind, ms in self._intervals.finished():
            self.times_ms.setdefault(kind, []).append(ms)

    def take(self, tag: str) -> list[float]:
        """The finished intervals of this kind, forgotten once taken."""
        return self.times_ms.pop(tag, [])


def resolved_cost_ratio(busy_ms: list[float], quiet_ms: list[float], expected_ms: float) -> float:
    """What a cycle's checks really cost against what the plan expected, as far as the step times
    resolve it: the measured cost is the difference of two medians (steps under the plan, quiet
    steps), and a 1% budget is ~1.6 ms of a step whose times spread by ±2–3 ms. So the ratio moves
    only to the edge of its ~95% interval (two standard errors; a median's is √(π/2)·σ/√n), and stays
    1 when the interval holds 1. Measured on the H200: the bare ratio from 3 quiet steps halved the
    cost model once (its clip at 0.5), and the plan then spent 2.3% of the step at a 1% budget."""
    spent = statistics.median(busy_ms) - statistics.median(quiet_ms)
    noise = sum(
        (math.pi / 2) * statistics.variance(t) / len(t) if len(t) > 1 else math.inf for t in (busy_ms, quiet_ms)
    )
    low, high = (spent - 2 * math.sqrt(noise)) / expected_ms, (spent + 2 * math.sqrt(noise)) / expected_ms
    if low > 1.0:
        return low
    if high < 1.0:
        return max(high, 0.0)
    return 1.0


QUIET_STEPS = 3  # steps run without sampling to measure the step itself, before each plan
QUIET_EXTRA = 10  # more quiet steps, at most, while the device has not finished the first ones
# Saved-tensor fingerprints sample whole steps, and such a step costs tens of milliseconds on a large
# model (a Python pack/unpack hook and two reads per saved tensor): at most this share of the budget
# goes to them; the rest buys GEMM and attention checks, which cover the most FLOPs per millisecond.
SAVED_SHARE = 0.2


@dataclass
class BudgetController:
    """When to plan, and from what: a cycle of `QUIET_STEPS` unsampled steps (the step's own time)
    followed by `replan_steps` steps under the plan (its real cost). The cost model — each site's
    timed check cost — is scaled by what the last cycle actually cost against what the plan
    expected, so that costs the micro-timings miss (caches, the step-end work) are paid for from
    the budget too.

    Saved-tensor fingerprints (`saved_probability` > 0: the configured share of steps) are paid from
    the same budget: the first cycle ends its quiet steps with one "probe" step that fingerprints the
    saved tensors and checks nothing else; its time over the quiet steps' is a saved step's cost, and
    the plan lowers the share of such steps until they spend at most SAVED_SHARE of the budget (none
    until that cost is known)."""

    budget: float
    rotation_steps: int
    replan_steps: int
    timer: StepTimer
    saved_probability: float = 0.0  # configured share of steps whose saved tensors are fingerprinted
    plan: BudgetPlan | None = None
    scale: float = 1.0  # measured / predicted cost of the last cycle, compounded
    base_ms: float | None = None
    saved_cost_ms: float | None = None  # what a saved-tensor step adds (the probe's time over quiet)
    saved_planned: float | None = None  # the share of saved-tensor steps the plan allows
    sensor_stretch: int = 1  # the factor on the state sensors' periods this rank proposes (sensor_cost.py)
    sensors_ms: float = 0.0  # what the state sensors are expected to spend per step at that factor
    _phase: str = "calibrating"
    _left: int = 0
    _probed: bool = False  # the one probe step ran (its time may reach a later replan: the device's pace)

    def step_begins(self, calibrating: bool) -> str:
        """The kind of the step beginning: "calibrating", "quiet" (no sampling), "probe" (saved
        tensors only) or "busy" (the plan)."""
        self.timer.poll()
        if calibrating:
            phase = "calibrating"
        elif self._phase == "calibrating" or (self._phase == "busy" and self._left <= 0):
            phase, self._left = "quiet", QUIET_STEPS
        elif self._phase == "quiet" and self._left <= 0:
            # Quiet steps read no evidence, so the host may run ahead of the device: stay quiet
            # until one of them is timed (the plan needs the step's own time).
            if not self.timer.times_ms.get("quiet") and self._left > -QUIET_EXTRA:
                phase = "quiet"
            elif self.saved_probability > 0 and not self._probed:
                phase, self._left, self._probed = "probe", 1, True
            else:
                phase, self._left = "busy", self.replan_steps
        elif self._phase == "probe":
            phase, self._left = "busy", self.replan_steps
        else:
            phase = self._phase
        self._left -= 1
        self._phase = phase
        self.timer.mark(phase)
        return phase

    def due(self) -> bool:
        """Whether the quiet steps of this cycle are measured: time to (re)plan."""
        return self._phase == "busy" and self._left == self.replan_steps - 1

    def describe_saved(self) -> str:
        """The plan's saved-tensor steps, for its log line ("" without saved-tensor fingerprints)."""
        if self.saved_planned is None:
            return ""
        if self.saved_cost_ms is None:
            return ", saved tensors in no step until the probe step is timed"
        return f", saved tensors in {self.saved_planned:.2%} of steps (a {self.saved_cost_ms:.1f} ms step)"

    def describe_sensors(self) -> str:
        """The state sensors' share of the plan, for its log line ("" when they cost nothing yet)."""
        if self.sensors_ms <= 0:
            return ""
        every = f", their periods ×{self.sensor_stretch}" if self.sensor_stretch > 1 else ""
        return f", state sensors {self.sensors_ms:.2f} ms per step{every}"

    def replan(self, flops, calls, cost_ms, caps, sensors_ms_at_base: float = 0.0) -> BudgetPlan | None:
        """The next plan (None until a quiet step is timed). `sensors_ms_at_base`: the state sensors'
        measured cost per step at their configured periods, paid before the op checks."""
        quiet, busy, probe = self.timer.take("quiet"), self.timer.take("busy"), self.timer.take("probe")
        if not quiet:
            return None
        base = statistics.median(quiet)
        if probe:
            self.saved_cost_ms = max(0.0, statistics.median(probe) - base)
        allowed = self.budget * base
        saved_ms = 0.0
        if self.saved_probability > 0 and self.saved_cost_ms is None:
            self.saved_planned = 0.0  # no saved-tensor steps until the probe's cost is known
        elif self.saved_probability > 0:
            affordable = SAVED_SHARE * allowed / self.saved_cost_ms if self.saved_cost_ms > 0 else 1.0
            self.saved_planned = min(self.saved_probability, affordable)
            saved_ms = self.saved_planned * self.saved_cost_ms
        if self.plan is not None and busy and self.plan.expected_ms > 0:
            ratio = resolved_cost_ratio(busy, quiet, self.plan.expected_ms)
            self.scale = float(np.clip(self.scale * np.clip(ratio, 0.5, 4.0), 0.25, 16.0))
        self.sensor_stretch = stretch_for(sensors_ms_at_base, allowed)
        self.sensors_ms = sensors_ms_at_base / self.sensor_stretch
        self.base_ms = base
        left = max(0.0, allowed - saved_ms - self.sensors_ms)
        self.plan = plan_budget(flops, calls, cost_ms * self.scale, caps, allowed_ms=left,
                                rotation_steps=self.rotation_steps)  # fmt: skip
        return self.plan
