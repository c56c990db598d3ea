"""The verifier: replays vTasks off the op's critical path and decides what happened.

Triage of one vTask (payloads are replay contexts, see ops/gemm_replay.py). Collective checks and
fingerprints and attention heads carry payloads that decide for themselves (`payload.verdict()`:
distributed/comm_check.py, sensors/fingerprint.py, sensors/attention.py); GEMM payloads go through:

1. The context is gone or changed (a referenced weight's version moved)  → NOT_VERIFIABLE.
2. Non-finite checksums and non-finite operands in the context          → NONFINITE_INPUT
   (also non-finite checksums from finite operands that the replay reproduces bit for bit, below:
   values that overflow, from the data).
3. Replay with the identical implementation and compare bit for bit (output tiles, fp32 partial
   checksums, the reference side A·(B·1) and B·1):
   - B·1 recomputed from a referenced weight differs from the vector the step used: the weight is
     not the one the step multiplied (it changed without bumping its version: a fused optimizer or
     a `p.data` write before the step was verified), or the library's vector was stale. Only a
     quantity the library derived disagrees, so the device is not blamed  → NOT_VERIFIABLE.
     A confirmed SDC always rests on a reproduced difference in what the device computed from
     operands known to be the step's.
   - identical: if an independent fp64 recomputation shows a saved value outside the exact fp32
     error bound, every execution is wrong (a persistent fault)        → CONFIRMED, REPRODUCIBLE;
     otherwise the alarm was numerical noise                            → FALSE_ALARM.
   - different: a second replay decides which execution was wrong: the second agrees with the
     first → the training step was wrong (ORIGINAL); it agrees with the training step → the first
     replay was wrong (REPLAY); all three differ → UNSTABLE.           → CONFIRMED
   A difference only in the fp32 checksums (the rounded output is identical) is still a confirmed
   SDC, flagged `no_effect_on_output`.

Evidence: with `keep_confirmed`, the context of a confirmed vTask and the verifier's replays of it are
kept in `kept` (by vTask id) for the caller to write down (response/evidence.py) and pop; nothing is
kept for any other verdict.

Scheduling: `run()` is called at the end of every step, before the optimizer step. vTasks whose
context references a tensor the optimizer may change are replayed then, whatever the budget; the
others are replayed while the step's time budget lasts and otherwise wait (the backlog), up to
`max_backlog`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aegis_sdc.bounded import RECORDS_KEPT
from aegis_sdc.config import VerifyConfig
from aegis_sdc.events import Channel, Verdict, VerdictKind, VTask, WrongExecution


@dataclass
class VerifierTelemetry:
    verified: int = 0
    replay_ms_total: float = 0.0
    max_latency_steps: int = 0
    max_latency_ms: float = 0.0
    max_backlog: int = 0
    last_backlog: int = 0
    latencies_ms: deque[float] = field(default_factory=lambda: deque(maxlen=RECORDS_KEPT))  # the latest


@dataclass(frozen=True)
class KeptReplay:
    """A confirmed vTask's replay context and the verifier's replays of it (in order; none for payloads
    that decide for themselves)."""

    payload: Any
    replays: tuple[Any, ...]


class Verifier:
    def __init__(self, config: VerifyConfig, *, keep_confirmed: bool = False) -> None:
        self.config = config
        self.pending: deque[VTask] = deque()
        self.telemetry = VerifierTelemetry()
        self.keep_confirmed = keep_confirmed
        self.kept: dict[int, KeptReplay] = {}  # vTask id → its context, for confirmed verdicts; the caller pops

    def submit(self, tasks: list[VTask]) -> None:
        self.pending.extend(tasks)

    @property
    def backlog(self) -> int:
        return len(self.pending)

    def run(self, step: int, *, drain: bool = False) -> list[Verdict]:
        """Verify what must be verified now, then what the budget allows. `drain` verifies all."""
        deadline = time.perf_counter() + self.config.time_budget_ms / 1000.0
        verdicts: list[Verdict] = []
        waiting: deque[VTask] = deque()
        while self.pending:
            task = self.pending.popleft()
            over_backlog = len(self.pending) + len(waiting) >= self.config.max_backlog
            if drain or task.references_tensors or over_backlog or time.perf_counter() < deadline:
                verdicts.append(self.verify(task, step))
            else:
                waiting.append(task)
        self.pending = waiting
        t = self.telemetry
        t.last_backlog = len(waiting)
        t.max_backlog = max(t.max_backlog, len(waiting))
        return verdicts

    def verify(self, task: VTask, step: int) -> Verdict:
        started = time.perf_counter()
        replays: list = []
        kind, wrong, tiles, no_effect, detail = self._triage(task, replays)
        finished = time.perf_counter()
        if self.keep_confirmed and kind is VerdictKind.CONFIRMED_SDC:
            self.kept[task.id] = KeptReplay(task.payload, tuple(replays))
        traced_upstream = kind is VerdictKind.CONFIRMED_SDC and getattr(task.payload, "traced_upstream", False)
        task.payload = None  # release the replay context's tensors
        verdict = Verdict(
            vtask_id=task.id,
            site=task.site,
            step=task.step,
            kind=kind,
            wrong_execution=wrong,
            no_effect_on_output=no_effect,
            mismatched_tiles=tiles,
            detail=detail,
            replay_ms=(finished - started) * 1000.0,
            latency_steps=step - task.step,
            latency_ms=(finished - task.raised_perf) * 1000.0,
            traced_upstream=traced_upstream,
        )
        t = self.telemetry
        t.verified += 1
        t.replay_ms_total += verdict.replay_ms
        t.max_latency_steps = max(t.max_latency_steps, verdict.latency_steps)
        t.max_latency_ms = max(t.max_latency_ms, verdict.latency_ms)
        t.latencies_ms.append(verdict.latency_ms)
        return verdict

    @staticmethod
    def _triage(task: VTask, replays: list):
        """The verdict's fields; the GEMM replays run are appended to `replays`."""
        payload = task.payload
        evidence_tile = (task.evidence.tile,) if task.evidence.tile else ()
        if payload is None:
            return VerdictKind.NOT_VERIFIABLE, None, (), False, "no replay context was captured"
        if callable(getattr(payload, "verdict", None)):
            # Payloads that decide for themselves: a collective (a mismatch beyond the exact rounding
            # bound of the reduction is proof on its own), fingerprints (a third look decides),
            # attention heads (two replays of the head).
            try:
                kind, wrong, detail = payload.verdict()
            except (RuntimeError, MemoryError) as error:
                return VerdictKind.NOT_VERIFIABLE, None, (), False, f"verification failed: {error}"
            return kind, wrong, evidence_tile if kind is VerdictKind.CONFIRMED_SDC else (), False, detail
        changed = payload.references_changed()
        if changed:
            return VerdictKind.NOT_VERIFIABLE, None, (), False, changed
        if task.evidence.channel is Channel.NONFINITE and not payload.inputs_finite():
            return (
                VerdictKind.NONFINITE_INPUT,
                None,
                (),
                False,
                "NaN/Inf in the operands of the suspect block",
            )
        try:
            saved = payload.saved
            first = payload.replay()
            replays.append(first)
            diff = payload.diff(saved, first)
            if diff.derived_differs:
                return VerdictKind.NOT_VERIFIABLE, None, (), False, _operand_changed(payload, first)
            if diff.equal:
                violations = payload.exact_violations()
                if violations:
                    detail = (
                        f"replay identical, but {violations} saved value(s) lie outside the exact fp32 "
                        "error bound of an fp64 recomputation: every execution on this device is wrong"
                    )
                    return (
                        VerdictKind.CONFIRMED_SDC,
                        WrongExecution.REPRODUCIBLE,
                        evidence_tile,
                        False,
                        detail,
                    )
                if task.evidence.channel is Channel.NONFINITE:
                    # finite operands that overflow the same way on every run: the data's values, not
                    # the device (an upstream corruption's huge values, a diverging run)
                    return (
                        VerdictKind.NONFINITE_INPUT,
                        None,
                        (),
                        False,
                        "NaN/Inf from finite operands, reproduced bit for bit: the data's values overflow",
                    )
                return VerdictKind.FALSE_ALARM, None, (), False, "replay reproduced every bit"
            second = payload.replay()
            replays.append(second)
            if payload.diff(first, second).equal:
                wrong, detail = (
                    WrongExecution.ORIGINAL,
                    "two replays agree; the training step's result differs",
                )
            elif payload.diff(saved, second).equal:
                wrong, detail = WrongExecution.REPLAY, "the second replay agrees with the training step"
            else:
                wrong, detail = WrongExecution.UNSTABLE, "all three executions differ"
            if diff.reference_differs and not diff.tiles:
                detail += "; only the reference side A·(B·1) differs"
            no_effect = not diff.output_differs and not diff.reference_differs
            if no_effect:
                detail += "; the rounded output is identical (rounding absorbed the corruption)"
            return VerdictKind.CONFIRMED_SDC, wrong, diff.tiles or evidence_tile, no_effect, detail
        except (RuntimeError, MemoryError) as error:  # e.g. out of memory during the replay
            return VerdictKind.NOT_VERIFIABLE, None, (), False, f"replay failed: {error}"


def _operand_changed(payload, first) -> str:
    """The reason a replay whose B·1 differs from the step's cannot be judged; a second replay says
    whether the recomputation at least agrees with itself."""
    stable = not payload.diff(first, payload.replay()).derived_differs
    return (
        "B·1 recomputed from the referenced weight differs from the vector the training step used"
        + (" (two recomputations agree)" if stable else " (and two recomputations disagree: it is being written)")
        + ": the weight changed after the step without bumping its version (a fused optimizer or a"
        " write through p.data before the step was verified; call guard.step() before updating weights,"
        " or pass the optimizer to protect()), so the replay cannot compute what the step computed"
    )
