"""Peer replay of a step (after SCOUT): every `period` steps each data-parallel rank's micro-batch is
recomputed by a peer with the same weights, and the two ranks' local gradients — before the
all-reduce mixes them — are compared by fingerprint.

This sees what no op-level check does: corruption between the checked ops (element-wise ops, norms,
a module's output), in a gradient in memory before it is reduced, or in weights the step used. It
needs the step to be deterministic (the same inputs give the same bits), as recomputation does.

The user computes each micro-batch's loss through `guard.run_batch(loss_fn, batch)` (`loss_fn(module,
batch) -> loss`): on a replay step the guard keeps the batch and the RNG state it ran with. During
the backward the checked all-reduce hook hands each bucket's gradients to `local_gradients` before
reducing them: their fingerprints are this rank's *original*. At the step's end, before the update:

1. every rank sends its batch and RNG state to every other (tensors only, over the exchange group);
2. rank r + 1 runs rank r's batch through the same module and the same checked Linears (the step's
   sampling plan is replayed, so the same kernels run) and fingerprints the gradients
   (`torch.autograd.grad`: the parameters' `.grad` are left alone, no collective runs);
3. the ranks gather (original, replay) fingerprints; rank r's batch whose two differ is executed a
   third time — by rank r + 2, or with two ranks by rank r itself — and the three decide:
   - the third agrees with the replay: rank r's step was wrong → a confirmed SDC on rank r;
   - it agrees with rank r's original (three ranks): the replaying peer was wrong → confirmed on it;
   - two ranks, and rank r's own re-execution agrees with its original: the ranks differ
     persistently and nothing says which is right → proven, no rank named (a pair);
   - all three differ: the step is not deterministic → not covered (reported once).
One host read and a few small collectives, on replay steps only; other steps cost a counter.
Covered: one `run_batch` per step (gradient accumulation: steps with several are not replayed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from aegis_sdc.distributed.context import DistContext
from aegis_sdc.events import VerdictKind, WrongExecution
from aegis_sdc.kernels import fingerprint as kfp

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def flatten_batch(batch: Any) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Any]]:
    """A batch (tensor, or lists, tuples and dicts of them) as its tensors and a function that builds
    the same structure from other tensors (every rank's batch has the same structure)."""
    if isinstance(batch, torch.Tensor):
        return [batch], lambda ts: ts[0]
    if isinstance(batch, (list, tuple)):
        parts = [flatten_batch(b) for b in batch]
        sizes = [len(p[0]) for p in parts]

        def build_seq(ts: list[torch.Tensor]) -> Any:
            out, start = [], 0
            for (_, rebuild), size in zip(parts, sizes, strict=True):
                out.append(rebuild(ts[start : start + size]))
                start += size
            return type(batch)(out) if isinstance(batch, tuple) else out

        return [t for p in parts for t in p[0]], build_seq
    if isinstance(batch, dict):
        keys = list(batch)
        tensors, rebuild = flatten_batch([batch[k] for k in keys])
        return tensors, lambda ts: dict(zip(keys, rebuild(ts), strict=True))
    raise TypeError(f"run_batch: a batch must be tensors in lists, tuples or dicts, got {type(batch).__name__}")


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]  # fmt: skip
_HEADER = 10  # per tensor: dtype code, ndim, up to 8 dims


