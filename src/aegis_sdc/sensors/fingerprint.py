"""Fingerprint sensors: what must be the same bits twice is fingerprinted twice.

- Recompute: a checkpointed segment's output in forward against its recomputation in backward.
  Every deterministic op of the segment (norms, activations, RoPE, residual adds, the GEMMs) runs
  twice on the same inputs; the two results must agree to the last bit.
- Saved tensors: a tensor saved for backward when it is saved against when backward uses it — the
  memory in between (AEGIS found a one-bit HBM flip in a saved fp32 value that ECC did not report).

Sensors record pairs of `Fingerprint` handles on the hot path; the guard compares them after its
step-end transfer. A mismatch becomes a vTask whose payload decides the verdict by a third look:

- recompute: the segment runs a third time from its inputs (same RNG state, same GEMM paths). The
  execution the other two agree against is the wrong one; if all three differ, the segment is not
  deterministic on this device — reported as such, never as an SDC, and the site is dropped from
  coverage. The first `calibration_checks` checks of every recompute site run the third execution
  even when forward and recomputation agree, so a segment with non-deterministic operators (atomics)
  is found in calibration.
- saved tensor: the tensor is fingerprinted a third time. Agreeing with the backward fingerprint
  means the memory changed between forward and backward; agreeing with the forward one means the
  backward read was wrong (a transient read error).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from aegis_sdc.events import Channel, Evidence, FingerprintKind, Site, VerdictKind, WrongExecution
from aegis_sdc.ops.fingerprint import Fingerprint, FingerprintPool


@dataclass
class FingerprintSite:
    """State of one fingerprint site."""

    site: Site
    probability: float
    calibration_left: int  # recompute sites: checks that still run a third execution
    checks: int = 0
    mismatches: int = 0
    not_deterministic: str | None = None  # why the site is not covered, once found
    _call_step: int = -1
    _calls: int = 0

    def next_call(self, step: int) -> int:
        if step != self._call_step:
            self._call_step, self._calls = step, 0
        self._calls += 1
        return self._calls - 1


@dataclass(eq=False)
class FingerprintRecord:
    """One check: the fingerprints taken first (forward / save) and second (recompute / use)."""

    state: FingerprintSite
    step: int
    call: int
    first: list[Fingerprint]
    second: list[Fingerprint]
    capture: RecomputeCapture | SavedTensorCapture

    def mismatched(self) -> list[int]:
        """Indexes of the tensors whose two fingerprints differ (both known)."""
        return [
            i
            for i, (a, b) in enumerate(zip(self.first, self.second, strict=True))
            if a.value is not None and b.value is not None and a.value != b.value
        ]

    def evidence(self) -> Evidence:
        bad = self.mismatched()
        return Evidence(
            site=self.state.site, step=self.step, call=self.call, channel=Channel.FINGERPRINT,
            value=float(len(bad)), threshold=0.0, index=bad[0] if bad else -1, raw_l2=0.0,
            channels=(Channel.FINGERPRINT,),
        )  # fmt: skip


def _values(handles: list[Fingerprint]) -> list[int | None]:
    return [h.value for h in handles]


class RecomputeCapture:
    """Replay context of a checkpointed segment: a callable running it a third time from its inputs."""

    references = ("the segment's inputs and the weights it reads",)  # verify before the optimizer step

    def __init__(self, rerun: Callable[[], list[torch.Tensor]], pool: FingerprintPool, record_ref) -> None:
        self.rerun = rerun
        self.pool = pool
        self.record: FingerprintRecord = record_ref
        self.traced_upstream = False  # set by `verdict`: the forward, not the recomputation, was wrong

    def third(self) -> list[int | None]:
        return [self.pool.now(t) for t in self.rerun()]

    def verdict(self) -> tuple[VerdictKind, WrongExecution | None, str]:
        forward, recomputed = _values(self.record.first), _values(self.record.second)
        third = self.third()
        bad = self.record.mismatched()
        where = f"output tensor(s) {bad} of the segment"
        if third == recomputed:
            self.traced_upstream = True
            return (VerdictKind.CONFIRMED_SDC, WrongExecution.ORIGINAL,
                    f"{where}: the forward result differs; the recomputation and a third run agree")  # fmt: skip
        if third == forward:
            return (VerdictKind.CONFIRMED_SDC, WrongExecution.REPLAY,
                    f"{where}: the recomputation in backward differs; the forward and a third run agree "
                    "(the gradients were computed from the wrong recomputation)")  # fmt: skip
        return (VerdictKind.NOT_DETERMINISTIC, WrongExecution.UNSTABLE,
                f"{where}: forward, recomputation and a third run all differ: the segment is not "
                "deterministic — not covered")  # fmt: skip


class SavedTensorCapture:
    """Replay context of a saved tensor: the tensor itself, to fingerprint a third time."""

    references = ("the saved tensor",)  # held until verified: verify at the step's end

    def __init__(self, tensor: torch.Tensor, pool: FingerprintPool, record_ref) -> None:
        self.tensor = tensor
        self.pool = pool
        self.record: FingerprintRecord = record_ref

    def verdict(self) -> tuple[VerdictKind, WrongExecution | None, str]:
        saved, used = self.record.first[0].value, self.record.second[0].value
        third = self.pool.now(self.tensor)
        shape = f"{tuple(self.tensor.shape)} {str(self.tensor.dtype).removeprefix('torch.')}"
        if third == used:
            return (VerdictKind.CONFIRMED_SDC, WrongExecution.ORIGINAL,
                    f"saved tensor {shape} changed in memory between forward (saved) and backward (used)")  # fmt: skip
        if third == saved:
            return (VerdictKind.CONFIRMED_SDC, WrongExecution.REPLAY,
                    f"saved tensor {shape}: backward's read differed from the stored bits, which are intact "
                    "(a transient read error)")  # fmt: skip
        return (VerdictKind.CONFIRMED_SDC, WrongExecution.UNSTABLE,
                f"saved tensor {shape}: three reads of the same memory gave three different fingerprints")  # fmt: skip


@dataclass
class FingerprintChecks:
    """The fingerprint sites of one guard and this step's records."""

    pool: FingerprintPool
    register_site: Callable[[str, FingerprintKind], Site]  # (module, kind) → a Site, first-use order
    probability_for: Callable[[FingerprintKind, str], float]
    should_check: Callable[[float, int, int, int], bool]  # (probability, site id, step, call)
    calibration_checks: int
    sites: dict[str, FingerprintSite] = field(default_factory=dict)
    records: list[FingerprintRecord] = field(default_factory=list)
    flushers: list[Callable[[], None]] = field(default_factory=list)  # run before the records are taken
    uncovered: dict[str, str] = field(default_factory=dict)  # site name → why it cannot be checked

    def name_uncovered(self, module: str, kind: FingerprintKind, reason: str) -> bool:
        """A segment the sensor cannot check, for the coverage report; True the first time."""
        key = f"{module}:{kind.value}"
        first = key not in self.uncovered
        self.uncovered[key] = reason
        return first

    def site(self, module: str, kind: FingerprintKind) -> FingerprintSite:
        key = f"{module}:{kind.value}"
        state = self.sites.get(key)
        if state is None:
            site = self.register_site(module, kind)
            calibration = self.calibration_checks if kind is FingerprintKind.RECOMPUTE else 0
            state = self.sites[key] = FingerprintSite(site, self.probability_for(kind, site.name), calibration)
        return state

    def sampled(self, state: FingerprintSite, step: int, call: int) -> bool:
        if state.not_deterministic is not None:
            return False
        return state.calibration_left > 0 or self.should_check(state.probability, state.site.id, step, call)

    def take(self) -> list[FingerprintRecord]:
        for flush in self.flushers:
            flush()
        records, self.records = self.records, []
        return records

    def differ_on_device(self, records: list[FingerprintRecord]) -> torch.Tensor | None:
        """The records' comparison on the device, for the optimizer gate (`FingerprintPool.differ_on_device`):
        exactly the pairs `judge` compares, so the flag is set if and only if `judge` finds a mismatch.
        Not while a recompute site calibrates: its third execution runs the segment again with the
        weights the update would change, so those records are judged on the host before the update."""
        if any(r.state.calibration_left > 0 for r in records):
            return None
        pairs = [(a, b) for r in records if r.state.not_deterministic is None
                 for a, b in zip(r.first, r.second, strict=True)]  # fmt: skip
        return self.pool.differ_on_device(pairs)

    def judge(self, records: list[FingerprintRecord]) -> tuple[list[FingerprintRecord], list[str]]:
        """After the step-end transfer: the records whose fingerprints differ, and the sites found
        not deterministic in calibration (equal fingerprints, but a third run differs)."""
        mismatched, found = [], []
        for record in records:
            state = record.state
            if state.not_deterministic is not None:
                continue
            state.checks += 1
            calibrating = state.calibration_left > 0
            state.calibration_left = max(0, state.calibration_left - 1)
            if record.mismatched():
                state.mismatches += 1
                mismatched.append(record)
            elif (
                calibrating
                and isinstance(record.capture, RecomputeCapture)
                and record.capture.third() != _values(record.first)
            ):
                state.not_deterministic = "a third run differs from forward and recomputation (calibration)"
                found.append(state.site.name)
            if not mismatched or mismatched[-1] is not record:
                record.capture = None  # release the segment's inputs / the saved tensor
        return mismatched, found

    def coverage(self) -> dict[str, object]:
        """What the fingerprint sensors covered, for the run's summary."""
        by_kind: dict[str, list[str]] = {k.value: [] for k in FingerprintKind}
        for state in self.sites.values():
            if state.not_deterministic is None and state.checks:
                by_kind[state.site.kind.value].append(state.site.name)
        return {
            "recompute_sites_checked": sorted(by_kind[FingerprintKind.RECOMPUTE.value]),
            "saved_tensor_sites_checked": sorted(by_kind[FingerprintKind.SAVED.value]),
            "not_covered": {
                **{
                    s.site.name: f"not deterministic — not covered ({s.not_deterministic})"
                    for s in self.sites.values()
                    if s.not_deterministic is not None
                },
                **self.uncovered,
            },
        }
