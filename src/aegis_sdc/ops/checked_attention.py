"""The checked attention op: `scaled_dot_product_attention` semantics (causal or an `attn_mask`,
dropout, grouped-query attention) as one autograd Function over the reference kernels.

    q [B, H, Sq, D], k and v [B, Hkv, Sk, D] with H a multiple of Hkv → out [B, H, Sq, D]

Heads are indexed flattened, N = B·H, and computed in one batched pass; per head the forward and
backward checksum values go to the op's hooks (the sensor of the calling module): the op knows
nothing of thresholds or stores. Unsupported arguments raise `ValueError` naming the problem. The
kernels (`kernels_for`, `Kernels`): CUDA operands the fused Triton kernels take
(kernels/triton_attention.py: bf16/fp16, head dimension a power of two; dropout drawn inside them)
run on those when `TRITON_ON_CUDA` is set — q, k, v read in place as laid out (GQA and Hugging
Face's transposed views without copies, the mask in its broadcast shape); anything else runs on the
reference kernels (flattened heads, K and V expanded over each group). Forward, backward and every replay of a call run
on the same kernels.

Precision: under autocast, q, k and v are first cast to the autocast dtype, as autocast casts
SDPA's inputs (it is on autocast's lower-precision list). From there on its arithmetic (the
reference kernels) runs with autocast off and exact fp32 matmuls (`kernels.numerics.exact_fp32`) in
forward, in backward and in every replay, so a replay at the step's end computes exactly what the
training step computed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from aegis_sdc.kernels import triton_attention
from aegis_sdc.kernels.attention_reference import HeadFault, attention_backward, attention_forward

# The Triton kernels on CUDA: off until their GPU test (tests/test_triton_attention.py, marked `gpu`)
# and benchmarks/attention.py have run on the device; until then CUDA calls of the op take the
# reference kernels, as before, and protected models keep SDPA on CUDA (integrations/attention.py).
TRITON_ON_CUDA = False


@dataclass(frozen=True)
class Kernels:
    """A forward and backward pair and the operands it takes: `in_place` kernels read q, k, v
    [B, H, S, D] as laid out (GQA and transposed views in place, the mask in its broadcast shape);
    the others take flattened heads [B·H, S, D] with K and V expanded and the mask materialized."""

    forward: Callable[..., Any]
    backward: Callable[..., Any]
    in_place: bool


REFERENCE = Kernels(attention_forward, attention_backward, in_place=False)
TRITON = Kernels(triton_attention.forward, triton_attention.backward, in_place=True)


def kernels_for(q: torch.Tensor, k: torch.Tensor, dropout_p: float = 0.0) -> Kernels:
    """The kernels for a call: the Triton kernels for CUDA operands they take (with `TRITON_ON_CUDA`),
    else the reference path. A call's bits depend on the choice: its replays keep the kernels it ran on."""
    if TRITON_ON_CUDA and q.is_cuda and triton_attention.supported(q, k, dropout_p) is None:
        return TRITON
    return REFERENCE


class AttentionHooks(Protocol):
    def plan(self, heads: int) -> Any | None: ...

    def fault_for(self, plan: Any, backward: bool) -> HeadFault | None: ...

    def observe(self, plan: Any, backward: bool, values: torch.Tensor, capture: Any) -> None: ...


def attention_flops(heads: int, queries: int, keys: int, dim: int, causal: bool) -> float:
    """Matmul FLOPs of one call, forward and backward: QKᵀ and P·V forward (2 · 2·Sq·Sk·D per head),
    and in backward the scores again, dV, dP, dQ and dK (5 such products); half of it under a
    causal mask."""
    return 7 * 2.0 * heads * queries * keys * dim * (0.5 if causal else 1.0)


def validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"checked attention needs 4-D q, k, v [B, H, S, D]; got {shapes}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"checked attention: incompatible shapes {shapes}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"checked attention: query heads are not a multiple of key/value heads: {shapes}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"checked attention: q, k, v need one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")


