"""The determinism check and the three study modes, step by step.

Each mode is a generator of `(step, rows)`, a row being `(step, scope, metric, value)` as the store
keeps it (docs/study.md lists every scope and metric). Before the optimizer step both replicas have
run forward and backward on the same batch.

- compute-sync: the suspect's submodule outputs and gradients are compared with the healthy ones
  and overwritten by them (taps.py): what each submodule computes wrong, without propagation.
- param-sync: the suspect starts every step from the healthy parameters and optimizer state: how
  far one step's gradients deviate, ‖g_s − g_h‖ / ‖g_h‖, per layer and overall.
- free-run: no synchronization: losses, parameter divergence ‖θ_s − θ_h‖ / ‖θ_h‖ per layer and
  overall, against a healthy replica trained on another sample order (the natural divergence).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator, Sequence

import torch

from aegis_sdc.study.replica import Replica, copy_state, first_state_difference, relative_deviation
from aegis_sdc.study.taps import PHASES, Tap, bit_mismatch

Row = tuple[int, str, str, float]  # (step, scope, metric, value)
Batch = tuple[torch.Tensor, torch.Tensor]  # inputs, targets: [B, T] int64


class NondeterminismError(RuntimeError):
    """Two healthy replicas of the training differ: a study of it would measure noise."""


def check_determinism(first: Replica, second: Replica, units: Sequence[str], batches: Sequence[Batch]) -> None:
    """Run two healthy replicas side by side; raise `NondeterminismError` at the first differing tensor."""
    record = Tap(first.model, units, "record")
    compare = Tap(second.model, units, "compare", record)
    try:
        for step, (inputs, targets) in enumerate(batches):
            record.start_step()
            compare.start_step()
            loss_a = first.forward_backward(inputs, targets, step)
            loss_b = second.forward_backward(inputs, targets, step)
            compare.compare_param_grads(first.model, overwrite=False)
            found = compare.first_difference()
            where = None
            if found is not None and found.phase == "forward":
                where = found.describe()
            elif bool(bit_mismatch(loss_b, loss_a.to(loss_b.device))):
                where = f"the loss ({loss_a.item():.9g} against {loss_b.item():.9g})"
            elif found is not None:
                where = found.describe()
            else:
                first.optimizer_step()
                second.optimizer_step()
                state = first_state_difference(second, first)
                where = f"{state} after the optimizer step" if state else None
            if where is not None:
                raise NondeterminismError(
                    f"two healthy replicas of this training ({first.device} and {second.device}) are not bit-identical:"
                    f" at step {step} the first differing tensor is {where}. A study compares a suspect with a"
                    " healthy replica bit for bit, so it refuses a training that differs from itself: keep all"
                    " randomness in torch's generators, and on GPUs use torch.use_deterministic_algorithms(True)"
                    " with CUBLAS_WORKSPACE_CONFIG=:4096:8 and no atomics-based ops; put both replicas on the same"
                    " kind of device."
                )
    finally:
        record.remove()
        compare.remove()


def _losses(step: int, **losses: torch.Tensor) -> list[Row]:
    values = torch.stack([v.double().to("cpu") for v in losses.values()]).tolist()
    return [(step, "loss", name, value) for name, value in zip(losses, values, strict=True)]


def compute_sync(
    healthy: Replica, suspect: Replica, units: Sequence[str], batches: Callable[[int], Batch], steps: int
) -> Iterator[tuple[int, list[Row]]]:
    record = Tap(healthy.model, units, "record")
    sync = Tap(suspect.model, units, "sync", record)
    try:
        for step in range(steps):
            inputs, targets = batches(step)
            record.start_step()
            sync.start_step()
            loss_h = healthy.forward_backward(inputs, targets, step)
            loss_s = suspect.forward_backward(inputs, targets, step)
            sync.compare_param_grads(healthy.model, overwrite=True)
            healthy.optimizer_step()
            suspect.optimizer_step()
            rows = _losses(step, healthy=loss_h, suspect=loss_s)
            measured = sync.step_metrics()
            for unit in units:
                for phase in PHASES:
                    if (unit, phase) not in measured:
                        continue  # e.g. the embedding has no input gradient
                    elements, mismatched, rel_sum, rel_max = measured[(unit, phase)]
                    scope = f"{unit}/{phase}"
                    rows.append((step, scope, "mismatch_frequency", mismatched / elements if elements else 0.0))
                    rows.append((step, scope, "severity_mean", rel_sum / mismatched if mismatched else 0.0))
                    rows.append((step, scope, "severity_max", rel_max))
            yield step, rows
    finally:
        record.remove()
        sync.remove()


def _grad_pairs(suspect: Replica, healthy: Replica):
    healthy_params = dict(healthy.model.named_parameters())
    for name, p in suspect.model.named_parameters():
        yield name, p.grad, healthy_params[name].grad


def _param_pairs(other: Replica, healthy: Replica):
    healthy_params = dict(healthy.model.named_parameters())
    for name, p in other.model.named_parameters():
        yield name, p.detach(), healthy_params[name].detach()


def param_sync(
    healthy: Replica, suspect: Replica, batches: Callable[[int], Batch], steps: int
) -> Iterator[tuple[int, list[Row]]]:
    for step in range(steps):
        inputs, targets = batches(step)
        loss_h = healthy.forward_backward(inputs, targets, step)
        loss_s = suspect.forward_backward(inputs, targets, step)
        deviation = relative_deviation(_grad_pairs(suspect, healthy))
        healthy.optimizer_step()
        copy_state(healthy, suspect)  # the suspect's own update is discarded: only its gradients count
        rows = _losses(step, healthy=loss_h, suspect=loss_s)
        rows += [(step, layer, "grad_deviation", value) for layer, value in deviation.items()]
        yield step, rows


class SpikeDetector:
    """A loss above `ratio` × the median of the previous `window` losses (or non-finite) is a spike."""

    def __init__(self, ratio: float, window: int) -> None:
        self.ratio, self.window = ratio, window
        self.history: list[float] = []

    def __call__(self, loss: float) -> bool:
        recent = self.history[-self.window :]
        self.history.append(loss)
        if not math.isfinite(loss):
            return True
        finite = [x for x in recent if math.isfinite(x)]
        return len(recent) == self.window and bool(finite) and loss > self.ratio * statistics.median(finite)


def free_run(
    healthy: Replica,
    suspect: Replica,
    baseline: Replica,
    batches: Callable[[int], Batch],
    baseline_batches: Callable[[int], Batch],
    steps: int,
    *,
    spike_ratio: float,
    spike_window: int,
) -> Iterator[tuple[int, list[Row]]]:
    spikes = {r.name: SpikeDetector(spike_ratio, spike_window) for r in (healthy, suspect, baseline)}
    for step in range(steps):
        inputs, targets = batches(step)
        losses = {}
        for replica, batch in ((healthy, (inputs, targets)), (suspect, (inputs, targets))):
            losses[replica.name] = replica.forward_backward(*batch, step)
            replica.optimizer_step()
        losses[baseline.name] = baseline.forward_backward(*baseline_batches(step), step)
        baseline.optimizer_step()
        divergence = relative_deviation(_param_pairs(suspect, healthy))
        natural = relative_deviation(_param_pairs(baseline, healthy))["all"]
        rows = _losses(step, **losses)
        rows += [(step, layer, "param_divergence", value) for layer, value in divergence.items()]
        rows.append((step, "baseline", "param_divergence", natural))
        flags = {name: spikes[name](value) for _, _, name, value in rows[: len(losses)]}
        rows += [(step, "spike", name, 1.0) for name, flag in flags.items() if flag]
        rows.append((step, "spike", "suspect_only", float(flags[suspect.name] and not flags[healthy.name])))
        yield step, rows