def gather_tensors(ctx: DistContext, tensors: list[torch.Tensor], step: int) -> list[list[torch.Tensor]]:
    """Every data-parallel rank's `tensors` (the same count everywhere; any shapes and dtypes), as
    CPU tensors, over the exchange group: a header gather, then the bytes padded to the longest."""
    header = torch.zeros(len(tensors), _HEADER, dtype=torch.int64)
    blobs = []
    for i, t in enumerate(tensors):
        if t.dtype not in _DTYPES or t.dim() > _HEADER - 2:
            raise TypeError(f"run_batch: cannot exchange a {t.dtype} tensor of {t.dim()} dims")
        header[i, 0], header[i, 1] = _DTYPES.index(t.dtype), t.dim()
        header[i, 2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        blobs.append(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
    data = torch.cat(blobs) if blobs else torch.zeros(0, dtype=torch.uint8)
    headers = ctx.all_gather(torch.cat((header.reshape(-1), torch.tensor([data.numel()]))), step)
    longest = int(headers[:, -1].max())
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    everyone = ctx.all_gather(padded, step)
    out = []
    for rank in range(ctx.dp_size):
        rows = headers[rank, :-1].reshape(len(tensors), _HEADER).tolist()
        start, theirs = 0, []
        for code, ndim, *dims in rows:
            dtype, shape = _DTYPES[code], dims[:ndim]
            nbytes = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
            theirs.append(everyone[rank, start : start + nbytes].clone().view(dtype).reshape(shape))
            start += nbytes
        out.append(theirs)
    return out


@dataclass(frozen=True)
class PeerFinding:
    """A replayed batch whose executions disagree, as every rank sees it."""

    step: int
    owner: int  # the rank whose batch it is
    executions: dict[str, int]  # "original" / "replay" / "third" → the rank that ran it
    params: tuple[str, ...]  # parameters whose gradients differ (original against replay)
    blamed: int | None  # the rank named, None for a pair or an unstable step
    kind: VerdictKind
    wrong: WrongExecution | None
    detail: str


class PeerCapture:
    """The payload of a peer-replay finding: the executions were the replay (they decide)."""

    references = ()

    def __init__(self, finding: PeerFinding) -> None:
        self.finding = finding
        # A confirmed finding is about this rank's whole step (or its recomputation of a peer's): a
        # checked op of that step that confirmed the same fault already holds its incident.
        self.traced_upstream = finding.kind is VerdictKind.CONFIRMED_SDC

    def verdict(self) -> tuple[VerdictKind, WrongExecution | None, str]:
        f = self.finding
        return f.kind, f.wrong, f.detail


class PeerReplay:
    """The peer replay of one guard (see the module docstring)."""

    def __init__(self, module: nn.Module, ctx: DistContext, period: int, device: torch.device) -> None:
        self.module = module
        self.ctx = ctx
        self.period = period
        self.names = {id(p): name for name, p in module.named_parameters()}
        self.params = [p for _, p in module.named_parameters() if p.requires_grad]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.device = device
        self._original = torch.zeros(len(self.params), kfp.ROW, dtype=torch.int32, device=device)
        self._seen = torch.zeros(len(self.params), dtype=torch.bool)
        self._batch: tuple[LossFn, list[torch.Tensor], Callable, list[torch.Tensor]] | None = None
        self._batches_this_step = 0
        self.replays = 0
        self.not_covered: str | None = None

    def due(self, step: int) -> bool:
        return self.period > 0 and step % self.period == 0

    # -- during the step ------------------------------------------------------------------------------
    def run_batch(self, step: int, module: nn.Module, loss_fn: LossFn, batch: Any) -> torch.Tensor:
        """The user's micro-batch, kept on a replay step with the RNG state it runs with."""
        if not self.due(step):
            return loss_fn(module, batch)
        self._batches_this_step += 1
        if self._batches_this_step == 1:
            tensors, rebuild = flatten_batch(batch)
            self._batch = (loss_fn, tensors, rebuild, _rng_states(self.device))
            self._original.zero_()
            self._seen.zero_()
        else:
            self._batch = None  # accumulation: this step is not replayed
        return loss_fn(module, batch)

    def local_gradients(self, bucket) -> None:
        """A DDP bucket's gradients before the all-reduce (the checked all-reduce hook): fingerprinted
        on a replay step; on any other a check of one attribute."""
        if self._batch is not None:
            pairs = zip(bucket.parameters(), bucket.gradients(), strict=True)
            fingerprint_into([(g, self.index.get(id(p))) for p, g in pairs], self._original, self._seen)

    # -- at the step's end, before the update ---------------------------------------------------------
    def conclude(self, step: int, replaying: Callable[[], contextlib.AbstractContextManager]) -> list[PeerFinding]:
        """Exchange, replay, compare, settle (all ranks together); the findings, identical on every rank.
        `replaying()`: a context in which the guard's checked ops replay this step's plan."""
        if not self.due(step):
            return []
        kept, self._batch, count = self._batch, None, self._batches_this_step
        self._batches_this_step = 0
        ok = torch.tensor([1 if kept is not None and count == 1 else 0], dtype=torch.int64)
        if int(self.ctx.all_gather(ok, step).min()) == 0:  # some rank accumulated, or ran no run_batch
            if self.not_covered is None and count > 1:
                self.not_covered = "steps with several run_batch calls (gradient accumulation) are not replayed"
            return []
        loss_fn, tensors, rebuild, rng = kept
        n = self.ctx.dp_size
        everyone = gather_tensors(self.ctx, [*tensors, *rng], step)
        me = self.ctx.dp_rank
        original = self._fingerprints_of(self._original, self._seen)

        def execute(owner: int) -> list[int]:
            theirs = everyone[owner]
            # each tensor where this rank's batch had it (the same structure on every rank)
            batch = rebuild([t.to(mine_.device) for t, mine_ in zip(theirs[: len(tensors)], tensors, strict=True)])
            with replaying():
                return self._replay(loss_fn, batch, theirs[len(tensors) :])

        previous = (me - 1) % n
        replayed = execute(previous)
        table = self.ctx.all_gather(torch.tensor(original + replayed, dtype=torch.int64), step)
        width = len(self.params)
        originals, replays = table[:, :width], table[:, width:]  # replays[r]: rank r's replay of r − 1
        self.replays += 1
        suspects = [r for r in range(n) if _differ(originals[r], replays[(r + 1) % n])]
        if not suspects:
            return []
        third_runner = {r: (r + 2) % n if n >= 3 else r for r in suspects}
        mine = [r for r in suspects if third_runner[r] == me]
        row = torch.zeros(width, dtype=torch.int64)
        if mine:  # with three or more ranks a rank runs at most one third execution
            row = torch.tensor(execute(mine[0]), dtype=torch.int64)
        thirds = self.ctx.all_gather(row, step)
        findings = []
        for r in suspects:
            findings.append(self._settle(step, r, originals[r], replays[(r + 1) % n], thirds[third_runner[r]],
                                         (r + 1) % n, third_runner[r]))  # fmt: skip
        return findings

    def _replay(self, loss_fn: LossFn, batch: Any, rng: list[torch.Tensor]) -> list[int]:
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            _set_rng_states(self.device, rng)
            loss = loss_fn(self.module, batch)
            grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        out = torch.zeros(len(self.params), kfp.ROW, dtype=torch.int32, device=self.device)
        seen = torch.zeros(len(self.params), dtype=torch.bool)
        fingerprint_into(list(zip(grads, range(len(grads)), strict=True)), out, seen)
        return self._fingerprints_of(out, seen & self._seen)

    @staticmethod
    def _fingerprints_of(rows: torch.Tensor, seen: torch.Tensor) -> list[int]:
        host = rows.cpu()  # the replay step's read
        return [kfp.signed64(kfp.lanes_to_int(host[i])) if s else 0 for i, s in enumerate(seen.tolist())]

    def _settle(self, step: int, owner: int, original: torch.Tensor, replay: torch.Tensor, third: torch.Tensor,
                peer: int, runner: int) -> PeerFinding:  # fmt: skip
        names = tuple(self.names[id(self.params[i])] for i in _differing(original, replay))
        ranks = self.ctx.ranks
        runs = {"original": ranks[owner], "replay": ranks[peer], "third": ranks[runner]}
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        where = (f"step {step}: the local gradients of rank {ranks[owner]}'s micro-batch ({shown}) differ between "
                 f"rank {ranks[owner]}'s step and rank {ranks[peer]}'s replay")  # fmt: skip
        if not _differ(third, replay):
            return PeerFinding(step, owner, runs, names, ranks[owner], VerdictKind.CONFIRMED_SDC,
                               WrongExecution.ORIGINAL, f"{where}; a third execution on rank {ranks[runner]} agrees "
                               "with the replay: the step was wrong")  # fmt: skip
        if not _differ(third, original) and runner != owner:
            return PeerFinding(step, owner, runs, names, ranks[peer], VerdictKind.CONFIRMED_SDC,
                               WrongExecution.REPLAY, f"{where}; a third execution on rank {ranks[runner]} agrees "
                               f"with the step: rank {ranks[peer]}'s replay was wrong")  # fmt: skip
        if not _differ(third, original):
            return PeerFinding(step, owner, runs, names, None, VerdictKind.UNATTRIBUTED, None,
                               f"{where}; rank {ranks[owner]} reproduces its own result: the two ranks differ "
                               "persistently and no third rank decides — no rank named")  # fmt: skip
        return PeerFinding(step, owner, runs, names, None, VerdictKind.NOT_DETERMINISTIC, WrongExecution.UNSTABLE,
                           f"{where}; a third execution differs from both: the step is not deterministic — "
                           "not covered")  # fmt: skip


def _differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a != b) & (a != 0) & (b != 0)).any())


def _differing(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    return torch.nonzero((a != b) & (a != 0) & (b != 0)).reshape(-1).tolist()


def fingerprint_into(items: list[tuple[torch.Tensor | None, int | None]], out: torch.Tensor,
                     seen: torch.Tensor) -> None:  # fmt: skip
    """Fingerprints of (gradient, row) into rows of out (int32 [params, ROW]), marking the rows
    written in `seen` (gradients that are None, or that the kernel cannot read in place, are not)."""
    written = kfp.fingerprint_into([(g, row) for g, row in items if g is not None and row is not None], out)
    seen[written] = True


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _set_rng_states(device: torch.device, states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda" and len(states) > 1:
        torch.cuda.set_rng_state(states[1], device)
