"""Replica state vote: data-parallel replicas hold the same parameters and optimizer state between
one update and the next, so every rank fingerprints its copy and the ranks compare.

No GEMM, attention or fingerprint check sees a weight or an Adam moment corrupted at rest, a replica
that missed an update (stale weights), or an update that went wrong on one rank: the arithmetic
they wrap is right, its inputs are not. Replicas are the reference for each other.

When. At a step's end, before its update (the optimizer pre-hook, or `guard.step()`): the parameters
are then the previous update's output, which every replica computed with the same element-wise
update from the same reduced gradient (DDP); forward and backward do not write them. The
fingerprints (ops/fingerprint.py, 64 bits per tensor) are taken on the device and copied to the host
without waiting; they travel in the next step's exchange (`StepRuntime.exchange`), by when the copy has long
landed — a vote never makes a step wait for the device. A corruption at rest is fingerprinted at the
first vote of its slice and judged a step later.

What. Each vote has a fixed number of int64 columns, the same on every rank:
- `param_columns`: the parameters of slice `vote % param_slices` (every parameter at every vote by
  default), one fingerprint each;
- `state_columns`: the optimizer state of slice `vote % state_slices` of the parameters, the
  fingerprints of a parameter's state tensors folded into one value (all state every
  `state_slices` votes: its tensors are 2–3× the parameters' bytes);
- how many updates this rank's `skip-step` policy dropped (replicas differ by design after one).
0 marks a column with nothing to compare (a parameter without state yet, a tensor the kernel cannot
read in place).

Replicas. Under DDP every rank of the data-parallel group is a replica. Under HSDP (FSDP2 on a 2-D
mesh, parameters `Replicate` on one dimension and `Shard` on the other) each rank holds a shard, and
the ranks that hold the same shard — one per index of the replicate dimension — are its replicas:
each rank fingerprints its local shards (parameters and optimizer state alike), the vote is gathered
over all ranks and every replica set is judged on its own rows. Plain FSDP has no replicas: no vote.

Verdict. Within a replica set, a column whose non-zero values differ: with a strict majority,
every rank outside it holds state its replicas do not — a confirmed SDC on that rank, named at once,
the majority being the proof (a wrong fingerprint is a wrong computation of that device too).
Without one (two replicas, an even split) nobody is named: an unattributed SDC listing the ranks
involved, recorded once, by the lowest of them. A divergence is raised once: a corrupted tensor
stays different at every later vote (the update carries it on), and is raised again only when the
ranks that differ change. A vote whose dropped-update counts differ judges nothing and says so once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from aegis_sdc.events import StateKind, VerdictKind, WrongExecution
from aegis_sdc.kernels import fingerprint as kfp
from aegis_sdc.ops.fingerprint import FingerprintRows
from aegis_sdc.ops.transfer import PendingTransfer, start_to_host

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
    """The columns of one vote, taken at the end of `step`: their fingerprints are on their way to the
    host in `transfer` (started with the launch, without waiting); `read` decodes them."""

    step: int
    columns: list[VoteColumn]
    dropped_updates: int
    transfer: PendingTransfer  # of int32 [tensors, ROW]
    seen: list[bool]
    on_host: dict[int, int] = field(default_factory=dict)  # row → fingerprint taken on the host
    fingerprints: list[int] | None = None

    def read(self) -> None:
        """The fingerprints, waiting for their copy only if it has not landed yet."""
        if self.fingerprints is None:
            (host_rows,) = self.transfer.wait()
            self.fingerprints = FingerprintRows.values(host_rows, self.seen)
            for row, value in self.on_host.items():
                self.fingerprints[row] = value

    def values(self, width: int) -> torch.Tensor:
        """int64 [width]: the columns' values (0: nothing to compare), padded with 0, then the
        dropped-update count."""
        fps = self.fingerprints or []
        out = [kfp.signed64(fold([fps[r] or None for r in c.rows])) if c.rows and fps else 0 for c in self.columns]
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


def local(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's (FSDP2's DTensor) local shard, detached; any other tensor detached."""
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def replica_sets(module: nn.Module) -> list[tuple[int, ...]] | None:
    """The replica sets of an HSDP module (FSDP2 on a mesh with a `Replicate` dimension): global ranks
    holding the same shards, one tuple per shard position. None when the parameters are not DTensors
    or no mesh dimension replicates them (plain FSDP: nothing to vote on)."""
    from torch.distributed.tensor import Replicate

    param = next((p for p in module.parameters() if hasattr(p, "device_mesh")), None)
    if param is None:
        return None
    dims = [i for i, placement in enumerate(param.placements) if isinstance(placement, Replicate)]
    if not dims:
        return None
    mesh = param.device_mesh.mesh  # int [mesh shape]: global ranks
    # the replicate dimensions last, then one row per shard position: the ranks that hold it
    last = list(range(mesh.ndim - len(dims), mesh.ndim))
    rows = mesh.movedim(dims, last).reshape(-1, math.prod(mesh.shape[d] for d in dims))
    return [tuple(int(r) for r in row) for row in rows]


