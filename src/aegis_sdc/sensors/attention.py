"""Attention sensor: one per attention module, two sites — `<module>:attn_fwd` (O·1 against P·(V·1))
and `<module>:attn_bwd` (five checks: dv, dp, ds, dq, dk; kernels/attention_reference.py) — with the
GEMM sensors' adaptive thresholds, one per check: their noise differs, and a shared threshold would
set every check's sensitivity by the noisiest.

A call's evidence is its largest normalized difference over the (batch, head) pairs; an alarm keeps
that head's inputs and results (`ops.checked_attention.HeadReplay`). The verdict replays the head
twice with the same code: forward alarms replay the forward; backward alarms replay the forward
first (a wrong score or normalizer in forward shows up as a wrong saved lse, which the backward
check catches), then the backward. A replay that reproduces every bit is a false alarm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from aegis_sdc.config import ThresholdConfig
from aegis_sdc.events import Channel, Evidence, Site, VerdictKind, WrongExecution
from aegis_sdc.faults.injector import FaultInjector, Injection
from aegis_sdc.faults.models import resolve
from aegis_sdc.hashing import unit_hash
from aegis_sdc.kernels.attention_reference import BACKWARD_CHECKS, HeadFault, backward_bound
from aegis_sdc.sensors.sampling import Sampler
from aegis_sdc.sensors.thresholds import ThresholdState, worst_case_bound


@dataclass
class AttentionPlan:
    step: int
    call: int
    heads: int  # batch · query heads
    check: bool
    faults: dict[bool, tuple[HeadFault, Injection]] = field(default_factory=dict)  # backward? → fault
    silent: bool = False  # a recomputation replaying a forward's plan: same path, nothing recorded


@dataclass(eq=False)
class AttentionRecord:
    site: Site
    states: tuple[ThresholdState, ...]  # one per check of the pass (forward: one)
    values: tuple[float, ...]  # each check's largest value over the heads
    step: int
    call: int
    check: int  # the check furthest over (or nearest to) its threshold
    head: int
    heads_per_batch: int
    capture: AttentionCapture | None

    @property
    def value(self) -> float:
        return self.values[self.check]

    @property
    def threshold(self) -> float:
        return self.states[self.check].current


class AttentionCapture:
    """The replay context of one (batch, head) of an alarmed call."""

    references = ("the head's inputs",)  # copies; verified within the step like GEMM captures

    def __init__(self, replay, backward: bool, batch: int, head: int, values) -> None:
        self.replay = replay
        self.backward = backward
        self.batch, self.head = batch, head
        self.values = values  # the head's check values as the training step computed them (fp64)

    def verdict(self) -> tuple[VerdictKind, WrongExecution | None, str]:
        where = f"batch {self.batch}, head {self.head}"
        if not self.replay.inputs_finite():
            return VerdictKind.NONFINITE_INPUT, None, f"{where}: NaN/Inf in the head's inputs (from the data)"
        passes = ("forward", "backward") if self.backward else ("forward",)
        for name in passes:
            run = self.replay.forward_outputs if name == "forward" else self.replay.backward_outputs
            saved = self.replay.saved_forward() if name == "forward" else self.replay.grads
            first, second = run(), run()
            if _same(first, saved):
                continue
            found = ""
            if self.backward and name == "forward":
                found = " (found by the backward check: the saved lse was wrong)"
            if _same(first, second):
                return (
                    VerdictKind.CONFIRMED_SDC,
                    WrongExecution.ORIGINAL,
                    (f"{where}: the training step's {name} differs from two agreeing replays{found}"),
                )
            if _same(second, saved):
                return VerdictKind.CONFIRMED_SDC, WrongExecution.REPLAY, f"{where}: the first {name} replay differs"
            return VerdictKind.CONFIRMED_SDC, WrongExecution.UNSTABLE, f"{where}: three {name} executions differ"
        # Every output reproduced. A check value that does not is the check's own arithmetic (its
        # reference side, fp64 sums) computed wrong in the step: a device fault with no effect on
        # training — never noise, so no threshold is raised for it.
        again = self.replay.check_values(self.backward)
        if not _same((again,), (self.values,)):
            first, second = again, self.replay.check_values(self.backward)
            wrong = WrongExecution.ORIGINAL if _same((first,), (second,)) else WrongExecution.UNSTABLE
            return (VerdictKind.CONFIRMED_SDC, wrong,
                    f"{where}: outputs reproduced, but the check's own values differ from two replays' "
                    "(the reference side was computed wrong; no effect on training)")  # fmt: skip
        return VerdictKind.FALSE_ALARM, None, f"{where}: replays reproduced every bit, the check values too"


def _same(a, b) -> bool:
    """Bit for bit (NaN patterns included: `torch.equal` calls NaN unequal to itself)."""
    import torch

    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return all(
        torch.equal(x.contiguous().view(ints[x.element_size()]), y.contiguous().view(ints[y.element_size()]))
        for x, y in zip(a, b, strict=True)
    )


class AttentionSensor:
    def __init__(
        self, module: str, sites: tuple[Site, Site], *, thresholds: ThresholdConfig, sampler: Sampler,
        injector: FaultInjector, clock, records: list[AttentionRecord],
    ) -> None:  # fmt: skip
        self.module = module
        self.forward_site, self.backward_site = sites
        # forward: one check; backward: BACKWARD_CHECKS, in that order
        self.states = {
            False: (ThresholdState(thresholds, math.inf),),
            True: tuple(ThresholdState(thresholds, math.inf) for _ in BACKWARD_CHECKS),
        }
        self._alarmed_check: dict[tuple[int, int, bool], int] = {}  # (step, call, backward) → check
        self.sampler = sampler
        self.probability = sampler.probability_for(self.forward_site.name)
        self.injector = injector
        self.clock = clock
        self.records = records
        self._call_step, self._calls = -1, 0

    def site(self, backward: bool) -> Site:
        return self.backward_site if backward else self.forward_site

    # -- hot path ----------------------------------------------------------------------------------
    def plan(self, heads: int, queries: int, keys: int, dim: int) -> AttentionPlan | None:
        step = self.clock.step
        if step != self._call_step:
            self._call_step, self._calls = step, 0
        call = self._calls
        self._calls += 1
        states = self.states[False] + self.states[True]
        if states[0].hard_bound == math.inf:  # the worst case guards calibration
            # forward; dv (exact); dp = dO·Vᵀ; ds (a generous bound: its scale carries every magnitude
            # it sums); dq = dS·K; dk = dSᵀ·Q
            bounds = (
                worst_case_bound(keys, dim), backward_bound(queries, keys), worst_case_bound(dim, keys),
                worst_case_bound(keys, dim), worst_case_bound(keys, dim), worst_case_bound(queries, dim),
            )  # fmt: skip
            for state, bound in zip(states, bounds, strict=True):
                state.hard_bound = state.current = bound
        check = any(state.calibrating for state in states)
        check = check or self.sampler.should_check(self.probability, self.forward_site.id, step, call)
        plan = AttentionPlan(step, call, heads, check)
        for is_backward in (False, True):
            fault = self._fault(self.site(is_backward), step, call, heads)
            if fault is not None:
                plan.faults[is_backward] = fault
        return plan if check or plan.faults else None

    def _fault(self, site: Site, step: int, call: int, heads: int):
        for spec in self.injector.specs_for(site.name) if self.injector else ():
            if spec.fires(site.id, step, call):
                fault = resolve(spec, site.id, step, call, 1.0)
                head = spec.head if spec.head is not None else int(unit_hash(spec.seed, 0xA77E, site.id, step) * heads)
                head = min(head, heads - 1)
                return HeadFault(head, spec.stage, fault), Injection(site.name, step, call, fault, head=head)
        return None

    def fault_for(self, plan: AttentionPlan, backward: bool) -> HeadFault | None:
        planned = None if plan is None or plan.silent else plan.faults.get(backward)
        if planned is None:
            return None
        self.injector.applied(planned[1])
        return planned[0]

    def observe(self, plan: AttentionPlan, backward: bool, values, capture, heads_per_batch: int) -> None:
        """`values` [heads] (forward) or [checks, heads] (backward) fp64 on the CPU (the reference
        path): read here, as the GEMM reference path reads its statistics."""
        if plan is None or plan.silent or not plan.check:
            return  # an unsampled call with a fault: it corrupts training unseen
        states = self.states[backward]
        rows = values.reshape(len(states), -1)  # [checks, heads]
        maxima = rows.amax(dim=1)
        ratios = [float(m) / max(s.current, 1e-300) if not math.isnan(float(m)) else math.inf
                  for m, s in zip(maxima, states, strict=True)]  # fmt: skip
        check = max(range(len(states)), key=ratios.__getitem__)
        head = int(rows[check].argmax())
        alarmed = ratios[check] > 1.0
        kept = None
        if alarmed:
            batch, within = divmod(head, heads_per_batch)
            kept = AttentionCapture(capture(head), backward, batch, within, rows[:, head].clone())
            self._alarmed_check[(plan.step, plan.call, backward)] = check
        self.records.append(AttentionRecord(self.site(backward), states, tuple(float(m) for m in maxima), plan.step,
                                            plan.call, check, head, heads_per_batch, kept))  # fmt: skip

    def on_false_alarm(self, backward: bool, evidence) -> None:
        """The replay reproduced the call: the check that alarmed was noise; raise its threshold."""
        check = self._alarmed_check.pop((evidence.step, evidence.call, backward), 0)
        self.states[backward][check].on_false_alarm(evidence.value)

    # -- step end ----------------------------------------------------------------------------------
    @staticmethod
    def judge(record: AttentionRecord) -> Evidence | None:
        if record.capture is None:
            for state, value in zip(record.states, record.values, strict=True):
                state.observe_clean(value)
            return None
        channel = Channel.COL if record.site.kind.value == "attn_bwd" else Channel.ROW
        return Evidence(
            site=record.site, step=record.step, call=record.call, channel=channel, value=record.value,
            threshold=record.threshold, index=record.head, raw_l2=0.0, channels=(channel,),
        )  # fmt: skip
