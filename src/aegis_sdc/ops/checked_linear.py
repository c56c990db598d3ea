"""The checked Linear op: forward Y = X·Wᵀ + b, dgrad dX = dY·W and wgrad dW = dYᵀ·X in one
autograd Function, each GEMM checked (or not) as its site's sensor decides.

Operand orientation, C = A·B for each GEMM (M tokens, K in-features, N out-features):

    forward  A = X  [M, K]    B = Wᵀ [K, N]   C = Y  [M, N]   (+ bias)
    dgrad    A = dY [M, N]    B = W  [N, K]   C = dX [M, K]
    wgrad    A = dYᵀ [N, M]   B = X  [M, K]   C = dW [N, K]

The op knows nothing of thresholds or stores: a sensor's `plan()` says whether to check this call
(and which fault to inject), and `observe()` receives the checksums. Unchecked calls run the fast
path (`torch.mm` / `F.linear`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from aegis_sdc.kernels.reference import Tiling, checked_gemm
from aegis_sdc.ops.gemm_replay import GemmOperands


class GemmSensorHooks(Protocol):
    def plan(self) -> Any | None: ...

    def observe(self, plan: Any, operands: GemmOperands, result: Any) -> None: ...


@dataclass(frozen=True)
class LinearHooks:
    """The three sensors of one Linear, and the tile of its reference GEMMs."""

    forward: GemmSensorHooks
    dgrad: GemmSensorHooks
    wgrad: GemmSensorHooks
    tiling: Tiling
    after_call: Callable[[], None] = lambda: None  # lets the guard flush a full buffer


def run_gemm(
    hooks: GemmSensorHooks,
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    out_dtype: torch.dtype,
    tiling: Tiling,
    fast: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """One GEMM, checked if the sensor plans a check or a fault, else the fast path."""
    plan = hooks.plan()
    if plan is None:
        return fast()
    if plan.fault_needs_scale:
        # A perturb fault before the site knows its median clean difference: measure this call's
        # own clean difference first (on the device, no host sync) and scale the fault by it.
        clean = checked_gemm(a, b, out_dtype=out_dtype, bias=bias, col_check=False, tiling=tiling)
        scale = (clean.row_sum - clean.row_ref).norm()
        plan.injection.fault = dataclasses.replace(plan.fault, delta=plan.fault.delta * scale)
    result = checked_gemm(
        a,
        b,
        out_dtype=out_dtype,
        bias=bias,
        col_check=plan.check and plan.col_check,
        tiling=tiling,
        fault=plan.fault,
    )
    hooks.observe(plan, GemmOperands(a, b, bias, out_dtype, tiling), result)
    return result.out


class CheckedLinearFunction(torch.autograd.Function):
    """Y = X·Wᵀ + b over a 2-D input X [M, K]; see the module docstring for dgrad and wgrad."""

    @staticmethod
    def forward(ctx, x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, hooks: LinearHooks):
        with torch.autocast(x2d.device.type, enabled=False):
            out = run_gemm(
                hooks.forward,
                x2d,
                weight.t(),
                bias,
                out_dtype=x2d.dtype,
                tiling=hooks.tiling,
                fast=lambda: F.linear(x2d, weight, bias),
            )
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias = bias is not None
        ctx.hooks = hooks
        hooks.after_call()
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        x2d, weight = ctx.saved_tensors
        hooks: LinearHooks = ctx.hooks
        dx = dw = db = None
        with torch.autocast(dy.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dx = run_gemm(
                    hooks.dgrad,
                    dy,
                    weight,
                    None,
                    out_dtype=x2d.dtype,
                    tiling=hooks.tiling,
                    fast=lambda: dy.mm(weight),
                )
            if ctx.needs_input_grad[1]:
                dy_t = dy.t()
                dw = run_gemm(
                    hooks.wgrad,
                    dy_t,
                    x2d,
                    None,
                    out_dtype=weight.dtype,
                    tiling=hooks.tiling,
                    fast=lambda: dy_t.mm(x2d),
                )
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = dy.sum(dim=0)
        hooks.after_call()
        return dx, dw, db, None
