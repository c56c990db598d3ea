"""What a guard reports of its run: `Guard.summary()` and `Guard.close()` return it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class GuardSummary:
    steps: int
    sites: int
    checks: int
    alarms: int
    false_alarms: int
    confirmed: int
    not_verifiable: int
    nonfinite_inputs: int
    backlog: int
    verified: int
    max_latency_steps: int
    max_latency_ms: float
    replay_ms_total: float
    faults_injected: int
    outlier_warnings: int = 0
    fingerprint_checks: int = 0
    attention_checks: int = 0
    not_deterministic: int = 0
    coverage: dict[str, Any] = field(default_factory=dict)  # fingerprint sites checked / not covered
    unattributed: int = 0  # proven corruptions no majority or replay pins on one device (collectives)
    data_false_alarms: int = 0  # false alarms on unusual data: thresholds left alone
    checked_flops_fraction: float = 0.0  # of all GEMM FLOPs run while protected, the checked share
    attention_checked_flops_fraction: float = 0.0  # of the FLOPs of the attention calls the op takes
    state_votes: int = 0  # replica state votes judged (sensors/state_vote.py)
    update_replays: int = 0  # optimizer-update slices replayed (sensors/update_replay.py)
    peer_replays: int = 0  # steps whose micro-batches peers recomputed (distributed/peer_replay.py)
    # per state sensor: its measured ms per firing, period in steps and ms per step (runtime/sensor_cost.py)
    state_sensor_costs: dict[str, dict] = field(default_factory=dict)
    # a long run's overflow, counted (docs/operations.md): incidents, injected faults and outlier
    # warnings no longer held in memory (the store has them), statistics-only step records the store
    # could not take, console lines the rate limit held back, store records still waiting (a full disk)
    records_dropped_from_memory: int = 0
    store_records_dropped: int = 0
    console_lines_held_back: int = 0
    store_records_waiting: int = 0
    # confirmed verdicts that met an incident's fault again downstream (a backward check that read the
    # forward's wrong output, a recomputation against a wrong forward): no incident of their own
    same_fault: int = 0

    @property
    def false_alarm_rate(self) -> float:
        """False alarms per checked call."""
        return self.false_alarms / self.checks if self.checks else 0.0

    def brief(self) -> str:
        """One line for a log."""
        return (f"{self.steps} steps, {self.checks} checks, {self.confirmed} confirmed SDCs, "
                f"{self.false_alarms} false alarms")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"false_alarm_rate": self.false_alarm_rate}
