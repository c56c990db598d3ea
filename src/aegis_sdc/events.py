"""The shared vocabulary of the pipeline: sensor → verification task → verifier → verdict → incident.

Everything here is plain data. Sensors produce `Evidence`; evidence over a threshold becomes a
`VTask` that carries the smallest context needed to replay the computation; the verifier turns a
vTask into a `Verdict`; a confirmed verdict becomes an `Incident` that names the site, the step and
the device. Every record is JSON-serializable through `to_dict()` so the store and the CLI speak the
same words.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import Any


class GemmKind(str, enum.Enum):
    """Which of a Linear's three GEMMs a site protects."""

    FORWARD = "fwd"  # Y  = X·Wᵀ        [M, N] = [M, K]·[K, N]
    DGRAD = "dgrad"  # dX = dY·W        [M, K] = [M, N]·[N, K]
    WGRAD = "wgrad"  # dW = dYᵀ·X       [N, K] = [N, M]·[M, K]


class CommKind(str, enum.Enum):
    """Which gradient collective a communication site protects."""

    ALLREDUCE = "allreduce"  # DDP bucket
    REDUCE_SCATTER = "reduce_scatter"  # FSDP2 parameter group


class FingerprintKind(str, enum.Enum):
    """What a fingerprint site compares."""

    RECOMPUTE = "recompute"  # a checkpointed segment's output: forward against its recomputation
    SAVED = "saved"  # a tensor saved for backward: when saved against when used


class AttentionKind(str, enum.Enum):
    """Which pass of an attention module a site protects."""

    FORWARD = "attn_fwd"  # O·1 against P·(V·1)
    BACKWARD = "attn_bwd"  # 1ᵀdV against 1ᵀdO


class StateKind(str, enum.Enum):
    """What a state site protects: a parameter's replicated state, its optimizer update, or (module
    "model") a whole micro-batch's step."""

    PARAM = "param"  # a parameter's value, voted across data-parallel replicas
    OPTIMIZER_STATE = "optimizer_state"  # its optimizer state (Adam's moments, …), voted likewise
    OPTIMIZER_UPDATE = "optimizer_update"  # its update, re-executed from a snapshot of its inputs
    PEER_REPLAY = "peer_replay"  # a micro-batch's forward and backward, recomputed by a peer rank


class Channel(str, enum.Enum):
    """Which checksum raised the evidence."""

    ROW = "row"  # GEMM C = A·B: C·1 against A·(B·1), one value per row
    COL = "col"  # GEMM: 1ᵀC against (1ᵀA)·B, one value per column
    NONFINITE = "nonfinite"  # the checksums themselves are NaN/Inf
    COMM = "comm"  # collective: a reduced chunk's sum against the sum of the ranks' local sums
    FINGERPRINT = "fingerprint"  # two fingerprints of what must be the same bits
    VOTE = "vote"  # the replicas' fingerprints of what must be the same state


class VerdictKind(str, enum.Enum):
    CONFIRMED_SDC = "confirmed_sdc"  # the replay proves a wrong result was computed
    FALSE_ALARM = "false_alarm"  # the replay reproduced everything bit for bit: numerical noise
    NOT_VERIFIABLE = "not_verifiable"  # the replay context was gone or changed (see Verdict.detail)
    NONFINITE_INPUT = "nonfinite_input"  # NaN/Inf came from the data, not from the device
    NOT_DETERMINISTIC = "not_deterministic"  # a repeated computation differs on its own: not covered
    # proof of a corruption in work several devices shared (a collective's result), that neither a
    # majority of ranks nor a replay pins on one device: reported with the ranks involved, no device
    # quarantined
    UNATTRIBUTED = "unattributed_sdc"


class WrongExecution(str, enum.Enum):
    """For a confirmed SDC: which execution computed the wrong numbers."""

    ORIGINAL = "original"  # the training step; two replays agree with each other
    REPLAY = "replay"  # the first replay; the second agrees with the training step
    UNSTABLE = "unstable"  # all three executions differ: the device is not deterministic
    REPRODUCIBLE = "reproducible"  # every execution agrees, and all violate an exact error bound


@dataclass(frozen=True)
class Site:
    """One protected op instance, e.g. ``layers.3.mlp.up_proj:wgrad`` or ``ddp.bucket2:allreduce``.

    `id` is a dense index assigned in module order (then collective order), identical on every rank.
    """

    id: int
    module: str
    kind: GemmKind | CommKind | FingerprintKind | AttentionKind | StateKind
    op: str = "linear"

    @property
    def name(self) -> str:
        return f"{self.module}:{self.kind.value}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "module": self.module,
            "kind": self.kind.value,
            "op": self.op,
        }


