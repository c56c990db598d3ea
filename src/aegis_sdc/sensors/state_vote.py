"""Replica state vote: data-parallel replicas hold the same parameters and optimizer state between
one update and the next, so every rank fingerprints its copy and the ranks compare.

No GEMM, attention or fingerprint check sees a weight or an Adam moment corrupted at rest, a replica
that missed an update (stale weights), or an update that went wrong on one rank: the arithmetic
they wrap is right, its inputs are not. Replicas are the reference for each other.

When. At a step's end, before its update (the optimizer pre-hook, or `guard.step()`): the parameters
are then the previous update's output, which every replica computed with the same element-wise
update from the same reduced gradient (DDP); forward and backward do not write them. The
fingerprints (ops/fingerprint.py, 64 bits per tensor) are taken on the device, come to the host in
the step's one read and travel in the step's one exchange (guard._exchange). A corruption at rest is
seen at the next step's end.

What. Each vote has a fixed number of int64 columns, the same on every rank:
- `param_columns`: the parameters of slice `vote % param_slices` (every parameter at every vote by
  default), one fingerprint each;
- `state_columns`: the optimizer state of slice `vote % state_slices` of the parameters, the
  fingerprints of a parameter's state tensors folded into one value (all state every
  `state_slices` votes: its tensors are 2–3× the parameters' bytes);
- how many updates this rank's `skip-step` policy dropped (replicas differ by design after one).
0 marks a column with nothing to compare (a parameter without state yet, a tensor the kernel cannot
read in place).

Verdict. A column whose non-zero values differ: with a strict majority, every rank outside it holds
state its replicas do not — a confirmed SDC on that rank, named at once, the majority being the
proof (a wrong fingerprint is a wrong computation of that device too). Without one (two replicas, an
even split) nobody is named: an unattributed SDC listing the ranks involved, recorded once, by the
lowest of them. A divergence is raised once: a corrupted tensor stays different at every later vote
(the update carries it on), and is raised again only when the ranks that differ change. A vote whose
dropped-update counts differ judges nothing and says so once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from aegis_sdc.events import StateKind, VerdictKind, WrongExecution
from aegis_sdc.kernels.fingerprint import signed64
from aegis_sdc.ops.fingerprint import FingerprintRows

MASK64 = (1 << 64) - 1
_FOLD = 0x9E3779B97F4A7C15  # odd: folding keeps every state tensor's fingerprint in the value


def fold(values: list[int | None]) -> int:
    """One non-zero 64-bit value from several fingerprints, order-sensitive; 0 when none is known."""
    if not values or any(v is None for v in values):
        return 0
    acc = 0
    for value in values:
        acc = ((acc ^ value) * _FOLD + 1) & MASK64
    return acc or 1


@dataclass(frozen=True)
class VoteColumn:
    """One compared value: a parameter's fingerprint, or its optimizer state's."""

    param: str  # the parameter's name in the protected model
    kind: StateKind
    rows: tuple[int, ...]  # the rows of the vote's fingerprints it folds


@dataclass
class VoteRecord:
    """The columns of one vote, taken at the end of `step`: their fingerprints are in `buffer` (on the
    device until the step's read; `resolve` decodes the read rows)."""

    step: int
    columns: list[VoteColumn]
    dropped_updates: int
    buffer: torch.Tensor  # int32 [tensors, ROW]
    seen: list[bool]
    fingerprints: list[int] | None = None

    def resolve(self, host_rows: torch.Tensor) -> None:
        self.fingerprints = FingerprintRows.values(host_rows, self.seen)

    def values(self, width: int) -> torch.Tensor:
        """int64 [width]: the columns' values (0: nothing to compare), padded with 0, then the
        dropped-update count."""
        fps = self.fingerprints or []
        out = [signed64(fold([fps[r] or None for r in c.rows])) if c.rows and fps else 0 for c in self.columns]
        out += [0] * (width - 1 - len(out))
        return torch.tensor([*out, self.dropped_updates], dtype=torch.int64)


@dataclass(frozen=True)
class VoteFinding:
    """A column where the replicas disagree, as this rank reports it."""

    step: int
    param: str
    kind: StateKind
    ranks: tuple[int, ...]  # the data-parallel group, in order
    minority: tuple[int, ...]  # ranks outside the majority (all disagreeing ranks without one)
    majority: bool  # whether a strict majority agrees


class VoteCapture:
    """The payload of a vote finding: the vote is its own proof (see the module docstring)."""

    references = ()  # nothing held: the gathered fingerprints are the evidence

    def __init__(self, finding: VoteFinding) -> None:
        self.finding = finding

    def verdict(self) -> tuple[VerdictKind, WrongExecution | None, str]:
        f = self.finding
        what = "optimizer state" if f.kind is StateKind.OPTIMIZER_STATE else "value"
        if f.majority:
            agree = len(f.ranks) - len(f.minority)
            return (VerdictKind.CONFIRMED_SDC, WrongExecution.ORIGINAL,
                    f"the {what} of {f.param} on rank(s) {list(f.minority)} differs from the {agree} of "
                    f"{len(f.ranks)} replicas that agree (fingerprints taken before the update of step "
                    f"{f.step})")  # fmt: skip
        return (VerdictKind.UNATTRIBUTED, None,
                f"the replicas of the {what} of {f.param} differ on ranks {list(f.minority)} and no majority "
                "decides which is wrong: no rank named")  # fmt: skip


class StateVote:
    """The vote of one guard: which tensors each vote fingerprints, and how a gathered vote reads."""

    def __init__(self, model: nn.Module, device: torch.device, *, param_slices: int, state_slices: int) -> None:
        # Parameters in module order: the same on every replica. Shared parameters (tied weights)
        # once, under their first name.
        self.params: list[tuple[str, nn.Parameter]] = list(model.named_parameters())
        self.device = device
        self.param_slices = param_slices
        self.state_slices = state_slices
        n = len(self.params)
        self.param_columns = -(-n // param_slices)
        self.state_columns = -(-n // state_slices)
        self._rows = FingerprintRows(self.param_columns + 4 * self.state_columns, device)
        self.votes = 0
        self.skipped_votes = 0  # votes that judged nothing: the replicas are out of step by design
        self.known: dict[tuple[str, StateKind], tuple[int, ...]] = {}  # raised divergences → their ranks

    @property
    def width(self) -> int:
        """int64 values a vote sends: its columns and the dropped-update count."""
        return self.param_columns + self.state_columns + 1

    def take(self, step: int, optimizer: torch.optim.Optimizer | None, dropped_updates: int) -> VoteRecord:
        """Fingerprint this vote's tensors as they are now (one launch on the current stream)."""
        vote = self.votes
        self.votes += 1
        chosen = self.params[vote % self.param_slices :: self.param_slices]
        tensors: list[torch.Tensor] = [p.detach() for _, p in chosen]
        columns = [VoteColumn(name, StateKind.PARAM, (i,)) for i, (name, _) in enumerate(chosen)]
        state = optimizer.state if optimizer is not None else {}
        for name, p in self.params[vote % self.state_slices :: self.state_slices]:
            own = state.get(p, {})
            values = [own[key] for key in sorted(own) if isinstance(own[key], torch.Tensor)]
            rows = tuple(range(len(tensors), len(tensors) + len(values)))
            columns.append(VoteColumn(name, StateKind.OPTIMIZER_STATE, rows))
            tensors.extend(values)
        if len(tensors) > self._rows.rows.shape[0]:  # more state tensors per parameter than room for
            self._rows = FingerprintRows(2 * len(tensors), self.device)
        seen = self._rows.take(tensors)
        return VoteRecord(step, columns, dropped_updates, self._rows.rows[: len(tensors)], seen)

    def judge(self, record: VoteRecord, gathered: torch.Tensor, ranks: list[int]) -> list[VoteFinding] | None:
        """The disagreements of a gathered vote (int64 [len(ranks), width]); None when the replicas
        are out of step by design (their dropped-update counts differ)."""
        if len(set(gathered[:, -1].tolist())) > 1:
            self.skipped_votes += 1
            return None
        findings = []
        for index, column in enumerate(record.columns):
            values = gathered[:, index].tolist()
            known = [v for v in values if v != 0]
            key = (column.param, column.kind)
            if len(set(known)) <= 1:
                self.known.pop(key, None)
                continue
            counts: dict[int, int] = {}
            for v in known:
                counts[v] = counts.get(v, 0) + 1
            top, top_count = max(counts.items(), key=lambda item: item[1])
            majority = top_count * 2 > len(values)
            if majority:
                minority = tuple(r for r, v in zip(ranks, values, strict=True) if v not in (0, top))
            else:
                minority = tuple(r for r, v in zip(ranks, values, strict=True) if v != 0)
            if self.known.get(key) == minority:
                continue  # raised at an earlier vote
            self.known[key] = minority
            findings.append(VoteFinding(record.step, column.param, column.kind, tuple(ranks), minority, majority))
        return findings
