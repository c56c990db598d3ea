"""The data-parallel context of a guard: which ranks compare notes, and the group they do it on.

The per-step exchange (rank-outlier statistics, collective-check results) runs on a gloo group of
its own, over the ranks of the user's data-parallel group, with its own timeout: the exchanged tensor
is small and already on the host after the step's one sync, gloo's timeouts are reliable on every
backend's jobs, and a rank that dies or stalls makes the others raise `RankExchangeError` after the
configured time instead of hanging in NCCL.
"""

from __future__ import annotations

import datetime
import time

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
        started = time.monotonic()
        try:
            dist.all_gather(parts, flat, group=self.exchange_group)
        except RuntimeError as error:
            raise RankExchangeError(
                f"the per-step exchange of rank {self.rank} with ranks {self.ranks} failed at step {step} after "
                f"{time.monotonic() - started:.1f} s (timeout {self.timeout_s:g} s): a rank died or stalled. {error}"
            ) from error
        return torch.stack(parts).view(self.dp_size, *values.shape)

    def close(self) -> None:
        if self.exchange_group is not None:
            dist.destroy_process_group(self.exchange_group)
            self.exchange_group = None


def make_context(group: dist.ProcessGroup | None, timeout_s: float) -> DistContext | None:
    """A context when torch.distributed runs with more than one rank in the group, else None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    size = dist.get_world_size(group) if group is not None else dist.get_world_size()
    if size < 2:
        return None
    return DistContext(group, timeout_s)
