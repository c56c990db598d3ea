"""nn.MultiheadAttention: its projections checked as Linears.

nn.MultiheadAttention does its matmuls inside `F.multi_head_attention_forward`, never through a
Linear's forward: the input projection is `F.linear` on `in_proj_weight` [3E, E] — whole for
self-attention (query is key is value), split into rows [E | 2E] for encoder–decoder attention
(key is value), in thirds otherwise — or on `q_proj_weight`, `k_proj_weight` and `v_proj_weight`
when the key's or the value's width is not E; the output projection is `F.linear` on
`out_proj.weight` (the child Linear, whose own forward never runs); the attention between them is
`scaled_dot_product_attention` with `need_weights=False`, and with `need_weights=True` (the
module's default) two `bmm`s around a softmax.

A protected MultiheadAttention is a checked subclass of its class (the Linear swap's way: shared
state, copies are the user's module) whose forward runs nn.MultiheadAttention's under a
TorchFunctionMode. The mode takes the call of `F.multi_head_attention_forward` and runs a copy of
that function whose input projections and `linear` are this module's: q, k and v are projected by
the thirds of `in_proj_weight` (or their own weights), each the checked Linear of its own sites
(`self_attn.q_proj:fwd`, `.k_proj`, `.v_proj`; `.out_proj` for the output), so a site is the same
matrix however the module is called. A call none of whose projections the step samples runs torch's
own projection: one GEMM for the packed one, as unprotected. The attention goes through
`scaled_dot_product_attention` as before (integrations/attention.py checks it under this module's
name); `need_weights=True` calls compute it by `bmm`, which is not checked: named once, in a
warning and the coverage report. With the mode active the module never takes its inference fast
path (`torch._native_multi_head_attention`, which no check could see into).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from aegis_sdc.integrations.matrices import MatrixLinear, stand_checked
from aegis_sdc.integrations.modules import Swap, checked_subclass, is_protected, module_names, places_in, selected
from aegis_sdc.ops import linear_op
from aegis_sdc.ops.checked_linear import LinearHooks

PROJECTIONS = ("q_proj", "k_proj", "v_proj")  # the thirds of in_proj_weight, in its row order
NEED_WEIGHTS_AT = list(inspect.signature(F.multi_head_attention_forward).parameters).index("need_weights")
NEED_WEIGHTS = (
    "need_weights=True: nn.MultiheadAttention computes its attention by bmm and softmax, which are not "
    "checked (need_weights=False runs scaled_dot_product_attention, which is)"
)


def select_multihead(model: nn.Module, include: Sequence[str], exclude: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """The nn.MultiheadAttention modules to protect (a subclass too, unless it has a forward of its
    own), in module order; GuardConfig.include/exclude select them by name."""
    return [
        (name, module)
        for name, module in module_names(model)
        if name and isinstance(module, nn.MultiheadAttention) and not is_protected(module)
        and type(module).forward is nn.MultiheadAttention.forward and selected(name, include, exclude)
    ]  # fmt: skip


def _rebound(fn: types.FunctionType, namespace: dict) -> types.FunctionType:
    """A copy of `fn` that looks its global names up in `namespace` (F's own stay untouched)."""
    copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


class _Projections:
    """A protected module's copy of F.multi_head_attention_forward, with its input projections
    (`_in_projection_packed`, `_in_projection`) and its `linear` (the output projection) this module's."""

    def __init__(self, module: nn.Module, linears: dict) -> None:
        self.module = module
        self.linears = linears  # (projection, None) → MatrixLinear
        self.seen: set[str] = set()  # projections checked ops multiplied by, until the first call is done
        self.on_device: set[str] = set()  # (MatrixState.after_first_call reads both)
        self.uses = None  # no use of another op followed: the projections are all it multiplies
        namespace = dict(F.multi_head_attention_forward.__globals__)
        # (a torch whose function no longer calls these names projects unchecked: the first call names
        # the projections it did not see, MatrixState.after_first_call)
        self._packed, self._separate = namespace.get("_in_projection_packed"), namespace.get("_in_projection")
        namespace.update(linear=self.out_projection, _in_projection_packed=self.in_projection_packed,
                         _in_projection=self.in_projection)  # fmt: skip
        # No module name: torch.compile then reads the copy's globals from this dict (with one, from
        # the module of that name — torch.nn.functional's, where `linear` is another function).
        del namespace["__name__"]
        self.namespace = namespace
        self.forward = _rebound(F.multi_head_attention_forward, namespace)

    def in_projection_packed(self, q, k, v, w, b=None):
        """q, k, v [..., E] projected by the thirds of `in_proj_weight` w [3E, E] (torch's packs them
        into one or two GEMMs by whether q, k and v are one tensor; the products are the same)."""
        e = w.shape[0] // 3
        thirds = [(w[i * e : (i + 1) * e], None if b is None else b[i * e : (i + 1) * e]) for i in range(3)]
        return self._project((q, k, v), thirds, lambda: self._packed(q, k, v, w, b))

    def in_projection(self, q, k, v, w_q, w_k, w_v, b_q=None, b_k=None, b_v=None):
        """q, k, v projected by their separate weights (a key or value width other than E)."""
        unchecked = lambda: self._separate(q, k, v, w_q, w_k, w_v, b_q, b_k, b_v)  # noqa: E731
        return self._project((q, k, v), [(w_q, b_q), (w_k, b_k), (w_v, b_v)], unchecked)

    def _project(self, inputs: tuple, weights: list, unchecked: Callable[[], tuple]) -> tuple:
        linears = [self.linears[(name, None)] for name in PROJECTIONS]
        if not self.module.aegis_matrix.first_call_done:
            self.seen.update(PROJECTIONS)
        calls = list(zip(linears, inputs, weights, strict=True))
        if torch.compiler.is_compiling():
            return tuple(linear(x, w, b) for linear, x, (w, b) in calls)
        plans = [linear.hooks.plans_for_call(x, w) for linear, x, (w, _) in calls]
        if all(plan is None for plan in plans):
            return unchecked()  # nothing sampled: torch's own projection (one GEMM when packed)
        return tuple(linear.run(x, w, b, plan) for (linear, x, (w, b)), plan in zip(calls, plans, strict=True))

    def out_projection(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The function's `linear`: the output projection's, checked (any other matrix: F.linear)."""
        if weight is not self.module.out_proj.weight:
            return F.linear(x, weight, bias)
        if not self.module.aegis_matrix.first_call_done:
            self.seen.add("out_proj")
        return self.linears[("out_proj", None)](x, weight, bias)


class _Mode(TorchFunctionMode):
    """During one forward of a protected module: its call of F.multi_head_attention_forward runs the
    module's copy of it (the mode is off inside its own handler: the copy's other calls pass)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.ran = False  # whether the call reached F.multi_head_attention_forward

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.multi_head_attention_forward:
            return func(*args, **kwargs)
        module = self.module  # (the attention router names the calling module by this local)
        self.ran = True
        need_weights = args[NEED_WEIGHTS_AT] if len(args) > NEED_WEIGHTS_AT else kwargs.get("need_weights", True)
        if need_weights:
            module.aegis_attention_unchecked(NEED_WEIGHTS)
        projections = module.aegis_projections
        # the attention function of this moment: a guard's router may have been installed since
        projections.namespace["scaled_dot_product_attention"] = F.scaled_dot_product_attention
        return projections.forward(*args, **kwargs)


_CHECKED_CLASSES: dict[type, type] = {}


def _forward_of(base: type) -> Callable[..., object]:
    def forward(self, *args, **kwargs):
        mode = _Mode(self)
        with mode:
            out = base.forward(self, *args, **kwargs)
        state = self.aegis_matrix
        if not state.first_call_done and mode.ran:
            state.after_first_call(self.aegis_projections)
        return out

    return forward


def checked_multihead_class(base: type) -> type:
    """`Checked<base>`: the user's class with its forward run under `_Mode` (one per class)."""
    return checked_subclass(base, _forward_of, _CHECKED_CLASSES)


def swap_multihead(
    model: nn.Module,
    chosen: list[tuple[str, nn.Module]],
    make_hooks: Callable[[str, nn.Module], LinearHooks],
    unseen: Callable[[str, str], None],
    seen: Callable[[str], None],
    attention_unchecked: Callable[[str, str], None],
) -> list[Swap]:
    """Replace each chosen module by its checked class: sites `<name>.q_proj`, `.k_proj`, `.v_proj`
    and `.out_proj` (make_hooks builds each one's sensors); `unseen`/`seen` as for matrix modules
    (integrations/matrices.py); `attention_unchecked(name, reason)` names the module's attention."""
    places = places_in(model)
    swaps: list[Swap] = []
    for name, module in chosen:
        linears = {}
        for projection in (*PROJECTIONS, "out_proj"):
            hooks = make_hooks(f"{name}.{projection}", module)
            linears[(projection, None)] = MatrixLinear(f"{name}.{projection}", projection, None, hooks,
                                                       linear_op.register(hooks))  # fmt: skip
        matrices = [(projection, None) for projection, _ in linears]
        checked, mine = stand_checked(places, name, module, checked_multihead_class(type(module)), matrices, linears,
                                      unseen, seen)  # fmt: skip
        object.__setattr__(checked, "aegis_projections", _Projections(checked, linears))
        object.__setattr__(checked, "aegis_attention_unchecked",
                           lambda reason, name=name: attention_unchecked(name, reason))  # fmt: skip
        swaps.extend(mine)
    return swaps
