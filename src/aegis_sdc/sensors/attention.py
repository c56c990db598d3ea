"""Attention sensor: one per attention module, two sites — `<module>:attn_fwd` (O·1 against P·(V·1))
and `<module>:attn_bwd` (five checks: dv, dp, ds, dq, dk; kernels/attention_reference.py) — with the
GEMM sensors' adaptive thresholds, one per check: their noise differs, and a shared threshold would
set every check's sensitivity by the noisiest.

A call's evidence is its largest normalized difference over the (batch, head) pairs; an alarm keeps
that head's inputs and results (`ops.checked_attention.CallContext`). On the reference path the
values are on the host and read at the call. From the Triton kernels they stay on the device: the
call's suspect head (largest value over threshold) is chosen there and copied, its per-check maxima
and index join the step's one read (runtime/evidence.py), and `AttentionRecord.finish` decides at
the step's end — no host read per call. The verdict replays the head
twice with the same code: forward alarms replay the forward; backward alarms replay the forward
first (a wrong score or normalizer in forward shows up as a wrong saved lse, which the backward
check catches), then the backward. A replay that reproduces every bit is a false alarm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from aegis_sdc.config import ThresholdConfig
from aegis_sdc.events import Channel, Evidence, Site, VerdictKind, WrongExecution
from aegis_sdc.faults.injector import FaultInjector, Injection
from aegis_sdc.faults.models import resolve
from aegis_sdc.hashing import unit_hash
from aegis_sdc.kernels.attention_reference import BACKWARD_CHECKS, HeadFault, backward_bound
from aegis_sdc.ops.checked_attention import attention_flops
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
    pending: DeferredCheck | None = None  # Triton path: the values are still on the device

    def finish(self, row: list[float]) -> None:
        """Fill in a deferred record from its row of the step's read: [maxima per check…, head]."""
        pending, self.pending = self.pending, None
        maxima, self.head = tuple(row[:-1]), int(row[-1])
        ratios = [m / max(t, 1e-300) if not math.isnan(m) else math.inf
                  for m, t in zip(maxima, pending.thresholds, strict=True)]  # fmt: skip
        self.values, self.check = maxima, max(range(len(maxima)), key=ratios.__getitem__)
        if ratios[self.check] > 1.0:
            batch, within = divmod(self.head, self.heads_per_batch)
            self.capture = AttentionCapture(pending.replay, pending.backward, batch, within, pending.head_values)
            pending.alarmed_check[(self.step, self.call, pending.backward)] = self.check

    @property
    def value(self) -> float:
        return self.values[self.check]

    @property
    def threshold(self) -> float:
        return self.states[self.check].current


@dataclass(eq=False)
class DeferredCheck:
    """A Triton call's check, decided at the step's end (see the module docstring)."""

    packed: torch.Tensor  # float64 [checks + 1] on the device: each check's largest value over the heads, the head
    alarm: torch.Tensor  # bool [] on the device: a check over its threshold (the optimizer gate reads it)
    thresholds: tuple[float, ...]  # what the device compared against
    replay: Any  # the suspect head's copy (ops/checked_attention.CallContext.head_copy)
    head_values: torch.Tensor  # float64 [checks]: that head's values
    backward: bool
    alarmed_check: dict  # the sensor's (step, call, backward) → check, for a false alarm's threshold


class AttentionCapture:
    """The replay context of one (batch, head) of an alarmed call."""

    references = ("the head's inputs",)  # copies; verified within the step like GEMM captures

    def __init__(self, replay, backward: bool, batch: int, head: int, values) -> None:
        self.replay = replay
        self.backward = backward
        self.batch, self.head = batch, head
        self.values = values  # the head's check values as the training step computed them (fp64)
        self.traced_upstream = False  # set by `verdict`: the backward check read a wrong forward

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
            if self.backward and name == "forward":  # the backward ran on a wrong saved output or lse
                parts = zip(("output", "lse"), first, saved, strict=True)
                wrong = [part for part, replayed, kept in parts if not _same((replayed,), (kept,))]
                verb = "were" if len(wrong) > 1 else "was"
                found = f" (found by the backward check: the saved {' and '.join(wrong)} {verb} wrong)"
            if _same(first, second):
                self.traced_upstream = bool(found)
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
        if not bool(torch.isfinite(self.values).all()):
            # finite inputs whose scores or sums overflow the same way on every run: the data's values
            detail = f"{where}: NaN/Inf from finite inputs, reproduced bit for bit: the data's values overflow"
            return VerdictKind.NONFINITE_INPUT, None, detail
        return VerdictKind.FALSE_ALARM, None, f"{where}: replays reproduced every bit, the check values too"


