"""Taps on a replica's submodules: record the healthy outputs, compare the suspect's, overwrite them.

A *unit* is a submodule whose outputs the study compares: every block of a `ModuleList` (a
transformer layer), each direct child of such a block (attention, MLP, the norms) and every other
direct child of the model (embedding, final norm, LM head) — looking through containers that hold
the blocks (Hugging Face's `model.model`). The Linears inside attention and MLP are
not units: a unit's output is what the next submodule consumes.

Per unit three *phases* are compared:

- ``forward``: the unit's output;
- ``backward``: the gradient of the unit's input (`register_full_backward_hook`'s grad_input);
- ``param_grad``: the gradients of the parameters the unit owns (those of no deeper unit), read
  after the backward has finished.

The healthy replica's tap records each tensor (a detached copy, keyed by unit, phase and the
call's index within the step). The suspect's tap compares its own tensor with the record and, in
``sync`` mode, continues with the healthy value so the error does not propagate: in the forward
through `_Substitute` (the healthy values, gradient passed through unchanged to the suspect's
computation), in the backward by returning the healthy grad_input from the hook. Comparisons stay on
the device; `step_metrics` reads them with one transfer per step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

PHASES = ("forward", "backward", "param_grad")


def study_units(model: nn.Module) -> list[str]:
    """Unit names in module order; see the module docstring."""
    units: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = prefix + name
            if isinstance(child, nn.ModuleList):
                for index, block in child.named_children():
                    units.append(f"{path}.{index}")
                    units.extend(f"{path}.{index}.{sub}" for sub, _ in block.named_children())
            elif isinstance(child, nn.ModuleDict) or any(isinstance(m, nn.ModuleList) for m in child.modules()):
                # a container of blocks (a ModuleDict; Hugging Face's `model` inside its `*ForCausalLM`,
                # whose output is not a tensor): its children are the units
                visit(path + ".", child)
            else:
                units.append(path)

    visit("", model)
    return units


def owner_unit(name: str, units: Sequence[str]) -> str:
    """The deepest unit that contains the module or parameter `name` ("(model)" if none does)."""
    best = "(model)"
    for unit in units:
        if (name == unit or name.startswith(unit + ".")) and (best == "(model)" or len(unit) > len(best)):
            best = unit
    return best


def bit_mismatch(suspect: torch.Tensor, healthy: torch.Tensor) -> torch.Tensor:
    """Elementwise: do the two tensors differ in any bit (so +0 ≠ −0 and NaN payloads count)?"""
    if suspect.dtype.is_floating_point:
        ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[suspect.element_size()]
        return suspect.contiguous().view(ints) != healthy.contiguous().view(ints)
    return suspect != healthy


def mismatch_stats(suspect: torch.Tensor, healthy: torch.Tensor) -> torch.Tensor:
    """[elements, mismatched, sum and max of the mismatched elements' relative differences], fp64.

    Relative difference |s − h| / max(|h|, tiny) in fp64 (tiny: the dtype's smallest normal, so a
    corrupted zero has a finite, huge severity); a non-finite suspect value where the healthy one is
    finite counts as infinitely severe.
    """
    s, h = suspect.detach(), healthy.detach().to(suspect.device)
    mismatched = bit_mismatch(s, h)
    tiny = torch.finfo(s.dtype).tiny if s.dtype.is_floating_point else 1.0
    s64, h64 = s.double(), h.double()
    rel = (s64 - h64).abs() / h64.abs().clamp_min(tiny)
    rel = torch.where(torch.isfinite(s64) | ~torch.isfinite(h64), rel, torch.full_like(rel, float("inf")))
    rel = torch.where(mismatched, rel.nan_to_num(nan=float("inf"), posinf=float("inf")), torch.zeros_like(rel))
    elements = torch.tensor(float(s.numel()), dtype=torch.float64, device=s.device)
    return torch.stack((elements, mismatched.sum().double(), rel.sum(), rel.max() if rel.numel() else elements * 0))


class _Substitute(torch.autograd.Function):
    """Forward: the healthy values (bit for bit). Backward: the gradient, unchanged, to `computed`."""

    @staticmethod
    def forward(ctx, computed: torch.Tensor, healthy: torch.Tensor) -> torch.Tensor:
        return healthy.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _tensors(value) -> tuple:
    """A module's output or grad tuple as a tuple of (tensor or None); other structures are not tapped."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)):
        return tuple(v if isinstance(v, torch.Tensor) else None for v in value)
    return ()


@dataclass
class Comparison:
    """One compared call of a unit's phase (the determinism check reports the first that differs)."""

    unit: str
    phase: str
    call: int
    stats: torch.Tensor  # mismatch_stats

    def describe(self) -> str:
        elements, mismatched, _, worst = self.stats.tolist()
        what = {"forward": "output", "backward": "input gradient", "param_grad": "parameter gradients"}[self.phase]
        return (
            f"{self.unit} {what} ({self.phase}, call {self.call}): {int(mismatched)} of {int(elements)} elements "
            f"differ, largest relative difference {worst:.3g}"
        )


class Tap:
    """Hooks on a replica's units. `mode`: ``record`` (healthy), ``compare`` or ``sync`` (suspect)."""

    def __init__(self, model: nn.Module, units: Sequence[str], mode: str, record: Tap | None = None) -> None:
        if mode not in ("record", "compare", "sync"):
            raise ValueError(f"Tap mode must be record, compare or sync, got {mode!r}")
        if (mode == "record") != (record is None):
            raise ValueError("a compare/sync tap needs the healthy replica's recording tap, a record tap none")
        self.model, self.units, self.mode, self.healthy = model, list(units), mode, record
        self.records: dict[tuple[str, str, int], tuple] = {}
        self.stats: dict[tuple[str, str], torch.Tensor] = {}  # (unit, phase) → summed mismatch_stats
        self.comparisons: list[Comparison] = []  # in the order they happened
        self._calls: Counter[tuple[str, str]] = Counter()
        self._needs_grad: dict[str, tuple[bool, ...]] = {}
        self._handles = []
        for unit in self.units:
            module = model.get_submodule(unit)
            self._handles.append(module.register_forward_hook(self._forward_hook(unit)))
            if not isinstance(module, nn.Embedding):  # token ids in: no input gradient to compare
                self._handles.append(module.register_full_backward_hook(self._backward_hook(unit)))

    def start_step(self) -> None:
        self.records.clear()
        self.stats.clear()
        self.comparisons.clear()
        self._calls.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- hooks -------------------------------------------------------------------------------------
    def _forward_hook(self, unit: str):
        def hook(module, args, output):
            # Which inputs have a gradient: the full backward hook also hands over (zero) gradients
            # for tensor inputs that need none, such as the rotary tables.
            self._needs_grad[unit] = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
            replaced = self._visit(unit, "forward", _tensors(output))
            if replaced is None:
                return None
            new = tuple(
                _Substitute.apply(mine, healthy) if mine is not None and healthy is not None else mine
                for mine, healthy in zip(_tensors(output), replaced, strict=True)
            )
            return new[0] if isinstance(output, torch.Tensor) else type(output)(new)

        return hook

    def _backward_hook(self, unit: str):
        def hook(module, grad_input, grad_output):
            needs = self._needs_grad.get(unit, ())
            tensors = tuple(g if i < len(needs) and needs[i] else None for i, g in enumerate(_tensors(grad_input)))
            replaced = self._visit(unit, "backward", tensors)
            if replaced is None:
                return None
            return tuple(h if h is not None else g for g, h in zip(grad_input, replaced, strict=True))

        return hook

    def _visit(self, unit: str, phase: str, tensors: tuple) -> tuple | None:
        """Record, or compare (and return the healthy tensors to continue with in sync mode)."""
        call = self._calls[(unit, phase)]
        self._calls[(unit, phase)] += 1
        key = (unit, phase, call)
        if self.mode == "record":
            self.records[key] = tuple(None if t is None else t.detach().clone() for t in tensors)
            return None
        healthy = self.healthy.records.get(key)
        if healthy is None or len(healthy) != len(tensors):
            raise RuntimeError(
                f"the replicas ran different code: the healthy replica has no {phase} record of {unit} (call {call})"
            )
        pairs = [(mine, h) for mine, h in zip(tensors, healthy, strict=True) if mine is not None and h is not None]
        if pairs:
            self._add(unit, phase, call, [mismatch_stats(mine, h) for mine, h in pairs])
        if self.mode != "sync":
            return None
        return tuple(None if h is None else h.to(t.device) for t, h in zip(tensors, healthy, strict=True))

    def _add(self, unit: str, phase: str, call: int, parts: list[torch.Tensor]) -> None:
        stats = torch.stack(parts)  # [tensors, 4]
        call_stats = torch.cat((stats[:, :3].sum(dim=0), stats[:, 3].max().reshape(1)))
        self.comparisons.append(Comparison(unit, phase, call, call_stats))
        key = (unit, phase)
        previous = self.stats.get(key)
        if previous is not None:
            call_stats = torch.cat((previous[:3] + call_stats[:3], torch.maximum(previous[3:], call_stats[3:])))
        self.stats[key] = call_stats

    def first_difference(self) -> Comparison | None:
        """The first comparison of the step, in execution order, that found a differing bit."""
        if not self.comparisons:
            return None
        mismatched = torch.stack([c.stats[1] for c in self.comparisons]).cpu().tolist()  # one transfer
        return next((c for c, n in zip(self.comparisons, mismatched, strict=True) if n > 0), None)

    # -- parameter gradients -----------------------------------------------------------------------
    def compare_param_grads(self, healthy_model: nn.Module, *, overwrite: bool) -> None:
        """Compare each unit's parameter gradients with the healthy replica's (and copy them over)."""
        healthy_params = dict(healthy_model.named_parameters())
        by_unit: dict[str, list[torch.Tensor]] = {}
        for name, p in self.model.named_parameters():
            h = healthy_params[name]
            if p.grad is None and h.grad is None:
                continue
            mine = p.grad if p.grad is not None else torch.zeros_like(p)
            theirs = h.grad if h.grad is not None else torch.zeros_like(h)
            by_unit.setdefault(owner_unit(name, self.units), []).append(mismatch_stats(mine, theirs))
            if overwrite:
                p.grad = theirs.detach().to(p.device).clone()
        for unit, parts in by_unit.items():
            self._add(unit, "param_grad", 0, parts)

    def step_metrics(self) -> dict[tuple[str, str], tuple[float, float, float, float]]:
        """(unit, phase) → (elements, mismatched, relative-difference sum, max), one host transfer."""
        if not self.stats:
            return {}
        keys = list(self.stats)
        values = torch.stack([self.stats[k] for k in keys]).cpu().tolist()  # one transfer
        return {k: tuple(v) for k, v in zip(keys, values, strict=True)}
