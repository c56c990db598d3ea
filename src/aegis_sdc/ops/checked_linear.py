"""The checked Linear op: forward Y = X·Wᵀ + b, dgrad dX = dY·W and wgrad dW = dYᵀ·X in one
autograd Function, each GEMM checked (or not) as its site's sensor decides.

Operand orientation, C = A·B for each GEMM (M tokens, K in-features, N out-features):

    forward  A = X  [M, K]    B = Wᵀ [K, N]   C = Y  [M, N]   (+ bias)
    dgrad    A = dY [M, N]    B = W  [N, K]   C = dX [M, K]
    wgrad    A = dYᵀ [N, M]   B = X  [M, K]   C = dW [N, K]

The sensors plan all three GEMMs of a call at forward time (check or not, which fault to inject), so
the forward kernel knows whether to produce the by-products the wgrad check needs. The op knows
nothing of thresholds or stores. Backends: the reference path (plain PyTorch, kernels/reference.py)
and the fused Triton kernel (kernels/triton_gemm.py) for CUDA tensors. Unchecked GEMMs run
`F.linear` / `torch.mm` (cuBLAS on a GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from aegis_sdc.kernels.gemm_side import SideMatrix
from aegis_sdc.kernels.reference import Tiling, checked_gemm
from aegis_sdc.ops import triton_linear
from aegis_sdc.ops.gemm_replay import GemmOperands


class GemmSensorHooks(Protocol):
    site: Any  # events.Site: its id indexes the step plan
    col_check: bool

    def plan(self, call: int, sampled: bool) -> Any | None: ...

    def observe(self, plan: Any, operands: GemmOperands, result: Any) -> None: ...


class StepPlanLike(Protocol):
    """runtime.plan.StepPlan, as the op sees it."""

    step: int  # the step being planned (by-product buffers are reused from one step to the next)

    def take(self, linear: int) -> int | None: ...

    def checked(self, site: int, call: int) -> bool: ...


@dataclass
class SegmentTrace:
    """The GEMM plans of one checkpointed segment's forward, in call order.

    A segment recomputed in backward must take the same path as in forward — checked (tile-ordered
    accumulation) or not (cuBLAS / `F.linear`) — or its recomputed activations differ in the last
    bits from the forward's: gradients would be computed from other values, and the recompute
    fingerprint would see a difference that is no fault. Replaying a trace reuses the forward's
    decisions; the replayed plans inject nothing and record no evidence (`silent`)."""

    plans: list[tuple[Any, Any, Any]] = field(default_factory=list)
    cursor: int | None = None  # None: recording; else the next plan to replay


@dataclass
class PlanTracer:
    """Which segment trace the checked ops record into or replay from (shared by all hooks of a guard;
    Linears and attention record in call order into the same trace)."""

    current: SegmentTrace | None = None

    @property
    def replaying(self) -> bool:
        trace = self.current
        return trace is not None and trace.cursor is not None and trace.cursor < len(trace.plans)

    def next_replayed(self) -> Any:
        trace = self.current
        trace.cursor += 1
        return trace.plans[trace.cursor - 1]

    def record(self, plan: Any) -> None:
        trace = self.current
        if trace is not None and trace.cursor is None:
            trace.plans.append(plan)

    def replayed(self) -> tuple[Any, Any, Any] | None:
        """The next recorded plans of a recomputation (None: the call ran unchecked)."""
        plans = self.next_replayed()
        if plans is None:
            return None
        fwd, dgrad, wgrad = plans
        # dgrad/wgrad plans of a recomputation never run; the forward is replayed silently.
        silent = (
            None
            if fwd is None
            else dataclasses.replace(fwd, check=False, injection=None, fault_needs_scale=False, silent=True)
        )
        return silent, dgrad, wgrad


@dataclass
class LinearHooks:
    """The three sensors of one Linear, and what its GEMMs share across calls."""

    forward: GemmSensorHooks
    dgrad: GemmSensorHooks
    wgrad: GemmSensorHooks
    tiling: Tiling
    after_call: Callable[[], None] = lambda: None  # lets the guard flush a full buffer
    backend: str = "auto"
    state: triton_linear.DeviceState | None = None
    weight_stats: triton_linear.WeightStats = field(default_factory=triton_linear.WeightStats)
    byproducts: triton_linear.ByproductPool = field(default_factory=triton_linear.ByproductPool)
    counters: dict = field(default_factory=dict)  # GEMM kind → (last shape, int32 counters of the Triton kernel)
    tracer: PlanTracer = field(default_factory=PlanTracer)
    plan: StepPlanLike | None = None  # the guard's step plan; this Linear's index in it
    index: int = 0
    uncovered: Callable[[str, str], None] = lambda name, reason: None  # (site module, why) on a GPU gap

    pending: list = field(default_factory=list)  # compiled calls awaiting their backward (ops/linear_op.py)

    def plans_for_call(
        self, x: torch.Tensor, weight: torch.Tensor, backward: bool | None = None
    ) -> tuple[Any, Any, Any] | None:
        """The (forward, dgrad, wgrad) plans of this call, or None when it runs as a plain `F.linear`.
        `backward`: whether dgrad and wgrad follow (None: as autograd will tell from the inputs).

        Inside a checkpointed segment the plans are recorded in call order, and a recomputation
        replays them: it must take the same path as the forward did (see SegmentTrace)."""
        tracer = self.tracer
        if tracer.current is not None and tracer.replaying:
            return tracer.replayed()
        call = self.plan.take(self.index)
        plans = None if call is None else self._plans(call, x, weight, backward)
        if tracer.current is not None:
            tracer.record(plans)
        return plans

    def _plans(
        self, call: int, x: torch.Tensor, weight: torch.Tensor, backward: bool | None
    ) -> tuple[Any, Any, Any] | None:
        grad = torch.is_grad_enabled()
        needs_dx = backward if backward is not None else grad and x.requires_grad
        needs_dw = backward if backward is not None else grad and weight.requires_grad
        plan = self.plan
        plans = (
            self.forward.plan(call, plan.checked(self.forward.site.id, call)),
            self.dgrad.plan(call, plan.checked(self.dgrad.site.id, call)) if needs_dx else None,
            self.wgrad.plan(call, plan.checked(self.wgrad.site.id, call)) if needs_dw else None,
        )
        return None if plans == (None, None, None) else plans

    def gpu_gap(self, x2d: torch.Tensor, weight: torch.Tensor) -> str | None:
        """Why this CUDA call cannot be checked (None: it can). With backend "auto" such a call runs
        unchecked — never the tile-by-tile reference path, which reads its evidence on the host per
        call — and its site is named in the coverage report."""
        if self.backend != "auto" or x2d.device.type != "cuda":
            return None
        problem = triton_linear.unsupported(x2d) or triton_linear.unsupported(weight, is_weight=True)
        return None if problem is None else f"on this GPU: {problem}"

    def use_triton(self, x2d: torch.Tensor, weight: torch.Tensor) -> bool:
        if self.backend == "reference" or self.state is None:
            return False
        if self.backend == "auto":  # on CUDA the caller found no `gpu_gap` before planning this call
            return x2d.device.type == "cuda"
        return triton_linear.usable(x2d, weight=weight)

    def counters_for(self, kind: str, m: int, n: int, k: int, device: torch.device) -> torch.Tensor:
        """Zeroed int32 counters for a checked C [m, n] = A [m, k]·B launch (left zero by the kernel)."""
        shape = (m, n, k, device)
        current = self.counters.get(kind)
        if current is None or current[0] != shape:  # a new shape: enough counters for it
            tg = triton_linear.tg
            need = tg.counters_needed(m, n, tg.config_for(m, n, k))
            if current is None or current[1].numel() < need or current[1].device != device:
                current = (shape, torch.zeros(need, dtype=torch.int32, device=device))
            self.counters[kind] = current = (shape, current[1])
        return current[1]


def run_gemm(
    hooks: GemmSensorHooks,
    plan: Any | None,
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    out_dtype: torch.dtype,
    tiling: Tiling,
    fast: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """One GEMM on the reference path: checked if planned (a check or a fault), else the fast path."""
    if plan is None:
        return fast()
    if plan.fault_needs_scale:
        # A perturb fault before the site knows its median clean difference: measure this call's
        # own clean difference first (on the device, no host sync) and scale the fault by it.
        clean = checked_gemm(a, b, out_dtype=out_dtype, bias=bias, col_check=False, tiling=tiling)
        scale = (clean.row_sum - clean.row_ref).norm()
        plan.injection.fault = dataclasses.replace(plan.fault, delta=plan.fault.delta * scale)
    result = checked_gemm(
        a, b, out_dtype=out_dtype, bias=bias, col_check=plan.check and plan.col_check, tiling=tiling, fault=plan.fault
    )
    hooks.observe(plan, GemmOperands(a, b, bias, out_dtype, tiling), result)
    return result.out


@dataclass
class LinearCall:
    """What one checked call of a Linear carries from its forward to its backward."""

    hooks: LinearHooks
    plans: tuple[Any, Any, Any]
    source: torch.Tensor  # the parameter (detached): keys the weight statistics
    triton: bool = False
    x_sums: triton_linear.Byproduct | None = None  # X·1 when the checked forward made it


_NO_CONTEXT = contextlib.nullcontext()


def _autocast_off(device_type: str):
    """A context with autocast off: the GEMMs here run in the operands' dtype, as the checks and
    replays assume. Entered only where autocast is on (entering it costs microseconds per call)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return _NO_CONTEXT


