"""What each step checks: the sampling plan drawn when a step begins, and under an overhead budget
the probabilities behind it (runtime/plan.py draws, runtime/budget.py chooses).

Every step begins here. Sites whose thresholds are calibrating, and sites an injected fault may hit,
run checked whatever the plan. Under `SamplingConfig.budget`, after calibration a few steps without
sampling measure the step, every site's check is timed at its shape once (`ops/cost.py`, cached by
shape), and one knapsack over the GEMM sites and the attention modules fills the budget; the cycle
repeats every `replan_steps` steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from aegis_sdc.faults.injector import FaultInjector
from aegis_sdc.kernels.reference import Tiling
from aegis_sdc.ops.cost import attention_check_cost_ms, check_cost_parts
from aegis_sdc.runtime.budget import BudgetController
from aegis_sdc.runtime.plan import GEMMS_PER_LINEAR, StepPlan
from aegis_sdc.sensors.attention import AttentionSensor
from aegis_sdc.sensors.gemm import GemmSensor
from aegis_sdc.sensors.sampling import Sampler

Event = tuple[str, str, int | None]  # (kind, message, site id): a line of the step's record


class StepPlanner:
    """Begins each step's plan; under a budget, replans from measured costs."""

    def __init__(
        self,
        *,
        sensors: list[GemmSensor],
        attention_sensors: dict[str, AttentionSensor],
        plan: StepPlan,
        budget: BudgetController | None,
        sampler: Sampler,
        injector: FaultInjector,
        device: torch.device,
        tiling: Tiling,
        events: list[Event],
    ) -> None:
        self.sensors = sensors  # by site id; the registry's list (it grows as Linears are swapped in)
        self.attention_sensors = attention_sensors  # by module; made at their first calls
        self.plan = plan
        self.budget = budget
        self.sampler = sampler
        self.injector = injector
        self.device = device
        self.tiling = tiling
        self._events = events
        self.saved_checker: Any = None  # the saved-tensor fingerprints: a budget probe step forces one
        self.last_calls: list[int] = []  # the calls of each Linear in the last step that made any
        self._check_costs: dict[tuple, float] = {}  # measured ms per check, by kind and shape (bucket)
        self._weight_costs: dict[tuple, float] = {}  # of which the pass over the weight (not scaled)
        self._planned: list[tuple[tuple, float]] = []  # the last plan: each site's cost key and probability
        # the state sensors under the budget: their ms per step at the configured periods, and how
        # to adopt the factor the budget puts on those periods (None: the step's exchange agrees it)
        self.state_sensors_ms: Callable[[], float] = lambda: 0.0
        self.adopt_stretch: Callable[[int], None] | None = None

    def begin(self, step: int) -> None:
        """Draw the step's sampling plan; calibrating sites and sites a fault may hit run checked."""
        sensors = self.sensors
        calibrating = np.fromiter((s.row.calibrating for s in sensors), dtype=bool, count=len(sensors))
        quiet = False
        if self.budget is not None:
            # a module whose calls run unchecked (named in the coverage report) never calibrates: it
            # must not hold the budget's plan back (a shape is set by its first planned call)
            attention_calibrating = any(s.calibrating and s.shape is not None for s in self.attention_sensors.values())
            # likewise a GEMM site never called (the dgrad of a first Linear whose input needs no
            # gradient) — once some site has been called: before the first step, all are to come
            called = np.fromiter((s.shape is not None for s in sensors), dtype=bool, count=len(sensors))
            gemm_calibrating = bool((calibrating & called).any()) or (called.size > 0 and not called.any())
            quiet = self._plan_budget(gemm_calibrating or attention_calibrating)
        for sensor in self.attention_sensors.values():
            sensor.quiet = quiet
        faulted = None
        if self.injector:
            faulted = np.fromiter((self.injector.may_fire(s.site, step) for s in sensors), dtype=bool)
        self.plan.begin(step, calibrating, faulted, quiet=quiet)

    def _plan_budget(self, calibrating: bool) -> bool:
        """The budget's phase for this step, and a new plan when one is due. True: this step samples
        nothing (the budget measures the step without checks)."""
        phase = self.budget.step_begins(calibrating)
        saved = self.saved_checker
        if saved is not None:  # a probe measures a saved-tensor step; quiet steps have none
            saved.forced = {"probe": True, "quiet": False}.get(phase)
            if self.budget.saved_planned is not None:
                saved.probability = self.budget.saved_planned
        if self.budget.due():
            self._replan()
        return phase in ("quiet", "probe")

    def _replan(self) -> None:
        """One knapsack over the GEMM sites and the attention modules (a call's forward and backward
        are checked together), each at its measured cost per check."""
        attention = list(self.attention_sensors.values())
        costs = np.array([self._check_cost(s) for s in self.sensors] + [self._attention_cost(s) for s in attention])
        flops = np.array([s.flops for s in self.sensors] + [s.call_flops for s in attention])
        calls = np.concatenate((
            np.repeat(np.asarray(self.last_calls or [1] * self.plan.linears, dtype=np.float64), GEMMS_PER_LINEAR),
            np.asarray([s.calls_last_step for s in attention], dtype=np.float64),
        ))  # fmt: skip
        caps = np.array([self.sampler.probability_for(s.site.name, 1.0) for s in self.sensors]
                        + [self.sampler.probability_for(s.forward_site.name, 1.0) for s in attention])  # fmt: skip
        plan = self.budget.replan(flops, calls, costs, caps, sensors_ms_at_base=self.state_sensors_ms())
        if self.adopt_stretch is not None:
            self.adopt_stretch(self.budget.sensor_stretch)
        if plan is None:
            return
        gemms = len(self.sensors)
        keys = [self._gemm_key(s) for s in self.sensors] + [self._attention_key(s) for s in attention]
        self._planned = list(zip(keys, plan.probabilities.tolist(), strict=True))
        self.plan.set_probabilities(plan.probabilities[:gemms])
        for sensor, probability in zip(attention, plan.probabilities[gemms:], strict=True):
            sensor.probability = float(probability)
        work = np.maximum(calls, 1.0) * flops
        fractions = [
            float((plan.probabilities[part] * work[part]).sum() / work[part].sum()) if work[part].sum() else 0.0
            for part in (slice(0, gemms), slice(gemms, None))
        ]  # fmt: skip
        budget = self.budget
        self._events.append(
            ("sampling_plan", f"budget {budget.budget:.2%} of a {budget.base_ms:.1f} ms step: "
             f"{plan.expected_ms:.2f} ms of checks (cost model × {budget.scale:.2f}), "
             f"{fractions[0]:.1%} of GEMM FLOPs, {fractions[1]:.1%} of attention FLOPs"
             + budget.describe_saved() + budget.describe_sensors(),
             None)
        )  # fmt: skip

    def cost_table(self) -> list[dict[str, Any]]:
        """The cost model as measured — ms a check adds, by kind and shape — with the number of sites
        the last plan priced at each entry and the mean probability it gave them: what the budget
        bought, for benchmarks and for a user asking why a site is seldom checked."""
        planned: dict[tuple, list[float]] = {}
        for key, probability in self._planned:
            planned.setdefault(key, []).append(probability)
        return [
            {"kind": key[0], "shape": _plain(key[1:]), "ms": ms, "sites": len(planned.get(key, ())),
             "mean_probability": float(np.mean(planned[key])) if key in planned else None}
            for key, ms in self._check_costs.items()
        ]  # fmt: skip

    @staticmethod
    def _attention_key(sensor: AttentionSensor) -> tuple:
        return ("attention", *(sensor.shape or ()))

    @staticmethod
    def _gemm_key(sensor: GemmSensor) -> tuple:
        shape = None if sensor.shape is None else _token_bucket(sensor.site.kind.value, sensor.shape)[0]
        return (sensor.site.kind.value, shape, sensor.dtype, sensor.col_check, sensor.triton)

    def _attention_cost(self, sensor: AttentionSensor) -> float:
        if sensor.shape is None:
            return 0.0  # never called (or never checkable): nothing to time
        key = self._attention_key(sensor)
        if key not in self._check_costs:
            self._check_costs[key] = attention_check_cost_ms(*sensor.shape, self.device)
        return self._check_costs[key]

    def _check_cost(self, sensor: GemmSensor) -> float:
        if sensor.shape is None or sensor.dtype is None:
            return 0.0  # never called: nothing to time, and nothing its checks would cost
        key = self._gemm_key(sensor)
        if key not in self._check_costs:
            scaled, weight = check_cost_parts(
                sensor.site.kind.value, key[1], sensor.dtype, self.device, col_check=sensor.col_check,
                triton=sensor.triton, tiling=self.tiling,
            )  # fmt: skip
            self._check_costs[key], self._weight_costs[key] = scaled + weight, weight
        weight = self._weight_costs[key]
        return (self._check_costs[key] - weight) * _token_bucket(sensor.site.kind.value, sensor.shape)[1] + weight


def _plain(values: tuple) -> list:
    """A cost key's fields as JSON takes them: (M, K, N) or an attention call's shape flattened,
    numbers kept, the rest (dtypes) as text."""
    flat = [v for value in values for v in (value if isinstance(value, tuple) else (value,))]
    return [v if isinstance(v, (bool, int, float)) else str(v) for v in flat]


def _token_bucket(kind: str, shape: tuple[int, int, int]) -> tuple[tuple[int, int, int], float]:
    """(M, K, N) with its token count — M, or K of a wgrad — rounded up to a power of two (at least
    256), and tokens / bucket: what a check costs beyond the pass over its weight grows linearly with
    the tokens (ops/cost.py scales the same way), and a mixture of experts' expert sees another token
    count at every step — timed per exact shape, every replan would time hundreds of new shapes and
    the cache would grow without end."""
    m, k, n = shape
    tokens = k if kind == "wgrad" else m
    bucket = max(256, 1 << max(tokens - 1, 0).bit_length())
    return ((m, bucket, n) if kind == "wgrad" else (bucket, k, n)), tokens / bucket