class StateVote:
    """The vote of one guard: which tensors each vote fingerprints, and how a gathered vote reads."""

    def __init__(self, model: nn.Module, device: torch.device, *, param_slices: int, state_slices: int,
                 sets: list[tuple[int, ...]] | None = None) -> None:  # fmt: skip
        # Parameters in module order: the same on every replica. Shared parameters (tied weights)
        # once, under their first name.
        self.params: list[tuple[str, nn.Parameter]] = list(model.named_parameters())
        self.sets = sets  # HSDP's replica sets (global ranks); None: every rank is a replica
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
        tensors: list[torch.Tensor] = [local(p) for _, p in chosen]
        columns = [VoteColumn(name, StateKind.PARAM, (i,)) for i, (name, _) in enumerate(chosen)]
        state = optimizer.state if optimizer is not None else {}
        for name, p in self.params[vote % self.state_slices :: self.state_slices]:
            own = state.get(p, {})
            values = [local(own[key]) for key in sorted(own) if isinstance(own[key], torch.Tensor)]
            rows = tuple(range(len(tensors), len(tensors) + len(values)))
            columns.append(VoteColumn(name, StateKind.OPTIMIZER_STATE, rows))
            tensors.extend(values)
        if len(tensors) > self._rows.rows.shape[0]:  # more state tensors per parameter than room for
            self._rows = FingerprintRows(2 * len(tensors), self.device)
        # State kept on the host beside device parameters (a for-loop or foreach Adam's step count is a
        # CPU scalar): fingerprinted here at once — the device kernel cannot read host memory.
        on_device = self._rows.rows.is_cuda
        on_host = {i: kfp.fingerprint_reference(t) for i, t in enumerate(tensors) if on_device and not t.is_cuda}
        seen = self._rows.take([None if i in on_host else t for i, t in enumerate(tensors)])
        # the next vote rewrites the rows: on the device its launch is ordered after this copy (one
        # stream); on the host the rows are the values already, kept as a copy
        rows = self._rows.rows[: len(tensors)]
        transfer = start_to_host([rows if on_device else rows.clone()])
        return VoteRecord(step, columns, dropped_updates, transfer, seen, on_host)

    def judge(self, record: VoteRecord, gathered: torch.Tensor, ranks: list[int]) -> list[VoteFinding] | None:
        """The disagreements of a gathered vote (int64 [len(ranks), width], a row per rank of
        `ranks`); None when the replicas are out of step by design (their dropped-update counts
        differ). Each replica set is judged on its own rows."""
        if len(set(gathered[:, -1].tolist())) > 1:
            self.skipped_votes += 1
            return None
        findings = []
        for members in self.sets or [tuple(ranks)]:
            rows = [ranks.index(r) for r in members if r in ranks]
            findings += self._judge_set(record, gathered[rows], [ranks[i] for i in rows])
        return findings

    def _judge_set(self, record: VoteRecord, gathered: torch.Tensor, ranks: list[int]) -> list[VoteFinding]:
        findings = []
        for index, column in enumerate(record.columns):
            values = gathered[:, index].tolist()
            known = [v for v in values if v != 0]
            key = (column.param, column.kind, tuple(ranks))
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