@dataclass(frozen=True)
class Tile:
    """A rectangle of a GEMM's output, half-open: rows [row_start, row_stop) × cols [col_start, col_stop)."""

    row_start: int
    row_stop: int
    col_start: int
    col_stop: int

    def __str__(self) -> str:
        return f"rows {self.row_start}:{self.row_stop} × cols {self.col_start}:{self.col_stop}"

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RankIdentity:
    """Where a record was produced: enough to pull one GPU out of a cluster."""

    host: str
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    gpu_uuid: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Evidence:
    """What a sensor saw on one checked call whose statistic crossed its threshold.

    `value` is the largest normalized checksum difference over the rows (or columns) of the GEMM,
    in units of fp32 rounding: |C·1 − A·(B·1)|ᵢ / (u·sᵢ) with u = 2⁻²⁴ and sᵢ the operand
    magnitude of row i (see kernels/reference.py). `raw_l2` is the unnormalized ‖C·1 − A·(B·1)‖₂.
    """

    site: Site
    step: int
    call: int
    channel: Channel
    value: float
    threshold: float
    index: int  # the row (or column) with the largest difference
    raw_l2: float
    tile: Tile | None = None  # the region captured for replay
    channels: tuple[Channel, ...] = ()  # every channel over its threshold (`channel` is the first)

    def to_dict(self) -> dict[str, Any]:
        return {
            "site": self.site.name,
            "step": self.step,
            "call": self.call,
            "channel": self.channel.value,
            "value": self.value,
            "threshold": self.threshold,
            "index": self.index,
            "raw_l2": self.raw_l2,
            "tile": self.tile.to_dict() if self.tile else None,
            "channels": [c.value for c in self.channels],
        }


@dataclass(eq=False)
class VTask:
    """A verification task: evidence plus the minimal context to replay the suspect computation.

    `payload` is owned by the op that raised it (for a GEMM: the suspect row block of A, the
    column block of B — the weight by reference — and the output tile and fp32 checksums the
    training step produced). It exposes `replay()`, `compare()` and `references_changed()`.
    """

    id: int
    evidence: Evidence
    payload: Any
    raised_wall: float = field(default_factory=time.time)
    raised_perf: float = field(default_factory=time.perf_counter)

    @property
    def site(self) -> Site:
        return self.evidence.site

    @property
    def step(self) -> int:
        return self.evidence.step

    @property
    def references_tensors(self) -> bool:
        """True when the payload points at tensors the optimizer may change (weights)."""
        return bool(getattr(self.payload, "references", ()))


@dataclass(frozen=True)
class Verdict:
    vtask_id: int
    site: Site
    step: int
    kind: VerdictKind
    wrong_execution: WrongExecution | None = None
    no_effect_on_output: bool = False  # a corrupted accumulator that rounding to bf16/fp16 absorbed
    mismatched_tiles: tuple[Tile, ...] = ()
    detail: str = ""
    replay_ms: float = 0.0
    latency_steps: int = 0  # verified at step + latency_steps
    latency_ms: float = 0.0  # wall time from raising the vTask to the verdict
    # Confirmed, and the wrong execution the replay found is upstream of the site's own work: the
    # module's forward (a backward check that read the forward's wrong saved output, a recomputation
    # that disagrees with a wrong forward), or the rank's whole step (a peer replay naming this rank).
    traced_upstream: bool = False
    # That upstream fault is already an incident (its own check confirmed it at the step): this
    # verdict found the same fault again and opens no incident of its own.
    same_fault_as: int | None = None

    @property
    def confirmed(self) -> bool:
        return self.kind is VerdictKind.CONFIRMED_SDC

    def to_dict(self) -> dict[str, Any]:
        return {
            "vtask_id": self.vtask_id,
            "site": self.site.name,
            "step": self.step,
            "kind": self.kind.value,
            "wrong_execution": self.wrong_execution.value if self.wrong_execution else None,
            "no_effect_on_output": self.no_effect_on_output,
            "mismatched_tiles": [t.to_dict() for t in self.mismatched_tiles],
            "detail": self.detail,
            "replay_ms": self.replay_ms,
            "latency_steps": self.latency_steps,
            "latency_ms": self.latency_ms,
            "traced_upstream": self.traced_upstream,
            "same_fault_as": self.same_fault_as,
        }


@dataclass(frozen=True)
class Incident:
    """A confirmed silent data corruption, attributed to one device."""

    id: int
    site: Site
    step: int
    identity: RankIdentity
    evidence: Evidence
    verdict: Verdict
    created_wall: float = field(default_factory=time.time)

    def describe(self) -> str:
        who = self.identity
        gpu = f" ({who.gpu_uuid})" if who.gpu_uuid else ""
        tiles = ", ".join(str(t) for t in self.verdict.mismatched_tiles) or "n/a"
        if self.evidence.channel is Channel.FINGERPRINT:
            seen = f"the fingerprints of {int(self.evidence.value)} tensor(s) differ"
        elif self.evidence.channel is Channel.VOTE:
            seen = f"its replica differs from {int(self.evidence.value)} agreeing replica(s)"
        else:
            seen = (
                f"{self.evidence.channel.value} checksum {self.evidence.value:.3g} > threshold "
                f"{self.evidence.threshold:.3g}"
            )
        return (
            f"confirmed SDC at {self.site.name}, step {self.step}, rank {who.rank} on {who.host} "
            f"device {who.device}{gpu}: {seen}; "
            f"wrong execution: {self.verdict.wrong_execution.value if self.verdict.wrong_execution else '?'}; "
            f"tiles: {tiles}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "site": self.site.name,
            "step": self.step,
            "identity": self.identity.to_dict(),
            "evidence": self.evidence.to_dict(),
            "verdict": self.verdict.to_dict(),
            "created_wall": self.created_wall,
        }