def _same(a, b) -> bool:
    """Bit for bit (NaN patterns included: `torch.equal` calls NaN unequal to itself)."""
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
        # the chance that a call is checked: the sampler's rule, or the budget's plan (the guard sets it)
        self.probability = sampler.probability_for(self.forward_site.name)
        self.quiet = False  # a step the budget measures unsampled: only calibration checks
        self.shape: tuple | None = None  # the last call's (heads, queries, keys, dim, dtype, causal)
        self.call_flops = 0.0  # the last call's forward and backward FLOPs
        self.calls_last_step = 0
        self.checked_last_step = 0
        self._checked = 0  # calls checked in the current step
        self.flops = {"total": 0.0, "checked": 0.0}  # over every call planned
        self.injector = injector
        self.clock = clock
        self.records = records
        self._call_step, self._calls = -1, 0
        self._thresholds_on_device: dict[bool, tuple] = {}  # backward? → (thresholds, float64 [checks, 1])

    def site(self, backward: bool) -> Site:
        return self.backward_site if backward else self.forward_site

    # -- hot path ----------------------------------------------------------------------------------
    def calls_of_step(self, step: int) -> tuple[int, int]:
        """(calls, checked calls) of `step`: the current one or the one before it."""
        if step == self._call_step:
            return self._calls, self._checked
        if step == self._call_step - 1:
            return self.calls_last_step, self.checked_last_step
        return 0, 0

    @property
    def calibrating(self) -> bool:
        return any(state.calibrating for states in self.states.values() for state in states)

    def plan(self, heads: int, queries: int, keys: int, dim: int, dtype=None, causal: bool = False
             ) -> AttentionPlan | None:  # fmt: skip
        step = self.clock.step
        if step != self._call_step:
            if self._call_step >= 0:
                self.calls_last_step, self.checked_last_step = self._calls, self._checked
            self._call_step, self._calls, self._checked = step, 0, 0
        if self.shape != (heads, queries, keys, dim, dtype, causal):
            self.shape = (heads, queries, keys, dim, dtype, causal)
            self.call_flops = attention_flops(heads, queries, keys, dim, causal)
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
        check = check or (not self.quiet and self.sampler.should_check(self.probability, self.forward_site.id, step,
                                                                        call))  # fmt: skip
        self.flops["total"] += self.call_flops
        self.flops["checked"] += self.call_flops if check else 0.0
        self._checked += check
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
        if getattr(capture, "deferred", False):
            self._observe_on_device(plan, backward, values, capture, heads_per_batch)
            return
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

    def _observe_on_device(self, plan: AttentionPlan, backward: bool, values, context, heads_per_batch: int) -> None:
        """`values` [heads] or [checks, heads] fp64 on the device: the suspect head chosen and copied
        there; nothing read (see the module docstring)."""
        states = self.states[backward]
        thresholds = tuple(state.current for state in states)
        rows = values.reshape(len(states), -1)  # [checks, heads]
        ratios = (rows / self._device_thresholds(backward, thresholds, rows.device)).nan_to_num(nan=math.inf)
        head = ratios.amax(dim=0).argmax().view(1)  # int64 [1]: the head furthest over its threshold
        packed = torch.cat((rows.amax(dim=1), head.to(torch.float64)))
        pending = DeferredCheck(packed, (ratios > 1.0).any(), thresholds, context.head_copy(head),
                                rows.index_select(1, head)[:, 0], backward, self._alarmed_check)  # fmt: skip
        self.records.append(AttentionRecord(self.site(backward), states, (), plan.step, plan.call, 0, 0,
                                            heads_per_batch, None, pending))  # fmt: skip

    def _device_thresholds(self, backward: bool, thresholds: tuple[float, ...], device):
        """The thresholds as a float64 [checks, 1] device tensor, uploaded again only when they change
        (calibration and false alarms: at most once a step)."""
        cached = self._thresholds_on_device.get(backward)
        if cached is None or cached[0] != thresholds or cached[1].device != device:
            tensor = torch.tensor(thresholds, dtype=torch.float64).view(-1, 1).to(device, non_blocking=True)
            cached = self._thresholds_on_device[backward] = (thresholds, tensor)
        return cached[1]

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
