"""The checked attention op: `scaled_dot_product_attention` semantics (no mask, no dropout; causal or
not; grouped-query attention) as one autograd Function over the reference kernels.

    q [B, H, Sq, D], k and v [B, Hkv, Sk, D] with H a multiple of Hkv → out [B, H, Sq, D]

Heads are flattened to N = B·H (K and V expanded over each group of query heads) and computed in one
batched pass; per head the forward and backward checksum values go to the op's hooks (the sensor of
the calling module): the op knows nothing of thresholds or stores. Unsupported arguments raise
`ValueError` naming the problem. The kernels (`kernels_for`): CUDA operands the fused Triton kernels
take (kernels/triton_attention.py: bf16/fp16, head dimension a power of two) will run those once they
are measured on the GPU (`TRITON_ON_CUDA`), anything else the reference kernels; forward, backward
and every replay of a call run the same. Protected models keep SDPA on CUDA (integrations/attention.py).

Precision: under autocast, q, k and v are first cast to the autocast dtype, as autocast casts
SDPA's inputs (it is on autocast's lower-precision list). From there on its arithmetic (the
reference kernels) runs with autocast off and exact fp32 matmuls (`kernels.numerics.exact_fp32`) in
forward, in backward and in every replay, so a replay at the step's end computes exactly what the
training step computed.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch.autograd.function import once_differentiable

from aegis_sdc.kernels import triton_attention
from aegis_sdc.kernels.attention_reference import HeadFault, attention_backward, attention_forward

# The Triton kernels on CUDA: off until their GPU test (tests/test_triton_attention.py, marked `gpu`)
# and benchmarks/attention.py have run on the device; until then CUDA calls of the op take the
# reference kernels, as before, and protected models keep SDPA on CUDA (integrations/attention.py).
TRITON_ON_CUDA = False


def kernels_for(q: torch.Tensor) -> tuple[Any, Any]:
    """(forward, backward) for flattened operands like q: the Triton kernels for CUDA operands they
    take (with `TRITON_ON_CUDA`), else the reference path. A call's bits depend on the choice, so
    replays make it again from the same operands."""
    if TRITON_ON_CUDA and q.is_cuda and triton_attention.supported(q, q) is None:
        return triton_attention.forward, triton_attention.backward
    return attention_forward, attention_backward


class AttentionHooks(Protocol):
    def plan(self, heads: int) -> Any | None: ...

    def fault_for(self, plan: Any, backward: bool) -> HeadFault | None: ...

    def observe(self, plan: Any, backward: bool, values: torch.Tensor, capture: Any) -> None: ...


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
    reruns the whole call (the same batched shapes, hence the same bits) and compares one head."""

    def __init__(self, head: int, q, k, v, scale, causal, out, lse, dout=None, grads=None) -> None:
        def keep(t):
            return None if t is None else t.detach().clone()

        self.head = head
        self.q, self.k, self.v = keep(q), keep(k), keep(v)
        self.scale, self.causal = scale, causal
        self.out, self.lse, self.dout = keep(out), keep(lse), keep(dout)
        self.grads = None if grads is None else tuple(g[head].detach().clone() for g in grads)

    def inputs_finite(self) -> bool:
        tensors = [self.q[self.head], self.k[self.head], self.v[self.head]]
        if self.dout is not None:
            tensors.append(self.dout[self.head])
        return all(bool(torch.isfinite(t).all()) for t in tensors)

    def saved_forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.out[self.head], self.lse[self.head]

    def _forward(self):
        return kernels_for(self.q)[0](self.q, self.k, self.v, self.scale, self.causal)

    def _backward(self):
        backward = kernels_for(self.q)[1]
        return backward(self.q, self.k, self.v, self.out, self.lse, self.dout, self.scale, self.causal)

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


class CheckedAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, hooks: AttentionHooks):
        b, h = q.shape[:2]
        plan = hooks.plan(b * h)
        qf, kf, vf = _heads(q, k, v)
        result = kernels_for(qf)[0](qf, kf, vf, scale, causal, hooks.fault_for(plan, False))
        hooks.observe(plan, False, result.values,
                      lambda i: CallReplay(i, qf, kf, vf, scale, causal, result.out, result.lse))  # fmt: skip
        ctx.save_for_backward(q, k, v, result.out, result.lse)
        ctx.causal, ctx.scale, ctx.hooks, ctx.plan = causal, scale, hooks, plan
        return result.out.reshape(q.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        b, h = q.shape[:2]
        qf, kf, vf = _heads(q, k, v)
        do = dout.reshape(out.shape)
        backward = kernels_for(qf)[1]
        result = backward(qf, kf, vf, out, lse, do, ctx.scale, ctx.causal, ctx.hooks.fault_for(ctx.plan, True))
        grads = (result.dq, result.dk, result.dv)
        ctx.hooks.observe(ctx.plan, True, result.values,
                          lambda i: CallReplay(i, qf, kf, vf, ctx.scale, ctx.causal, out, lse, do, grads))  # fmt: skip
        hkv = k.shape[1]
        # GQA: each key/value head's gradient is the sum over its group of query heads (fp32, fixed order)
        dk = result.dk.reshape(b, hkv, h // hkv, *k.shape[2:]).sum(dim=2)
        dv = result.dv.reshape(b, hkv, h // hkv, *v.shape[2:]).sum(dim=2)
        return result.dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def checked_attention(q, k, v, *, causal: bool = False, scale: float | None = None, hooks: AttentionHooks):
    """Attention with the forward (O·1 = P·(V·1)) and backward (1ᵀdV = 1ᵀdO) checks."""
    q, k, v = autocast_inputs(q, k, v)
    validate(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return CheckedAttentionFunction.apply(q, k, v, causal, scale, hooks)
