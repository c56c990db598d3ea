"""Module swap: `nn.Linear` → `CheckedLinear`, and back.

A CheckedLinear is the same module state under another class: it shares the original's parameter,
buffer and hook dictionaries (not copies), so optimizers, state dicts, `named_parameters()` and
hooks registered by users or frameworks see no difference, and `restore` only puts the original
object back.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from aegis_sdc.ops import linear_op
from aegis_sdc.ops.checked_linear import CheckedLinearFunction, LinearHooks

LinearFilter = Callable[[str, nn.Linear], bool]


class CheckedLinear(nn.Linear):
    """An `nn.Linear` whose forward, dgrad and wgrad GEMMs are checked."""

    aegis_name: str
    aegis_hooks: LinearHooks
    aegis_handle: int  # its hooks in ops/linear_op.py's registry (the compiled path)

    @classmethod
    def wrap(cls, linear: nn.Linear, name: str, hooks: LinearHooks) -> CheckedLinear:
        checked = cls.__new__(cls)
        checked.__dict__.update(linear.__dict__)  # shares _parameters, _buffers, _modules, hook dicts
        object.__setattr__(checked, "aegis_name", name)
        object.__setattr__(checked, "aegis_hooks", hooks)
        object.__setattr__(checked, "aegis_handle", linear_op.register(hooks))
        return checked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._compiled(x)
        hooks = self.aegis_hooks
        plans = hooks.plans_for_call(x, self.weight)
        if plans is None:  # not sampled in this step: exactly nn.Linear
            return F.linear(x, self.weight, self.bias)
        return self._checked(x, plans)

    def _checked(self, x: torch.Tensor, plans: tuple) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        _validate(self.aegis_name, x, weight, self.in_features)
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
            raise TypeError(
                f"{self.aegis_name}: input dtype {x.dtype} does not match weight dtype {weight.dtype}"
                + ("" if bias is None else f" / bias dtype {bias.dtype}")
                + "; cast the input or run under torch.autocast"
            )
        if x.numel() == 0 or self.in_features == 0 or self.out_features == 0:
            return F.linear(x, weight, bias)  # nothing to check: no products are summed
        x2d = x.reshape(-1, self.in_features)
        gap = self.aegis_hooks.gpu_gap(x2d, weight)
        if gap is not None:
            self.aegis_hooks.uncovered(self.aegis_name, gap)
            return F.linear(x, weight, bias)
        # The parameter itself (detached: same storage and version counter) keys the weight-stats cache
        # when `weight` is an autocast copy.
        y = CheckedLinearFunction.apply(x2d, weight, bias, self.aegis_hooks, self.weight.detach(), plans)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _compiled(self, x: torch.Tensor) -> torch.Tensor:
        """Under torch.compile: one opaque custom op; the decisions are taken inside it at run time."""
        weight, bias = self.weight, self.bias
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        y = torch.ops.aegis_sdc.linear(x.reshape(-1, self.in_features), weight, bias, self.aegis_handle)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", checked=True"


def _validate(name: str, x: torch.Tensor, weight: torch.Tensor, in_features: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor input, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point input, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{name}: expected an input with at least one dimension, got a scalar")
    if x.shape[-1] != in_features:
        raise ValueError(
            f"{name}: input's last dimension is {x.shape[-1]} (shape {tuple(x.shape)}), "
            f"the layer expects {in_features} features"
        )
    if x.device != weight.device:
        raise ValueError(f"{name}: input is on {x.device}, the weight on {weight.device}; move one of them")


@dataclass(frozen=True)
class Swap:
    parent: nn.Module
    attr: str
    original: nn.Linear
    checked: CheckedLinear


def select_linears(
    model: nn.Module, include: Sequence[str], exclude: Sequence[str], keep: LinearFilter | None
) -> list[tuple[str, nn.Linear]]:
    """The Linears to protect, in module order (identical on every rank)."""
    chosen = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:  # subclasses (quantized, LoRA, ...) have other semantics
            continue
        label = name or "<root>"
        if not any(fnmatch.fnmatchcase(label, p) for p in include):
            continue
        if any(fnmatch.fnmatchcase(label, p) for p in exclude):
            continue
        if keep is not None and not keep(label, module):
            continue
        chosen.append((label, module))
    return chosen


def swap_linears(model: nn.Module, chosen: list[tuple[str, nn.Linear]], make_hooks) -> list[Swap]:
    """Replace each chosen Linear by a CheckedLinear; `make_hooks(name, linear)` builds its sensors."""
    if any(name == "<root>" for name, _ in chosen):
        raise ValueError("protect() needs a model that contains Linear layers, not a bare nn.Linear; wrap it")
    swaps = []
    for name, linear in chosen:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        checked = CheckedLinear.wrap(linear, name, make_hooks(name, linear))
        setattr(parent, attr, checked)
        swaps.append(Swap(parent, attr, linear, checked))
    return swaps


def restore_linears(swaps: list[Swap]) -> None:
    for swap in reversed(swaps):
        linear_op.unregister(swap.checked.aegis_handle)
        if getattr(swap.parent, swap.attr, None) is swap.checked:
            setattr(swap.parent, swap.attr, swap.original)
