"""Attention sensor: one per attention module, two sites — `<module>:attn_fwd` (O·1 against P·(V·1))
and `<module>:attn_bwd` (1ᵀdV against 1ᵀdO) — with the GEMM sensors' adaptive thresholds.

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
from aegis_sdc.kernels.attention_reference import HeadFault, backward_bound
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
    state: ThresholdState
    step: int
    call: int
    value: float
    head: int
    heads_per_batch: int
    threshold: float
    capture: AttentionCapture | None


class AttentionCapture:
    """The replay context of one (batch, head) of an alarmed call."""

    references = ("the head's inputs",)  # copies; verified within the step like GEMM captures

    def __init__(self, replay, backward: bool, batch: int, head: int) -> None:
        self.replay = replay
        self.backward = backward
        self.batch, self.head = batch, head

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
        return VerdictKind.FALSE_ALARM, None, f"{where}: replays reproduced every bit"


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
        self.states = {False: ThresholdState(thresholds, math.inf), True: ThresholdState(thresholds, math.inf)}
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
        forward, backward = self.states[False], self.states[True]
        if forward.hard_bound == math.inf:  # the exact worst case guards calibration
            forward.hard_bound = forward.current = worst_case_bound(keys, dim)
            backward.hard_bound = backward.current = backward_bound(queries, keys)
        check = forward.calibrating or backward.calibrating
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
        """`values` [heads] fp64 on the CPU (the reference path): read here, as the GEMM reference
        path reads its statistics."""
        if plan is None or plan.silent or not plan.check:
            return  # an unsampled call with a fault: it corrupts training unseen
        state = self.states[backward]
        head = int(values.argmax())
        value = float(values[head])
        threshold = state.current
        alarmed = value > threshold or math.isnan(value)
        kept = None
        if alarmed:
            batch, within = divmod(head, heads_per_batch)
            kept = AttentionCapture(capture(head), backward, batch, within)
        self.records.append(AttentionRecord(self.site(backward), state, plan.step, plan.call, value, head,
                                            heads_per_batch, threshold, kept))  # fmt: skip

    # -- step end ----------------------------------------------------------------------------------
    @staticmethod
    def judge(record: AttentionRecord) -> Evidence | None:
        if record.capture is None:
            record.state.observe_clean(record.value)
            return None
        channel = Channel.COL if record.site.kind.value == "attn_bwd" else Channel.ROW
        return Evidence(
            site=record.site, step=record.step, call=record.call, channel=channel, value=record.value,
            threshold=record.threshold, index=record.head, raw_l2=0.0, channels=(channel,),
        )  # fmt: skip
