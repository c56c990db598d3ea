"""The checked Linear as `torch.library` custom ops: what `torch.compile` sees of a protected Linear.

A compiled graph calls `aegis_sdc::linear(x2d, weight, bias, handle)` and, in backward,
`aegis_sdc::linear_backward(dy, x2d, weight, handle, needs_dx, needs_dw)`. Both are opaque to the
compiler (fake implementations give their shapes), so nothing of the library is traced or
specialized: `handle` is a constant int naming the Linear's hooks in a process-wide registry, and
the sampling decision, the choice of kernel and the evidence are taken inside the op at run time,
exactly as in eager mode (ops/checked_linear.py; the two share every function).

What a call's forward leaves for its backward (its plans and by-products) cannot ride on autograd's
context through a compiled graph, so it waits in the Linear's `pending` stack: a backward takes the
newest entry (autograd runs a Linear's backwards in the reverse order of its forwards). Entries that
no backward takes (forwards without backward) are dropped at the step's end. The backward of a
forward that ran unchecked finds `None` and runs the plain GEMMs.

Under torch.compile a Linear inside an activation-checkpointed region is recomputed by the compiled
backward as a new call (its own sampling draw); the recompute fingerprint check runs in eager mode only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aegis_sdc.ops.checked_linear import LinearCall, LinearHooks, linear_backward, linear_forward, plain_backward

_HOOKS: list[LinearHooks | None] = []  # handle → the hooks of one protected Linear (None once closed)


def register(hooks: LinearHooks) -> int:
    """A handle for `hooks`, to be passed to the ops."""
    _HOOKS.append(hooks)
    return len(_HOOKS) - 1


def unregister(handle: int) -> None:
    """The Linear's guard closed: its ops run plain GEMMs from now on."""
    _HOOKS[handle] = None


@torch.library.custom_op("aegis_sdc::linear", mutates_args=())
def checked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, handle: int) -> torch.Tensor:
    """Y [M, N] = X [M, K] · Wᵀ + b, its three GEMMs checked as the step plan draws them."""
    hooks = _HOOKS[handle]
    if hooks is None:
        return F.linear(x, weight, bias)
    plans = hooks.plans_for_call(x, weight, backward=True)  # a compiled graph's forward runs without grad
    gap = None if plans is None else hooks.gpu_gap(x, weight)
    if gap is not None:
        hooks.uncovered(hooks.forward.site.module, gap)
        plans = None
    if plans is None:
        hooks.pending.append(None)
        return F.linear(x, weight, bias)
    call = LinearCall(hooks, plans, weight.detach())
    out = linear_forward(call, x, weight, bias)
    hooks.pending.append(call)
    return out


@checked_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, handle: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("aegis_sdc::linear_backward", mutates_args=())
def checked_linear_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, handle: int, needs_dx: bool, needs_dw: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dX, dW) of the newest pending forward of this Linear; an empty tensor where not needed."""
    hooks = _HOOKS[handle]
    call = hooks.pending.pop() if hooks is not None and hooks.pending else None
    if call is None:
        dx, dw = plain_backward(dy, x, weight, needs_dx, needs_dw)
    else:
        dx, dw = linear_backward(call, dy, x, weight, needs_dx, needs_dw)
    return (dx if dx is not None else dy.new_empty(0)), (dw if dw is not None else dy.new_empty(0))


@checked_linear_backward.register_fake
def _(dy, x, weight, handle, needs_dx, needs_dw):
    return (x.new_empty(x.shape) if needs_dx else dy.new_empty(0)), (
        weight.new_empty(weight.shape) if needs_dw else dy.new_empty(0)
    )


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, handle = inputs
    ctx.save_for_backward(x, weight)
    ctx.handle, ctx.has_bias = handle, bias is not None


def _backward(ctx, dy: torch.Tensor):
    x, weight = ctx.saved_tensors
    needs_dx, needs_dw, needs_db = ctx.needs_input_grad[:3]
    db = dy.sum(dim=0) if ctx.has_bias and needs_db else None
    if torch.is_grad_enabled():  # backward(create_graph=True): differentiable and unchecked (checked_linear.py)
        hooks = _HOOKS[ctx.handle]
        if hooks is not None and hooks.pending:
            hooks.pending.pop()  # this call's entry: the next backward takes the one before it
        return (*plain_backward(dy, x, weight, needs_dx, needs_dw), db, None)
    dx, dw = torch.ops.aegis_sdc.linear_backward(dy, x, weight, ctx.handle, needs_dx, needs_dw)
    return (dx if needs_dx else None), (dw if needs_dw else None), db, None


checked_linear.register_autograd(_backward, setup_context=_setup_context)
