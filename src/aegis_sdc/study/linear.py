"""The Linear both replicas of a study run: three explicit GEMMs, any of which the suspect corrupts.

Healthy and suspect must run the identical implementation, so that every difference between them
is the fault's. Every `nn.Linear` of every replica becomes a `StudyLinear` (sharing the original's
parameters): forward Y = X·Wᵀ + b [M, N], dgrad dX = dY·W [M, K], wgrad dW = dYᵀ·X [N, K], each
one matmul. On the suspect, a fired `FaultSpec` corrupts one element of a GEMM's result with the
foundation's fault models (bitflip, perturb) before it leaves the op; the backward of a corrupted
forward is the backward of what was computed, as on a faulty device.

The result is the accumulator rounded to the output dtype: for fp32 outputs the corrupted value is
the corrupted accumulator exactly; for bf16/fp16 outputs the fp32 upcast of the element is
corrupted and rounded again, which differs from corrupting the accumulator by one rounding.
A `perturb` fault is scaled by the call's own clean checksum difference ‖C·1 − A·(B·1)‖₂ (the
study keeps no per-site history), as the guard does before a site knows its median.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from aegis_sdc.events import GemmKind, Site
from aegis_sdc.faults.injector import FaultInjector
from aegis_sdc.kernels.reference import Tiling, checked_gemm


class StepClock:
    """The step a replica is in, and how often each site ran in it (the `call` of a FaultSpec)."""

    def __init__(self) -> None:
        self.step = 0
        self.calls: Counter[int] = Counter()

    def start(self, step: int) -> None:
        self.step = step
        self.calls.clear()

    def next_call(self, site: Site) -> int:
        call = self.calls[site.id]
        self.calls[site.id] += 1
        return call


class LinearFaults:
    """The faults of one Linear's three GEMMs on one replica (none on the healthy ones)."""

    def __init__(self, sites: dict[GemmKind, Site], injector: FaultInjector | None, clock: StepClock) -> None:
        self.sites = sites
        self.injector = injector
        self.clock = clock

    def apply(self, kind: GemmKind, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """`out` [rows, cols] = a·b, with the fault of this call applied if one fires."""
        if not self.injector:
            return out
        site = self.sites[kind]
        injection = self.injector.fire(site, self.clock.step, self.clock.next_call(site), None)
        if injection is None:
            return out
        fault = injection.fault
        if fault.model == "perturb":
            clean = checked_gemm(a, b, out_dtype=out.dtype, tiling=Tiling())
            scale = float((clean.row_sum - clean.row_ref).norm())  # a rare event: one sync per fault
            fault = injection.fault = dataclasses.replace(fault, delta=fault.delta * scale)
        row, col = fault.element(*out.shape)
        corrupted = out.clone()
        corrupted[row, col] = fault.corrupt(out[row, col].float()).to(out.dtype)
        self.injector.applied(injection)
        return corrupted


class _StudyLinearFunction(torch.autograd.Function):
    """Y = X·Wᵀ + b over X [M, K], W [N, K]; see the module docstring."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, faults: LinearFaults):
        out = faults.apply(GemmKind.FORWARD, F.linear(x2d, weight), x2d, weight.t())
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(x2d, weight)
        ctx.faults = faults
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, dy):
        x2d, weight = ctx.saved_tensors
        faults: LinearFaults = ctx.faults
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = faults.apply(GemmKind.DGRAD, dy @ weight, dy, weight)  # [M, K]
        if ctx.needs_input_grad[1]:
            dyt = dy.t()
            dw = faults.apply(GemmKind.WGRAD, dyt @ x2d, dyt, x2d)  # [N, K]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(dim=0)
        return dx, dw, db, None


class StudyLinear(nn.Linear):
    """An `nn.Linear` (same parameters, same state) computed by `_StudyLinearFunction`."""

    study_faults: LinearFaults

    @classmethod
    def wrap(cls, linear: nn.Linear, faults: LinearFaults) -> StudyLinear:
        wrapped = cls.__new__(cls)
        wrapped.__dict__.update(linear.__dict__)  # shares _parameters, _buffers and hook dictionaries
        object.__setattr__(wrapped, "study_faults", faults)
        return wrapped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        y = _StudyLinearFunction.apply(x2d, self.weight, self.bias, self.study_faults)
        return y.reshape(*x.shape[:-1], self.out_features)


def install_study_linears(model: nn.Module, injector: FaultInjector | None, clock: StepClock) -> list[Site]:
    """Replace every `nn.Linear` of `model` in place; returns the GEMM sites in module order.

    Sites are numbered as the guard numbers them (three per Linear, module order), so a fault's
    per-call probability draws the same calls in a study as under `protect`.
    """
    sites: list[Site] = []
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, linear in linears:
        kinds = {kind: Site(len(sites) + i, name, kind) for i, kind in enumerate(GemmKind)}
        sites.extend(kinds.values())
        wrapped = StudyLinear.wrap(linear, LinearFaults(kinds, injector, clock))
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, wrapped)
    return sites
