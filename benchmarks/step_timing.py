"""The timed training-step loop shared by the step benchmarks (GPU): CUDA events around forward,
backward and the optimizer step, one sync per step, the warm-up steps dropped."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from aegis_sdc.workloads.llama import lm_loss


def timed_steps(model, optimizer, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], warmup: int) -> list[float]:
    """Milliseconds per step after the first `warmup` steps."""
    times = []
    for i, (x, y) in enumerate(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = lm_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return times
