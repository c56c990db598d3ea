"""The data-parallel context of a guard: which ranks compare notes, and the group they do it on.

The per-step exchange (rank-outlier statistics, collective-check results) runs on a gloo group of
its own, over the ranks of the user's data-parallel group, with its own timeout: the exchanged tensor
is small and already on the host after the step's one sync, gloo's timeouts are reliable on every
backend's jobs, and a rank that dies or stalls makes the others raise `RankExchangeError` after the
configured time instead of hanging in NCCL.

The same time bounds the host's waits for the checked gradient collectives on CPU tensors
(`wait_bounded`, comm_check.py) and the ranks' agreement at `protect` (agreement.py): every wait the
library owns ends within `DistributedConfig.exchange_timeout_s`.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist


class RankExchangeError(RuntimeError):
    """The per-step exchange between data-parallel ranks failed: a rank died, stalled or diverged."""


class DistContext:
    def __init__(self, group: dist.ProcessGroup | None, timeout_s: float) -> None:
        """`group`: the data-parallel group (None: the default group). Collective over all ranks."""
        self.user_group = group
        self.timeout_s = timeout_s
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self.ranks = sorted(ranks)
        self.rank = dist.get_rank()
        self.dp_rank = self.ranks.index(self.rank)
        self.dp_size = len(self.ranks)
        # Every rank must create every group, in the same order: learn all data-parallel groups (rare
        # metadata, an object collective) and create one gloo group per distinct rank list.
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, tuple(self.ranks))
        timeout = datetime.timedelta(seconds=timeout_s)
        self.exchange_group = None
        for members in sorted(set(everyone)):
            created = dist.new_group(list(members), backend="gloo", timeout=timeout)
            if tuple(self.ranks) == members:
                self.exchange_group = created

    def all_gather(self, values: torch.Tensor, step: int) -> torch.Tensor:
        """[dp_size, *values.shape] from every data-parallel rank (CPU tensors, on the gloo group)."""
        flat = values.reshape(-1).contiguous()
        parts = [torch.empty_like(flat) for _ in range(self.dp_size)]
        with self._timed(f"the per-step exchange of rank {self.rank} with ranks {self.ranks} failed at step {step}"):
            dist.all_gather(parts, flat, group=self.exchange_group)
        return torch.stack(parts).view(self.dp_size, *values.shape)

    def all_gather_object(self, value: Any, during: str) -> list[Any]:
        """`value` (picklable) from every data-parallel rank, on the exchange group with its timeout
        (rare metadata: the agreement at `protect`). `during` says when, for the error."""
        everyone: list[Any] = [None] * self.dp_size
        with self._timed(f"the exchange of rank {self.rank} with ranks {self.ranks} failed {during}"):
            dist.all_gather_object(everyone, value, group=self.exchange_group)
        return everyone

    @contextlib.contextmanager
    def _timed(self, failed: str) -> Iterator[None]:
        """A collective on the exchange group: its failure (the group's timeout, a peer gone) becomes
        `RankExchangeError` saying what `failed` and after how long."""
        started = time.monotonic()
        try:
            yield
        except RuntimeError as error:
            raise RankExchangeError(
                f"{failed} after {time.monotonic() - started:.1f} s (timeout {self.timeout_s:g} s): a rank died or "
                f"stalled. {error}"
            ) from error

    def close(self) -> None:
        if self.exchange_group is not None:
            dist.destroy_process_group(self.exchange_group)
            self.exchange_group = None


def wait_bounded(works: Sequence[tuple[dist.Work, float]], timeout_s: float, what: str, ranks: list[int]) -> None:
    """Wait for collectives, each at most `timeout_s` after it was issued (`works`: the work and the
    `time.monotonic()` of its issue); `RankExchangeError` naming `what` and `ranks` when one does not
    complete in time or failed (a peer that died closes its connections: gloo fails at once).

    For collectives whose wait would otherwise be the group's own timeout (30 min by default): a
    stalled peer must cost the configured time, not half an hour in a gloo error."""
    for work, issued in works:
        # at least 1 ms: a zero timedelta means "no timeout" to c10d (kNoTimeout)
        remaining = max(issued + timeout_s - time.monotonic(), 1e-3)
        try:
            work.wait(datetime.timedelta(seconds=remaining))
        except RuntimeError as error:
            raise RankExchangeError(
                f"{what} on rank {dist.get_rank()} with ranks {ranks} did not complete within {timeout_s:g} s "
                f"(DistributedConfig.exchange_timeout_s): a rank died or stalled. {error}"
            ) from error


def make_context(group: dist.ProcessGroup | None, timeout_s: float) -> DistContext | None:
    """A context when torch.distributed runs with more than one rank in the group, else None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    size = dist.get_world_size(group) if group is not None else dist.get_world_size()
    if size < 2:
        return None
    return DistContext(group, timeout_s)
