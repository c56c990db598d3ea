"""Sampling to an overhead budget (AEGIS §6): which sites to check, and how often, for a step that
may grow by at most `budget` × its unprotected time.

Given per site (a GEMM site, or an attention module: forward and backward of a call together) its
FLOPs per call f, calls per step c and the measured cost of one check e (ms, ops/cost.py), choose
probabilities p to maximize the checked FLOPs Σ p·c·f subject to
Σ p·c·e ≤ budget × step time and p_floor ≤ p ≤ cap. That is a fractional knapsack: after every
site's rotation floor (checked about once per `rotation_steps` steps), sites are raised to their
cap in order of FLOPs per millisecond of check, the last one partly. If even the floors do not fit,
all floors shrink alike. The step time the budget is a fraction of is measured on steps run without
sampling (`BudgetController`), and what the plans really cost corrects the cost model each cycle,
as far as the step times' noise over the last cycles resolves it (`resolved_multiplier`). The state
sensors (replica vote, update replay, peer replay) are paid first, from their measured cost, up to a
share of the budget that stretches their periods when they cost more (runtime/sensor_cost.py).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

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


def cycle_cost(busy_ms: list[float], quiet_ms: list[float]) -> tuple[float, float]:
    """What one cycle's checks cost per step as its step times tell it: the difference of two medians
    (steps under the plan, quiet steps) and that difference's variance (a median's is (π/2)·σ²/n;
    infinite where one step alone leaves the spread unknown)."""
    spent = statistics.median(busy_ms) - statistics.median(quiet_ms)
    variance = sum(
        (math.pi / 2) * statistics.variance(t) / len(t) if len(t) > 1 else math.inf for t in (busy_ms, quiet_ms)
    )
    return spent, variance


def resolved_multiplier(cycles: list[tuple[float, float, float]], current: float) -> float:
    """The cost model's multiplier — real cost ÷ the timed cost model — from recent cycles (spent ms,
    its variance, the plan's expected ms before any multiplier), as far as their step times resolve
    it: pooled, Σ spent ÷ Σ expected with variance Σ var ÷ (Σ expected)², moved only to the edge of its
    ~95% interval (two standard errors) and not at all while that interval holds `current`. A 1%
    budget is ~1.6 ms of a step whose times spread by ±2–3 ms, so one cycle alone resolves only a
    model that is off by twice or more; on the H100 at 7895cc7 a plan whose steps cost ~1.7× its model
    over the quiet ones stayed unresolved cycle after cycle and the 1% budget spent 2.2% (later runs
    spent 0.4–1.0% over their quiet steps, docs/hot-path.md). Pooling the last cycles narrows the
    interval as √cycles. Measured on the H200 before: the bare ratio from 3 quiet steps halved the
    cost model once, and the plan then spent 2.3% of the step."""
    known = [(s, v, e) for s, v, e in cycles if math.isfinite(v) and e > 0]
    if not known:
        return current
    expected = sum(e for _, _, e in known)
    multiplier = sum(s for s, _, _ in known) / expected
    half = 2 * math.sqrt(sum(v for _, v, _ in known)) / expected
    if multiplier - half > current:
        return multiplier - half
    if multiplier + half < current:
        return max(multiplier + half, 0.0)
    return current


POOLED_CYCLES = 8  # cycles the cost model's multiplier is measured over (the real cost may drift: no more)
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
    timed check cost — is scaled by what the last cycles actually cost against what their plans
    expected (`resolved_multiplier`), so that costs the micro-timings miss (caches, the step-end
    work) are paid for from the budget too.

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
    scale: float = 1.0  # the cost model's multiplier: real ÷ timed cost, over the last POOLED_CYCLES cycles
    base_ms: float | None = None
    saved_cost_ms: float | None = None  # what a saved-tensor step adds (the probe's time over quiet)
    saved_planned: float | None = None  # the share of saved-tensor steps the plan allows
    sensor_stretch: int = 1  # the factor on the state sensors' periods this rank proposes (sensor_cost.py)
    sensors_ms: float = 0.0  # what the state sensors are expected to spend per step at that factor
    _phase: str = "calibrating"
    _left: int = 0
    _cycles: list[tuple[float, float, float]] = field(default_factory=list)  # resolved_multiplier's
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
            spent, variance = cycle_cost(busy, quiet)
            self._cycles = [*self._cycles, (spent, variance, self.plan.expected_ms / self.scale)][-POOLED_CYCLES:]
            multiplier = resolved_multiplier(self._cycles, self.scale)
            # at most ×4 or ÷2 per cycle, and within [0.25, 16] of the timed costs
            self.scale = float(np.clip(np.clip(multiplier, 0.5 * self.scale, 4.0 * self.scale), 0.25, 16.0))
        self.sensor_stretch = stretch_for(sensors_ms_at_base, allowed)
        self.sensors_ms = sensors_ms_at_base / self.sensor_stretch
        self.base_ms = base
        left = max(0.0, allowed - saved_ms - self.sensors_ms)
        self.plan = plan_budget(flops, calls, cost_ms * self.scale, caps, allowed_ms=left,
                                rotation_steps=self.rotation_steps)  # fmt: skip
        return self.plan
