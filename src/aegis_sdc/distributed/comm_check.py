"""Checks of the gradient collectives: checksums are linear, so communication can be verified.

For a sum all-reduce of buffers g_r (one per rank), every chunk of the result R satisfies
    Σ_i R_i = Σ_r Σ_i g_r,i.
Each rank computes its local per-chunk sums (and sums of magnitudes) in fp64, all-reduces that small
vector next to the gradients, and compares it with the per-chunk sums of the result it received. The
reduction itself runs in the buffer's dtype, so the two sides may differ by at most
γ_world · Σ_r Σ_i |g_r,i| (γ_n = n·u/(1 − n·u), u the dtype's unit roundoff) — a difference beyond
that bound proves the result was corrupted (in flight, in the reduction, or in memory), on this rank.
For a reduce-scatter the same holds per output shard.

- DDP: `checked_allreduce_hook`, a communication hook (`ddp_model.register_comm_hook`).
- FSDP2: `CheckedReduceScatter`, a custom reduce-scatter (`FSDPModule.set_custom_reduce_scatter`).

Mismatches are recorded per step; the guard turns them into vTasks whose verification recomputes the
chunk sums of the gradient as it is stored now, and exchanges which ranks failed.

Which device is wrong. A failed check proves that the result this rank holds is wrong, not that this
rank's device made it wrong: a peer that corrupts what it sends spoils the receivers' results. The
check names this rank only when a strict majority of the group (three ranks or more) passed the
same collective — the majority decides. Otherwise (two ranks, several failing, or the ranks' results
not exchanged) the verdict is `unattributed_sdc`: the corruption is reported with the failing ranks,
and no device is blamed.

A stalled or dead peer. The collectives these checks issue run on the user's group, whose timeout
(30 min by default) would be the host's wait. On CPU tensors (gloo) the host waits for them here,
each at most `DistributedConfig.exchange_timeout_s` after its issue (`context.wait_bounded`), and
raises `RankExchangeError`: under DDP in the last bucket's hook, once every bucket's all-reduce is
issued (the earlier buckets keep overlapping with the backward; DDP would wait for all of them right
after anyway). On CUDA tensors (NCCL) the collectives are ordered on the device's streams and the
host does not wait for them here: a host wait would add a sync to every backward, so there the
group's own timeout (NCCL's watchdog) applies.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from aegis_sdc.distributed.context import wait_bounded
from aegis_sdc.distributed.outlier import majority_decides
from aegis_sdc.events import Site, Tile, VerdictKind, WrongExecution

SUB = 64  # elements summed in fp32 before the fp64 sum of a chunk: fast, and a tight error bound


def chunk_size(numel: int, chunks: int) -> int:
    """Elements per chunk: ceil(numel / chunks) rounded up to whole SUB-groups."""
    per_chunk = -(-numel // chunks)
    return max(SUB, -(-per_chunk // SUB) * SUB)


def chunk_sums(flat: torch.Tensor, chunks: int) -> torch.Tensor:
    """[2, chunks] fp64: per-chunk sum and sum of magnitudes of a flat tensor (unused chunks zero).

    Chunks are whole multiples of SUB elements; each SUB-group is summed in fp32 (error at most
    SUB·u₃₂ of its magnitudes, see `rounding_bound`), the groups in fp64. A full fp64 copy of a
    25 MB bucket would cost ~20× more on a CPU. CUDA tensors take one fused Triton pass
    (`kernels.triton_chunk_sums`: same chunks, same SUB-groups, two launches instead of a dozen)."""
    flat = flat.reshape(-1)
    n = flat.numel()
    size = chunk_size(n, chunks)
    if flat.is_cuda:
        from aegis_sdc.kernels.triton_chunk_sums import triton_chunk_sums

        return triton_chunk_sums(flat.contiguous(), chunks, size, SUB)
    full = n // size
    out = torch.zeros(2, chunks, dtype=torch.float64, device=flat.device)
    if full:
        body = flat[: full * size].view(full, size // SUB, SUB)
        out[0, :full] = body.sum(dim=2, dtype=torch.float32).double().sum(dim=1)
        out[1, :full] = torch.linalg.vector_norm(body.view(full, size), ord=1, dim=1, dtype=torch.float32).double()
    if n > full * size:
        tail = flat[full * size :].double()
        out[0, full] = tail.sum()
        out[1, full] = tail.abs().sum()
    return out


def rounding_bound(dtype: torch.dtype, world: int, magnitude: torch.Tensor) -> torch.Tensor:
    """Largest difference a correct reduction can show per chunk: the reduction of `world` buffers in
    `dtype` (γ_world each side), plus both sides' fp32 SUB-group sums and the fp32 magnitudes."""
    u = torch.finfo(dtype).eps / 2
    u32 = torch.finfo(torch.float32).eps / 2
    gamma = world * u / (1 - world * u)
    return (2 * gamma + 4 * SUB * u32) * magnitude + 1e-300