def mask_problem(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor, dropout_p: float = 0.0) -> str | None:
    """Why an `attn_mask` cannot be checked (None: it can). Checked: boolean or floating masks that
    broadcast to [B, H, Sq, Sk]; one that requires grad (T5's learned position bias, Swin's relative
    bias) on the reference kernels, which give its gradient — the scores' gradient dS, summed over the
    mask's broadcast dimensions. A query row the mask leaves no key (the padded rows of a left-padded
    batch) gets zeros, output and gradients, as SDPA gives it, and checks nothing, on both paths (no
    host read of the mask)."""
    b, h, sq, _ = q.shape
    target = (b, h, sq, k.shape[2])
    if not (mask.dtype == torch.bool or mask.is_floating_point()):
        return f"an attn_mask of dtype {mask.dtype}"
    if mask.requires_grad and kernels_for(q, k, dropout_p).in_place:
        return "an attn_mask that requires grad (the GPU kernels compute no gradient for the mask)"
    try:
        torch.broadcast_shapes(mask.shape, target)
    except RuntimeError:
        return f"an attn_mask of shape {tuple(mask.shape)} for scores {target}"
    return None


def _additive(mask: torch.Tensor) -> torch.Tensor:
    """SDPA's attn_mask as the kernels add it, in its own (broadcast) shape: fp32, a boolean mask
    0 where it keeps a key and −inf where not."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.float()


def _operands(kernels: Kernels, q, k, v, mask: torch.Tensor | None) -> tuple:
    """(q, k, v, mask) as `kernels` take them (see `Kernels`)."""
    if kernels.in_place:
        return q, k, v, None if mask is None else _additive(mask)
    b, h, sq, _ = q.shape
    flat = None if mask is None else _additive(mask).expand(b, h, sq, k.shape[2]).reshape(b * h, sq, k.shape[2])
    return (*_heads(q, k, v), flat)


def autocast_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v as SDPA sees them: cast to the autocast dtype when autocast is on for their device."""
    device_type = q.device.type
    if not torch.is_autocast_enabled(device_type):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in (q, k, v))


def _heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """[B, H, S, D] → [B·H, S, D], with K and V repeated over each group of query heads."""
    b, h = q.shape[:2]
    group = h // k.shape[1]

    def flat(t: torch.Tensor) -> torch.Tensor:
        expanded = t.repeat_interleave(group, dim=1) if group > 1 else t
        return expanded.reshape(b * h, *t.shape[2:])

    return q.reshape(b * h, *q.shape[2:]), flat(k), flat(v)


