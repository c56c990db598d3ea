"""Route a protected model's `F.scaled_dot_product_attention` calls to the checked attention op.

While a guard is open, `torch.nn.functional.scaled_dot_product_attention` is replaced by `sdpa`
below. A call is checked when it comes from a module of the protected model (the calling frame's
`self` or `module`, which names the site: `layers.1.attn:attn_fwd` / `:attn_bwd`), its arguments are
supported (4-D q, k, v; causal or an `attn_mask` the op takes — padding masks included; attention
dropout; `enable_gqa` or equal head counts). On CUDA the op runs the Triton kernels
(ops/checked_attention.TRITON_ON_CUDA; bf16/fp16, head dimension a power of two, dropout inside them);
while that switch is off, CUDA calls stay unchecked and are named. A call of the model that stays unchecked for
any of these reasons is named once per module, in a warning and the coverage report
(`uncovered`): nothing falls back silently. Sampled calls run the checked op; the others, and every
call from outside the model, keep SDPA and its fastest backend. Inside a checkpointed segment the
recomputation replays the forward's decision, so both runs take the same path (bit-identical
results).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from aegis_sdc.integrations.modules import _transformed, module_names
from aegis_sdc.kernels import triton_attention
from aegis_sdc.ops import checked_attention as attention_op
from aegis_sdc.ops.checked_attention import autocast_inputs, checked_attention, mask_problem
from aegis_sdc.ops.checked_linear import PlanTracer
from aegis_sdc.sensors.attention import AttentionPlan, AttentionSensor

CALLER_DEPTH = 3  # frames searched for the calling module (a helper function may sit in between)


class _PlannedHooks:
    """The hooks the op sees for one call: the plan made before it, and the sensor."""

    def __init__(self, sensor: AttentionSensor, plan: AttentionPlan, heads_per_batch: int) -> None:
        self.sensor, self.planned, self.heads_per_batch = sensor, plan, heads_per_batch

    def plan(self, heads: int) -> AttentionPlan:
        return self.planned

    def fault_for(self, plan, backward: bool):
        return self.sensor.fault_for(plan, backward)

    def observe(self, plan, backward: bool, values, capture) -> None:
        self.sensor.observe(plan, backward, values, capture, self.heads_per_batch)


def _live(fn):
    """`fn`, or what it passes calls on to when it is a closed router's `sdpa` (guards closed out of
    the order they were opened in)."""
    while isinstance(getattr(fn, "__self__", None), AttentionRouter) and fn.__self__.closed:
        fn = fn.__self__._original
    return fn


def unchecked_reason(q, k, attn_mask, dropout_p: float, is_causal: bool) -> str | None:
    """Why a call of the protected model keeps SDPA unchecked (None: the op takes it). Nothing here
    reads the device: on CUDA a mask's rows are not inspected (the kernels handle a row with no key)."""
    if not 0.0 <= dropout_p < 1.0:
        return f"dropout_p {dropout_p}"
    transformed = _transformed(q, k)
    if transformed is not None:
        return transformed
    if q.is_cuda:
        if not attention_op.TRITON_ON_CUDA:
            return "attention on CUDA (the Triton attention kernels are not enabled yet)"
        problem = triton_attention.supported(q, k, dropout_p)
        if problem is not None:
            return problem
    if attn_mask is not None:
        return "attn_mask together with is_causal" if is_causal else mask_problem(attn_mask, q, k, dropout_p)
    return None


def _shape_problem(q, k, v, enable_gqa: bool, kwargs: dict) -> str:
    """Why a call of the protected model that the op does not take stays on SDPA."""
    if kwargs:
        return f"scaled_dot_product_attention arguments the checked op does not take: {sorted(kwargs)}"
    if q.dim() == k.dim() == v.dim() == 4 and k.shape == v.shape and q.shape[0] == k.shape[0]:
        return (f"key/value heads {k.shape[1]} broadcast over {q.shape[1]} query heads without enable_gqa (the "
                "checked op takes equal heads, one, or grouped ones with enable_gqa=True)")  # fmt: skip
    return (f"q, k, v of shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} (the checked op takes "
            "[B, H, S, D] or [B, S, D], k and v alike, the batch not broadcast)")  # fmt: skip