def _ratios(received: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    ratio = (received - expected).abs() / bound
    ratio = torch.where(torch.isfinite(ratio), ratio, torch.full_like(ratio, float("inf")))
    return torch.where(torch.isfinite(expected), ratio, torch.zeros_like(ratio))


@dataclasses.dataclass
class CommRecord:
    """One checked collective of one step on this rank."""

    site: Site
    step: int
    expected: torch.Tensor  # [chunks] Σ over ranks of the local chunk sums (fp64)
    received: torch.Tensor  # [chunks] chunk sums of the result this rank received (fp64)
    bound: torch.Tensor  # [chunks] the rounding bound
    chunk_size: int
    numel: int
    rescan: Callable[[], torch.Tensor] | None  # recomputes `received` from where the result is stored now
    scale: float = 1.0  # the stored result is the received one times this (DDP stores the average)

    def ratios(self) -> torch.Tensor:
        """[chunks] |received − expected| / bound (> 1: a mismatch). A non-finite result where the ranks'
        sums are finite is a mismatch (inf); where a rank's own gradient was not finite there is
        nothing to check (0): the non-finite value is the training's, not the collective's."""
        return _ratios(self.received, self.expected, self.bound)

    def mismatched(self) -> list[int]:
        return [int(i) for i in torch.nonzero(self.ratios() > 1.0).flatten()]

    def value(self) -> float:
        """Largest ratio over the chunks (> 1: a mismatch)."""
        return float(self.ratios().max())


def max_ratios(records: list[CommRecord]) -> torch.Tensor:
    """[records] the largest |received − expected| / bound of each record, computed for all records
    of a step at once (a handful of launches, whatever the number of buckets)."""
    stacked = (torch.stack([getattr(r, name) for r in records]) for name in ("received", "expected", "bound"))
    return _ratios(*stacked).amax(dim=1)


class CommCapture:
    """The payload of a collective-check vTask: re-read the stored result and compare again."""

    references_tensors = True  # the gradient must still be the one the collective produced

    def __init__(self, record: CommRecord, ranks_failed: list[int], group: list[int]) -> None:
        self.record = record
        self.ranks_failed = ranks_failed  # until the step's exchange fills in the others: this rank
        self.group = group  # the ranks that took part in the collective
        self.exchanged = False  # whether ranks_failed holds every rank's result
        chunks = record.mismatched()
        first = chunks[0] if chunks else 0
        start = first * record.chunk_size
        self.region = Tile(0, 1, start, min(start + record.chunk_size, record.numel))

    def verdict(self) -> tuple[VerdictKind, WrongExecution | None, str]:
        """(kind, wrong execution, detail) for the verifier: confirmed when the mismatch is beyond the
        exact rounding bound (proof on its own); re-reading the stored gradient says whether it still is."""
        r = self.record
        chunks = r.mismatched()
        detail = (
            f"chunks {chunks[:8]}{'…' if len(chunks) > 8 else ''} of {r.site.module} differ from the sum of the "
            f"ranks' local sums by up to {r.value():.3g}× the exact rounding bound; ranks whose check failed: "
            f"{self.ranks_failed}"
        )
        if r.rescan is not None:
            now = r.rescan() / r.scale
            still = bool((~((now - r.expected).abs() <= r.bound) & torch.isfinite(r.expected)).any())
            detail += "; the stored gradient " + ("still differs" if still else "now agrees (a transient read error)")
        if not chunks:
            return VerdictKind.FALSE_ALARM, None, detail
        world, failed = len(self.group), len(set(self.ranks_failed))
        passed = world - failed
        if self.exchanged and majority_decides(world, failed):
            return VerdictKind.CONFIRMED_SDC, WrongExecution.ORIGINAL, f"{detail}; {passed} of {world} ranks passed"
        why = f"{passed} of {world} ranks passed, no majority" if self.exchanged else "results not exchanged"
        return (
            VerdictKind.UNATTRIBUTED,
            None,
            f"{detail}; no rank named ({why}): a sender can spoil a receiver's result",
        )


class CommChecks:
    """Per-step records of this rank's checked collectives, and the sites they belong to."""

    def __init__(self, chunks: int, register_site: Callable[[str, object], Site], fault_hook=None,
                 timeout_s: float | None = None) -> None:  # fmt: skip
        self.chunks = chunks
        # the host's wait for a checked collective on CPU tensors, from its issue (None: unbounded)
        self.timeout_s = timeout_s
        self.register_site = register_site  # (module name, CommKind) → Site, in call order
        self.fault_hook = fault_hook  # (site, step, buffer) → corrupts the received buffer (injection)
        self.records: list[CommRecord] = []
        self.step = 0
        # a DDP bucket before it is reduced (its local gradients: the peer replay's originals)
        self.on_local_gradients: Callable[[dist.GradBucket], None] | None = None

    def take(self) -> list[CommRecord]:
        records, self.records = self.records, []
        return records

    def record(self, site: Site, expected: torch.Tensor, received: torch.Tensor, world: int, dtype,
               rescan=None, scale: float = 1.0) -> None:  # fmt: skip
        """Compare a received result with `expected` ([2, chunks]: Σ_r local sums, Σ_r local magnitudes)."""
        self.records.append(
            CommRecord(
                site, self.step, expected[0], chunk_sums(received, self.chunks)[0] / scale,
                rounding_bound(dtype, world, expected[1]), chunk_size(received.numel(), self.chunks), received.numel(),
                rescan, scale,
            )
        )  # fmt: skip

    def corrupt(self, site: Site, result: torch.Tensor) -> None:
        if self.fault_hook is not None:
            self.fault_hook(site, self.step, result)

    def bounds(self, tensor: torch.Tensor) -> bool:
        """Whether the host waits for this tensor's collectives here, bounded by `timeout_s`: CPU
        tensors (on CUDA the wait is the device's, see the module's docstring)."""
        return self.timeout_s is not None and not tensor.is_cuda

    def wait(self, works: list[tuple[dist.Work, float]], what: str, group: dist.ProcessGroup | None) -> None:
        """`context.wait_bounded` for collectives of `group` (`RankExchangeError` after `timeout_s`)."""
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        wait_bounded(works, self.timeout_s, f"{what} at step {self.step}", ranks)


def checked_allreduce_hook(checks: CommChecks, group: dist.ProcessGroup | None, kind) -> Callable:
    """A DDP communication hook: sum all-reduce with chunk checksums, then the average DDP expects.

    The small checksum all-reduce is issued before the gradients' (in the same order on every rank;
    never from inside the future's callback, where issuing a collective could deadlock). On CPU
    tensors the last bucket's hook waits for every bucket's collectives, bounded (`CommChecks.wait`):
    its `RankExchangeError` comes out of `loss.backward()` as it is (autograd re-raises a hook's
    Python exception)."""
    issued: list[tuple[dist.Work, float]] = []  # this backward's collectives, for the last bucket's wait

    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if bucket.index() == 0:  # DDP launches its buckets in index order: a new backward
            issued.clear()
        world = dist.get_world_size(group)
        if checks.on_local_gradients is not None:
            checks.on_local_gradients(bucket)
        site = checks.register_site(f"ddp.bucket{bucket.index()}", kind)
        expected = chunk_sums(buffer, checks.chunks)
        # Both all-reduces asynchronous, the checksums' first: a process group completes its work in
        # issue order, so the checksums are in when the gradients' callback runs.
        started = time.monotonic()
        expected_work = dist.all_reduce(expected, group=group, async_op=True)
        params = list(bucket.parameters())
        work = dist.all_reduce(buffer, group=group, async_op=True)
        future = work.get_future()
        if checks.bounds(buffer):
            issued.extend(((expected_work, started), (work, started)))
            if bucket.is_last():
                works = list(issued)
                issued.clear()
                buckets = f"buckets 0–{bucket.index()}" if bucket.index() else "bucket 0"
                checks.wait(works, f"the gradient all-reduce of DDP's {buckets}", group)

        def rescan() -> torch.Tensor:
            grads = [p.grad.reshape(-1) for p in params if p.grad is not None]
            return chunk_sums(torch.cat(grads), checks.chunks)[0] if grads else torch.zeros(checks.chunks)

        def finish(fut: torch.futures.Future) -> torch.Tensor:
            reduced = fut.value()[0]
            expected_work.wait()
            checks.corrupt(site, reduced)
            checks.record(site, expected, reduced, world, buffer.dtype, rescan=rescan, scale=1.0)
            checks.records[-1].scale = 1.0 / world  # DDP stores the average: rescans are scaled back
            return reduced.div_(world)

        return future.then(finish)

    # DDP checks the hook's annotations by identity; this module's annotations are strings.
    hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return hook


class CheckedReduceScatter:
    """FSDP2 reduce-scatter with shard checksums (`FSDPModule.set_custom_reduce_scatter`)."""

    def __init__(self, checks: CommChecks, name: str, kind) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

        self._default = DefaultReduceScatter()
        self.checks = checks
        self.name = name
        self.kind = kind

    def allocate(self, *args, **kwargs):
        return self._default.allocate(*args, **kwargs)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return self._default(output_tensor, input_tensor, group, op, async_op=async_op)  # pre-multiplied: unchecked
        world = group.size()
        rank = dist.get_rank(group)
        site = self.checks.register_site(self.name, self.kind)
        shards = input_tensor.reshape(world, -1)
        expected = torch.stack([chunk_sums(shards[r], self.checks.chunks) for r in range(world)])  # [world, 2, C]
        started = time.monotonic()
        expected_work = dist.all_reduce(expected, group=group, async_op=True)
        work = self._default(output_tensor, input_tensor, group, op, async_op=True)
        if self.checks.bounds(input_tensor):  # the host's wait, bounded
            self.checks.wait([(expected_work, started), (work, started)], f"the reduce-scatter of {self.name}", group)
        else:  # CUDA: the current stream waits for both (no host wait)
            expected_work.wait()
            work.wait()
        self.checks.corrupt(site, output_tensor)
        scale = 1.0 / world if op == dist.ReduceOp.AVG else 1.0
        self.checks.record(site, expected[rank], output_tensor, world, input_tensor.dtype, scale=scale)
        return work if async_op else None