class CallReplay:
    """What a vTask keeps of one call: its inputs and what training computed from them. The verifier
    reruns the whole call (the same batched shapes, hence the same bits) and compares one head.
    `copy=False`: the tensors are the replay's own already (`CallContext.head_copy`)."""

    def __init__(self, kernels: Kernels, head: int, q, k, v, scale, causal, out, lse, dout=None, grads=None,
                 mask=None, drop=None, *, copy: bool = True) -> None:  # fmt: skip
        def keep(t):  # the call's own tensors are reused by later ops: a replay keeps copies
            return t.detach().clone() if copy and t is not None else t

        self.kernels, self.head = kernels, head
        self.mask, self.drop = keep(mask), keep(drop)
        self.q, self.k, self.v = keep(q), keep(k), keep(v)
        self.scale, self.causal = scale, causal
        self.out, self.lse, self.dout = keep(out), keep(lse), keep(dout)
        self.grads = None if grads is None else tuple(keep(g[head]) for g in grads)

    def _of_head(self, t: torch.Tensor) -> torch.Tensor:
        """The suspect head's slice of an operand: flattened [N, S, D], or [B, H or Hkv, S, D]."""
        if t.dim() == 3:
            return t[self.head]
        batch, head = divmod(self.head, self.q.shape[1])
        return t[batch, head // (self.q.shape[1] // t.shape[1])]

    def inputs_finite(self) -> bool:
        tensors = [self._of_head(self.q), self._of_head(self.k), self._of_head(self.v)]
        if self.dout is not None:
            tensors.append(self._of_head(self.dout))
        return all(bool(torch.isfinite(t).all()) for t in tensors)

    def saved_forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.out[self.head], self.lse[self.head]

    def _forward(self):
        return self.kernels.forward(self.q, self.k, self.v, self.scale, self.causal, None, self.mask, self.drop)

    def _backward(self):
        return self.kernels.backward(self.q, self.k, self.v, self.out, self.lse, self.dout, self.scale, self.causal,
                                     None, self.mask, self.drop)  # fmt: skip

    def forward_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        again = self._forward()
        return again.out[self.head], again.lse[self.head]

    def check_values(self, backward: bool) -> torch.Tensor:
        """The head's check values [checks] as a replay computes them (forward: one value)."""
        if backward:
            return self._backward().values[:, self.head]
        return self._forward().values[self.head : self.head + 1]

    def backward_outputs(self) -> tuple[torch.Tensor, ...]:
        again = self._backward()
        return again.dq[self.head], again.dk[self.head], again.dv[self.head]


class CallContext:
    """What the op hands its hooks for one pass of a call, to replay a head of it later.

    Called with a head index (an int: the reference path, whose values are on the host), it keeps a
    copy of the whole call (`CallReplay`). With `deferred` (the Triton kernels: values on the
    device, read at the step's end), the suspect head is chosen on the device and `head_copy` copies
    just that head's operands and results — a one-head problem [1, 1, S, D] whose replay computes
    the head's bits (each head's programs read only that head) — with no host read."""

    def __init__(self, kernels: Kernels, q, k, v, scale: float, causal: bool, out, lse, dout=None, grads=None,
                 mask=None, drop=None) -> None:  # fmt: skip
        self.kernels, self.deferred = kernels, kernels.in_place
        self.q, self.k, self.v, self.out, self.lse, self.dout = q, k, v, out, lse, dout
        self.scale, self.causal, self.grads, self.mask, self.drop = scale, causal, grads, mask, drop

    def __call__(self, head: int) -> CallReplay:
        return CallReplay(self.kernels, head, self.q, self.k, self.v, self.scale, self.causal, self.out, self.lse,
                          self.dout, self.grads, self.mask, self.drop)  # fmt: skip

    def head_copy(self, head: torch.Tensor) -> CallReplay:
        """A replay of flattened head `head` (int64 [1] on the device) of in-place operands: q, k, v,
        dO [B, H or Hkv, S, D]; out, lse, gradients per query head [N, ...]; the mask in its
        broadcast shape (only its non-broadcast dimensions indexed); dropout's draw for that head."""
        heads = self.q.shape[1]
        batch, within = head // heads, head % heads  # [1] each, on the device
        group = heads // self.k.shape[1]

        def one(t: torch.Tensor, kv: bool = False) -> torch.Tensor:  # [B, H, S, D] → [1, 1, S, D]
            return t[batch, within // group if kv else within].unsqueeze(0)

        def flat(t: torch.Tensor) -> torch.Tensor:  # [N, ...] → [1, ...]
            return t.index_select(0, head)

        mask = self.mask
        if mask is not None:
            mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
            zero = head * 0
            mask = mask[batch if mask.shape[0] > 1 else zero, within if mask.shape[1] > 1 else zero].unsqueeze(0)
        dout = None if self.dout is None else one(self.dout)
        grads = None if self.grads is None else tuple(flat(g) for g in self.grads)
        drop = None if self.drop is None else self.drop.of_head(head)  # the head's own Philox stream
        return CallReplay(self.kernels, 0, one(self.q), one(self.k, True), one(self.v, True), self.scale, self.causal,
                          flat(self.out), flat(self.lse), dout, grads, mask, drop, copy=False)  # fmt: skip


DOUBLE_BACKWARD = (
    "aegis-sdc: checked attention has no second derivative: differentiating a gradient through a protected "
    "model's attention (a gradient penalty, meta-learning) needs GuardConfig(attention=False) — the Linears "
    "stay checked and support it"
)


def _differentiable_once(backward):
    """torch's `once_differentiable`, its error naming the library and the way out: the gradients
    are computed without a graph, and differentiating them raises DOUBLE_BACKWARD."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled() or not any(isinstance(g, torch.Tensor) and g.requires_grad for g in grads):
            return outputs
        error = torch._C._functions.DelayedError(DOUBLE_BACKWARD.encode(), len(outputs))
        return error(*[o.detach().requires_grad_() if o is not None else None for o in outputs])

    return wrapper


class CheckedAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, hooks: AttentionHooks, attn_mask: torch.Tensor | None,
                dropout_p: float):  # fmt: skip
        b, h = q.shape[:2]
        plan = hooks.plan(b * h)
        kernels = kernels_for(q, k, dropout_p)
        qf, kf, vf, mask = _operands(kernels, q, k, v, attn_mask)
        drop = None
        # drawn from the device's RNG, once per call (a checkpoint's recomputation restores it): the
        # Triton kernels draw the mask themselves from a seed; the reference kernels take it whole
        if dropout_p > 0.0 and kernels.in_place:
            drop = triton_attention.DropoutDraw.new(dropout_p, q.device)
        elif dropout_p > 0.0:
            keep = torch.rand(b * h, q.shape[2], k.shape[2], device=q.device) >= dropout_p
            drop = keep.float() / (1.0 - dropout_p)
        result = kernels.forward(qf, kf, vf, scale, causal, hooks.fault_for(plan, False), mask, drop)
        out, lse = result.out, result.lse

        hooks.observe(plan, False, result.values, CallContext(kernels, qf, kf, vf, scale, causal, out, lse, mask=mask,
                                                              drop=drop))  # fmt: skip
        ctx.kernels, ctx.mask, ctx.drop = kernels, mask, drop  # the mask as the kernels take it
        ctx.mask_like = None if attn_mask is None else (attn_mask.shape, attn_mask.dtype)  # for its gradient
        ctx.save_for_backward(q, k, v, result.out, result.lse)
        ctx.causal, ctx.scale, ctx.hooks, ctx.plan = causal, scale, hooks, plan
        return result.out.view(q.shape)

    @staticmethod
    @_differentiable_once
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        b, h = q.shape[:2]
        kernels, mask, drop, scale, causal = ctx.kernels, ctx.mask, ctx.drop, ctx.scale, ctx.causal
        qf, kf, vf, _ = _operands(kernels, q, k, v, None)
        do = dout if kernels.in_place else dout.reshape(out.shape)
        fault = ctx.hooks.fault_for(ctx.plan, True)
        result = kernels.backward(qf, kf, vf, out, lse, do, scale, causal, fault, mask, drop)
        grads = (result.dq, result.dk, result.dv)

        context = CallContext(kernels, qf, kf, vf, scale, causal, out, lse, do, grads, mask, drop)
        ctx.hooks.observe(ctx.plan, True, result.values, context)
        hkv = k.shape[1]
        # GQA: each key/value head's gradient is the sum over its group of query heads (fp32, fixed order)
        dk = result.dk.reshape(b, hkv, h // hkv, *k.shape[2:]).sum(dim=2)
        dv = result.dv.reshape(b, hkv, h // hkv, *v.shape[2:]).sum(dim=2)
        dmask = None
        if ctx.needs_input_grad[6]:  # S = c·qkᵀ + mask: the mask's gradient is dS, summed where it broadcast
            shape, dtype = ctx.mask_like
            dmask = result.ds.reshape(b, h, *result.ds.shape[1:]).sum_to_size(shape).to(dtype)
        return result.dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, dmask, None


def checked_attention(q, k, v, *, causal: bool = False, scale: float | None = None, hooks: AttentionHooks,
                      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0):  # fmt: skip
    """Attention with its forward and backward checks; `attn_mask` as SDPA's (boolean: True keeps a
    key; floating: added to the scaled scores), not together with `causal`, as in SDPA; `dropout_p`
    as SDPA's (the mask drawn from torch's global RNG — the same distribution as SDPA's dropout, not
    the same draws)."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"checked attention: dropout_p must be in [0, 1), got {dropout_p}")
    q, k, v = autocast_inputs(q, k, v)
    validate(q, k, v)
    if attn_mask is not None:
        if causal:
            raise ValueError("checked attention: attn_mask and causal together (SDPA takes one or the other)")
        problem = mask_problem(attn_mask, q, k, dropout_p)
        if problem is not None:
            raise ValueError(f"checked attention cannot take {problem}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return CheckedAttentionFunction.apply(q, k, v, causal, scale, hooks, attn_mask, float(dropout_p))