def attention_outside_sdpa(model: nn.Module) -> tuple[str, list[str]]:
    """A Hugging Face model whose attention implementation is not SDPA ('eager', 'flash_attention_2',
    'flex_attention', ...) computes attention without `scaled_dot_product_attention`, so the router
    never sees it: (the implementation, its attention modules — the outermost module of each whose
    class name ends in 'Attention'), or ("", []) for any other model."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not isinstance(implementation, str) or implementation == "sdpa":
        return "", []
    return implementation, attention_modules(model)


def attention_modules(model: nn.Module) -> list[str]:
    """The model's attention modules by name: the outermost of each nest of modules whose class name
    ends in 'Attention' (Hugging Face's, this project's, most models')."""
    modules: list[str] = []
    for name, module in module_names(model):
        if type(module).__name__.endswith("Attention") and not any(name.startswith(f"{m}.") for m in modules):
            modules.append(name)
    return modules


COMPILED = ("traced by torch.compile: it runs as the compiled graph's own attention, not checked (the "
            "checked attention is an eager-mode op; the compiled model's GEMMs are checked)")  # fmt: skip


class AttentionRouter:
    def __init__(self, model: nn.Module, sensor_for: Callable[[str], AttentionSensor], tracer: PlanTracer,
                 uncovered: Callable[[str, str], None] | None = None) -> None:  # fmt: skip
        self.names = {id(module): name for name, module in module_names(model)}
        self.sensor_for = sensor_for
        self.tracer = tracer
        self.uncovered = uncovered or (lambda module, reason, warn=True: None)
        self.attention_modules = attention_modules(model)  # named if their calls are compiled
        self.compiled_calls = False  # set by calls traced into a compiled graph, each time the graph runs
        self._compiled_named = False
        self.closed = False
        self._original: Any = None
        self._named_on_cuda: set[str] = set()  # modules named for CUDA; looked up until one repeats
        self._cuda_naming_done = False

    def install(self) -> None:
        self._original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self.sdpa

    def uninstall(self) -> None:
        # Another guard may have installed its router over this one: it keeps calling through
        # `self.sdpa`, which passes every call on once this router is closed.
        self.closed = True
        if self._original is not None and F.scaled_dot_product_attention == self.sdpa:
            F.scaled_dot_product_attention = _live(self._original)

    def name_compiled(self) -> None:
        """At a step's end: if attention ran inside a compiled graph, the model's attention modules
        are named not covered, once, with one warning (the graph's calls cannot say whose they are)."""
        if not self.compiled_calls or self._compiled_named or self.closed:
            return
        self._compiled_named = True
        modules = self.attention_modules or ["<attention under torch.compile>"]
        for module in modules:
            self.uncovered(module, COMPILED, False)
        warnings.warn(f"aegis-sdc: the attention of {len(modules)} modules (e.g. {modules[0]}) is not checked — "
                      f"{COMPILED}", stacklevel=2)  # fmt: skip

    def _caller(self) -> str | None:
        frame = sys._getframe(3)  # past this method, `_sdpa` and `sdpa`
        for _ in range(CALLER_DEPTH):
            if frame is None:
                return None
            for key in ("self", "module"):
                name = self.names.get(id(frame.f_locals.get(key)))
                if name is not None:
                    return name or "<root>"
            frame = frame.f_back
        return None

    def sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
             **kwargs):  # fmt: skip
        """`F.scaled_dot_product_attention`, checked for the protected model's supported calls. A call
        on [B, S, D] tensors (one head, batch first) is the [B, 1, S, D] call."""
        if isinstance(query, torch.Tensor) and query.dim() == 3 and key.dim() == 3 and value.dim() == 3:
            mask = attn_mask.unsqueeze(1) if isinstance(attn_mask, torch.Tensor) and attn_mask.dim() == 3 else attn_mask
            out = self._sdpa(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask, dropout_p, is_causal,
                             scale, enable_gqa, **kwargs)  # fmt: skip
            return out.squeeze(1)
        return self._sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, **kwargs)

    def _sdpa(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, **kwargs):
        original = self._original
        if torch.compiler.is_compiling():  # the checked attention is an eager-mode op for now
            # a store the compiled frame replays after its graph runs (no graph break, allowed under
            # fullgraph=True): the step end names the attention modules (name_compiled)
            self.compiled_calls = True
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa, **kwargs)  # fmt: skip

        def fallback():
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa, **kwargs)  # fmt: skip

        # What SDPA would compute on: under autocast its inputs are cast to the autocast dtype. Mixed
        # dtypes outside autocast go to SDPA, which raises its own error.
        q, k, v = autocast_inputs(query, key, value)
        shaped = (
            not kwargs and q.dim() == k.dim() == v.dim() == 4 and k.shape == v.shape and q.shape[0] == k.shape[0]
            # a single key/value head broadcast over the query heads is grouped-query attention's
            # arithmetic with one group (its gradient summed over the heads, as autograd sums a broadcast)
            and (enable_gqa or k.shape[1] in (q.shape[1], 1)) and q.shape[3] == k.shape[3]
            and q.is_floating_point() and q.dtype == k.dtype == v.dtype
        )  # fmt: skip
        if self.closed or (q.is_cuda and self._cuda_naming_done):
            return fallback()
        if not shaped:  # a call SDPA may take (or refuse) that the op does not: named, if the model's
            if not kwargs and (q.dtype != k.dtype or q.dtype != v.dtype or not q.is_floating_point()):
                return fallback()  # SDPA's own error
            name = self._caller()
            if name is not None:
                self.uncovered(name, _shape_problem(q, k, v, enable_gqa, kwargs))
            return fallback()
        # An empty batch, no query or no key: no arithmetic to check, so nothing is left uncovered;
        # SDPA defines the result, while the checked kernels would have no row to reduce.
        if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
            return fallback()
        name = self._caller()
        if name is None:
            return fallback()
        reason = unchecked_reason(q, k, attn_mask, dropout_p, is_causal)
        if reason is not None:
            if q.is_cuda:  # one forward names every attention module; then no more lookups per call
                self._cuda_naming_done = name in self._named_on_cuda
                self._named_on_cuda.add(name)
            self.uncovered(name, reason)
            return fallback()
        if self.tracer.replaying:  # a checkpointed segment's recomputation: the forward's path
            plan = self.tracer.next_replayed()
            if plan is None:
                return fallback()
            sensor, plan = plan
            silent = AttentionPlan(plan.step, plan.call, plan.heads, False, {}, silent=True)
            return checked_attention(q, k, v, causal=is_causal, scale=scale, attn_mask=attn_mask, dropout_p=dropout_p,
                                     hooks=_PlannedHooks(sensor, silent, q.shape[1]))  # fmt: skip
        sensor = self.sensor_for(name)
        plan = sensor.plan(q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.shape[3], q.dtype, is_causal)
        self.tracer.record(None if plan is None else (sensor, plan))
        if plan is None:
            return fallback()
        return checked_attention(q, k, v, causal=is_causal, scale=scale, attn_mask=attn_mask, dropout_p=dropout_p,
                                 hooks=_PlannedHooks(sensor, plan, q.shape[1]))  # fmt: skip