def linear_forward(
    call: LinearCall, x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Y = X·Wᵀ + b for a planned call (its forward GEMM checked or not, as planned)."""
    hooks = call.hooks
    with _autocast_off(x2d.device.type):
        if hooks.use_triton(x2d, weight):
            call.triton = True
            out = _triton_forward(call, x2d, weight, bias)
        else:
            out = run_gemm(
                hooks.forward, call.plans[0], x2d, weight.t(), bias, out_dtype=x2d.dtype, tiling=hooks.tiling,
                fast=lambda: F.linear(x2d, weight, bias),
            )  # fmt: skip
    hooks.after_call()
    return out


def linear_backward(
    call: LinearCall, dy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, needs_dx: bool, needs_dw: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dX, dW) of a planned call, each GEMM checked or not as planned at forward time."""
    hooks = call.hooks
    _, dgrad_plan, wgrad_plan = call.plans
    dx = dw = None
    with _autocast_off(dy.device.type):
        if call.triton and triton_linear.usable(dy.contiguous()):
            dx, dw = _triton_backward(call, dy.contiguous(), x2d, weight, needs_dx, needs_dw)
        else:
            if needs_dx:
                dx = run_gemm(
                    hooks.dgrad, dgrad_plan, dy, weight, None, out_dtype=x2d.dtype, tiling=hooks.tiling,
                    fast=lambda: dy.mm(weight),
                )  # fmt: skip
            if needs_dw:
                dy_t = dy.t()
                dw = run_gemm(
                    hooks.wgrad, wgrad_plan, dy_t, x2d, None, out_dtype=weight.dtype, tiling=hooks.tiling,
                    fast=lambda: dy_t.mm(x2d),
                )  # fmt: skip
    hooks.after_call()
    return dx, dw


class CheckedLinearFunction(torch.autograd.Function):
    """Y = X·Wᵀ + b over a 2-D input X [M, K] in eager mode; see the module docstring for dgrad and
    wgrad (ops/linear_op.py is the same as a torch.library op, for torch.compile)."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, hooks: LinearHooks, source: torch.Tensor, plans: tuple[Any, Any, Any]):
        ctx.call, ctx.has_bias = LinearCall(hooks, plans, source), bias is not None
        out = linear_forward(ctx.call, x2d, weight, bias)
        ctx.save_for_backward(x2d, weight)
        return out

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2d, weight = ctx.saved_tensors
        needs_dx, needs_dw, needs_db = ctx.needs_input_grad[:3]
        db = dy.sum(dim=0) if ctx.has_bias and needs_db else None
        if torch.is_grad_enabled():
            # backward(create_graph=True): a gradient that will itself be differentiated (gradient
            # penalties, meta-learning). The checked kernels have no derivative of their own, so this
            # call's dgrad and wgrad run as differentiable torch GEMMs, unchecked; its forward was checked.
            dx, dw = plain_backward(dy, x2d, weight, needs_dx, needs_dw)
        else:
            dx, dw = linear_backward(ctx.call, dy, x2d, weight, needs_dx, needs_dw)
        return dx, dw, db, None, None, None


def plain_backward(
    dy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, needs_dx: bool, needs_dw: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dX, dW) as torch GEMMs: unchecked, and differentiable when grad mode is on."""
    return (dy.mm(weight) if needs_dx else None), (dy.t().mm(x2d) if needs_dw else None)


def _step(hooks: LinearHooks) -> int | None:
    return None if hooks.plan is None else hooks.plan.step


def _triton_forward(
    call: LinearCall, x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    hooks: LinearHooks = call.hooks
    fwd_plan = call.plans[0]
    if fwd_plan is None:  # a checked wgrad takes X·1 in its own pass (_triton_backward)
        return F.linear(x2d, weight, bias)
    fwd_side, _ = hooks.weight_stats.get(weight, call.source, hooks.state.epoch)
    m, n = x2d.shape[0], weight.shape[0]
    out = torch.empty(m, n, dtype=x2d.dtype, device=x2d.device)
    # X·1, the wgrad's c: a by-product of this launch, into the Linear's pooled buffer when a wgrad
    # follows on the Triton path, else into scratch. Made either way: its cost is M values, and one
    # kernel variant serves both cases (a variant first needed mid-run would compile inside a
    # training step: hundreds of milliseconds)
    if call.plans[2] is not None:
        call.x_sums = hooks.byproducts.take(_step(hooks), m, x2d.dtype, x2d.device)
        byproduct = call.x_sums
    else:
        byproduct = triton_linear.Byproduct.scratch(m, x2d.dtype, x2d.device)
    triton_linear.run(
        hooks.forward,
        fwd_plan,
        x2d,
        weight,
        out,
        a_t=False,
        b_t=True,
        bias=bias,
        c_side=fwd_side,
        u_side=None,
        col_check=hooks.forward.col_check,
        counters=hooks.counters_for("fwd", m, n, x2d.shape[1], x2d.device),
        state=hooks.state,
        weight_stats=lambda w: triton_linear.WeightStats.compute(w)[0],
        byproduct=byproduct,
    )
    return out


def _triton_backward(call: LinearCall, dy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, needs_dx: bool,
                     needs_dw: bool):  # fmt: skip
    hooks: LinearHooks = call.hooks
    _, dgrad_plan, wgrad_plan = call.plans
    wgrad_cols = wgrad_plan is not None and hooks.wgrad.col_check
    dx = dw = None
    dy_sums = None
    if needs_dx:
        if dgrad_plan is None:  # a column-checked wgrad takes dY·1 in its own pass
            dx = dy.mm(weight)
        else:
            _, dgrad_side = hooks.weight_stats.get(weight, call.source, hooks.state.epoch)
            m, n = dy.shape[0], weight.shape[1]
            dx = torch.empty(m, n, dtype=x2d.dtype, device=dy.device)
            byproduct = None
            if hooks.wgrad.col_check:  # dY·1, the wgrad's u1: a by-product (made always, as X·1 is)
                if wgrad_cols and needs_dw:
                    byproduct = dy_sums = hooks.byproducts.take(_step(hooks), m, dy.dtype, dy.device)
                else:
                    byproduct = triton_linear.Byproduct.scratch(m, dy.dtype, dy.device)
            triton_linear.run(
                hooks.dgrad,
                dgrad_plan,
                dy,
                weight,
                dx,
                a_t=False,
                b_t=False,
                bias=None,
                c_side=dgrad_side,
                u_side=None,
                col_check=hooks.dgrad.col_check,
                counters=hooks.counters_for("dgrad", m, n, dy.shape[1], dy.device),
                state=hooks.state,
                weight_stats=lambda w: triton_linear.WeightStats.compute(w)[1],
                byproduct=byproduct,
            )
    if needs_dw:
        if wgrad_plan is None:
            dw = dy.t().mm(x2d)
        else:
            # c = X·1 and u1 = dY·1: by-products of the checked forward and dgrad, else one pass each
            x_side = call.x_sums.side() if call.x_sums is not None else None
            if x_side is None:
                x_side = SideMatrix.of(triton_linear.row_sums(x2d), x2d.dtype)
            dy_side = None
            if wgrad_cols:
                dy_side = dy_sums.side() if dy_sums is not None else SideMatrix.of(triton_linear.row_sums(dy), dy.dtype)
            m, n = dy.shape[1], x2d.shape[1]
            dw = torch.empty(m, n, dtype=weight.dtype, device=dy.device)
            triton_linear.run(
                hooks.wgrad,
                wgrad_plan,
                dy,
                x2d,
                dw,
                a_t=True,
                b_t=False,
                bias=None,
                c_side=x_side,
                u_side=dy_side,
                col_check=wgrad_cols,
                counters=hooks.counters_for("wgrad", m, n, dy.shape[0], dy.device),
                state=hooks.state,
            )
    return dx, dw
