"""Matrix parameters outside nn.Linear: mixture-of-experts weights and routers, checked as Linears.

Transformers 5 keeps a MoE layer's experts as 3-D parameters — `gate_up_proj` [experts, 2·I, H] and
`down_proj` [experts, H, I] (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek, ...) — and runs them as one
grouped GEMM over the tokens sorted by expert (`torch._grouped_mm`, the default) or as a loop of
`F.linear(x_e, gate_up_proj[e])` (`experts_implementation="eager"`); its router is
`F.linear(x, weight)` on a 2-D parameter of its own. None of them is an nn.Linear the module swap can
take, yet the experts are most of such a model's matmul FLOPs.

A module holding matrix parameters of its own (2-D, or 3-D [experts, out, in]; not a Linear,
convolution, embedding or attention module, which have their own handling) is swapped for a
checked subclass of its class (the Linear swap's way: same parameter, buffer and hook dictionaries,
copies and pickles are the plain module) whose forward runs the original one under a
`TorchFunctionMode`. Each `F.linear` whose weight is one of the module's 2-D parameters or a slice
`p[e]` of a 3-D one, each `x @ w` on such a matrix ([in, out]: the Linear of wᵀ), and each grouped
GEMM over a 3-D one (split by expert on its rows) runs as the checked Linear of that matrix — its
own forward, dgrad and wgrad sites, named `<module>.<e>.<parameter>` for an expert
(`model.layers.0.mlp.experts.3.gate_up_proj`) and `<module>` for a module's only matrix `weight` (a
router), else `<module>.<parameter>`. The gradient reaches the parameter through the slice, as it
does unprotected. Every other op of the forward runs as it would.

What the mode cannot check stays named, never silently skipped. In the module's first call the mode
follows each matrix the checked ops did not take, through the ops that derive tensors from it alone
(a view, a cast, `exp`), to where it meets the call's data (the forward's inputs, tensors that
require grad): a matrix that reaches another contraction there (an einsum, a bmm, a convolution) is
named with that op; one that no op let meet the data (a custom kernel, another module's forward) is
named too; one met only elementwise or as a lookup (a position table added to the input, Mamba's
`A_log` in its discretization, a table gathered by index) is no matmul weight and is not. On a GPU a
grouped GEMM (split by expert, it needs the routing on the host: a device sync per call) is named.
Names go to a warning and the coverage report; a module none of whose matrices was checked is
handed back to the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from aegis_sdc.integrations.modules import (
    Swap,
    checked_call,
    checked_class,
    checked_subclass,
    compiled_call,
    is_protected,
    module_names,
    places_in,
    put_back,
    put_in_place,
    selected,
)
from aegis_sdc.ops import linear_op
from aegis_sdc.ops.checked_linear import LinearHooks
from aegis_sdc.runtime.coverage import parameter_wrapped

# Modules whose matrices other code handles or names: the Linear swap, attention routing, lookups,
# recurrent layers (torch's fused RNN kernels: named at protect(), runtime/coverage.py); and a
# parametrization's list, whose tensors are the inputs of a computed weight (weight_norm's direction,
# a spectral norm's original), multiplied by its owner (a parametrized Linear is protected).
OWN_HANDLING = (nn.Linear, nn.MultiheadAttention, nn.Bilinear, nn.modules.conv._ConvNd, nn.Embedding,
                nn.EmbeddingBag, nn.RNNBase, nn.RNNCellBase, parametrize.ParametrizationList)  # fmt: skip


@dataclass(frozen=True)
class MatrixLinear:
    """One matrix of a module as a Linear: W [out, in] = the parameter, or the slice p[expert]."""

    name: str  # the sites' module name
    parameter: str
    expert: int | None  # the slice of a 3-D parameter, None for a 2-D one
    hooks: LinearHooks
    handle: int  # its hooks in ops/linear_op.py's registry (the compiled path)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return compiled_call(self.handle, x, weight, bias)
        return self.run(x, weight, bias, self.hooks.plans_for_call(x, weight))

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plans: tuple | None
            ) -> torch.Tensor:  # fmt: skip
        """This call as planned: checked, or (plans None) exactly the module's own F.linear."""
        if plans is None:
            return F.linear(x, weight, bias)
        return checked_call(self.name, self.hooks, x, weight, bias, weight, plans)


def matrix_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The module's own parameters a Linear could multiply by: 2-D [out, in] and 3-D [experts, out,
    in] (a leading dimension of 1 marks a tensor added by broadcasting, not a matrix, and a last one
    of 1 a column of scales [out, 1] multiplied elementwise (IA³'s); the experts' biases [experts,
    out] are added, named as biases are; runtime/coverage.py judges alike)."""
    return [(name, p) for name, p in module.named_parameters(recurse=False)
            if p.dim() in (2, 3) and p.shape[0] > 1 and p.shape[-1] > 1 and "bias" not in name]  # fmt: skip


def select_matrix_modules(
    model: nn.Module, include: Sequence[str], exclude: Sequence[str]
) -> list[tuple[str, nn.Module]]:
    """The modules with matrix parameters of their own to protect, in module order (identical on
    every rank); GuardConfig.include/exclude select them by name as they select Linears."""
    chosen = []
    modules = list(module_names(model))
    wrapped = parameter_wrapped(modules)  # LoRA on its parameters: named by runtime/coverage.py
    for name, module in modules:
        if not name or isinstance(module, OWN_HANDLING) or checked_class(module) is not None or is_protected(module):
            continue
        if id(module) in wrapped:
            continue
        if type(module).__name__ == "Conv1D" or not matrix_parameters(module):
            continue  # (a Conv1D left out by include/exclude is named as such: runtime/coverage.py)
        if type(module).forward is nn.Module.forward:
            continue  # never called (nn.ParameterList / ParameterDict): its matrices are named as unprotected
        if selected(name, include, exclude):
            chosen.append((name, module))
    return chosen


def _linear_names(name: str, parameters: list[tuple[str, nn.Parameter]]) -> list[tuple[str, str, int | None]]:
    """(site module name, parameter, expert) for every matrix of a module (the module docstring)."""
    alone = len(parameters) == 1 and parameters[0][0] == "weight" and parameters[0][1].dim() == 2
    names = []
    for pname, p in parameters:
        if p.dim() == 2:
            names.append((name if alone else f"{name}.{pname}", pname, None))
        else:
            names.extend((f"{name}.{e}.{pname}", pname, e) for e in range(p.shape[0]))
    return names


class _LinearsOf(TorchFunctionMode):
    """During one forward of a checked matrix module: F.linear on its matrices, and grouped GEMMs over
    its experts, run checked (the mode is off inside its own handler: the checked op's own calls pass)."""

    def __init__(self, module: nn.Module, uses: MatrixUses | None = None) -> None:
        super().__init__()
        self.module = module
        self.seen: set[str] = set()  # parameters some F.linear or grouped GEMM multiplied by
        self.on_device: set[str] = set()  # of those, by grouped GEMMs left unchecked (CUDA)
        self.uses = uses  # the first call only: what every other op did with the matrices

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self._checked(func, args, kwargs)
        if out is NotImplemented:
            if self.uses is None:
                return func(*args, **kwargs)
            inputs = self.uses.inputs(args, kwargs)  # before the op: an in-place one changes them
            out = func(*args, **kwargs)
            self.uses.record(func, inputs, args, out)
        return out

    def _checked(self, func, args: tuple, kwargs: dict):
        """The call as the checked op of one of the module's matrices, or NotImplemented."""
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            linear = _linear_for(self.module, weight)
            if linear is not None:
                self.seen.add(linear.parameter)
                return linear(x, weight, bias)
        elif func in MATMULS and len(args) == 2 and not kwargs:
            # x @ W with W [in, out] one of the module's matrices or a slice p[e] of one (GPT-OSS's
            # eager experts): the Linear of weight Wᵀ, a view the gradient reaches W through
            linear = _linear_for(self.module, args[1])
            if linear is not None and args[0].dim() >= 1:
                self.seen.add(linear.parameter)
                return linear(args[0], args[1].t(), None)
        elif _is_grouped_mm(func) and 2 <= len(args) <= 3:
            offs = args[2] if len(args) == 3 else kwargs.get("offs")
            out = self._grouped(args[0], args[1], offs, kwargs)
            if out is not None:
                return out
        return NotImplemented

    def _grouped(self, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor | None, kwargs: dict
                 ) -> torch.Tensor | None:  # fmt: skip
        """`grouped_mm(x [S, in], W [experts, in, out], offs)` over one of the module's expert
        parameters as each expert's checked Linear on its rows (offs: the cumulative row ends; rows
        past the last are zero), or None to run it as it is."""
        extra = {k: v for k, v in kwargs.items() if k not in ("offs", "out_dtype")}  # a bias: not taken
        target = _grouped_target(self.module, weight)
        if target is None or offs is None or any(v is not None for v in extra.values()) or x.dim() != 2:
            return None
        pname, stored_in_out = target
        self.seen.add(pname)
        if x.device.type != "cpu":
            # Splitting the rows by expert needs the routing on the host: a device sync per call,
            # which the hot path does not take. Named once (the forward below).
            self.on_device.add(pname)
            return None
        param, linears = self.module._parameters[pname], self.module.aegis_matrix.linears
        compiling = torch.compiler.is_compiling()
        pieces, start = [], 0  # (expert's Linear, its rows, its W [out, in], its plans) of experts with rows
        for expert, end in enumerate(offs.tolist()):
            if end > start:
                linear, rows = linears[(pname, expert)], x[start:end]
                w = param[expert].t() if stored_in_out else param[expert]
                pieces.append((linear, rows, w, None if compiling else linear.hooks.plans_for_call(rows, w)))
            start = end
        if not compiling and all(plans is None for *_, plans in pieces):
            return None  # no expert sampled in this call: the grouped GEMM itself, one launch
        outs = [linear(rows, w, None) if compiling else linear.run(rows, w, None, plans)
                for linear, rows, w, plans in pieces]  # fmt: skip
        outs.append(x.new_zeros(x.shape[0] - start, weight.shape[-1]))  # rows past the last end: zero
        out = torch.cat(outs)
        return out if kwargs.get("out_dtype") is None else out.to(kwargs["out_dtype"])


def _is_grouped_mm(func: object) -> bool:
    """torch._grouped_mm (what F.grouped_mm calls) or transformers' fallback op of it."""
    return func is getattr(torch, "_grouped_mm", None) or str(func) in (
        "transformers.grouped_mm_fallback",
        "transformers.grouped_mm_fallback.default",
    )


def _grouped_target(module: nn.Module, weight: torch.Tensor) -> tuple[str, bool] | None:
    """(parameter, stored [experts, in, out]) when a grouped GEMM's W [experts, in, out] is one of the
    module's 3-D parameters: the parameter itself (stored so), or its transpose p.transpose(-2, -1)
    (stored [experts, out, in], the Linear's layout)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        return None
    base = weight if weight._base is None else weight._base
    for pname, experts in module.aegis_matrix.matrices:
        param = module._parameters.get(pname)
        if experts is None or param is None or base is not param:
            continue
        if weight is param:
            return pname, True
        swapped = param.transpose(-2, -1)
        if (weight.shape, weight.stride(), weight.storage_offset()) == (swapped.shape, swapped.stride(),
                                                                        swapped.storage_offset()):  # fmt: skip
            return pname, False
    return None


MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)  # `x @ w` arrives as Tensor.matmul


def _linear_for(module: nn.Module, weight: torch.Tensor) -> MatrixLinear | None:
    """The matrix `weight` is: one of the module's 2-D parameters, or a whole slice p[e] of a 3-D one
    (as F.linear's weight [out, in] or a matmul's right operand [in, out] alike)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    base = weight if weight._base is None else weight._base
    state = module.aegis_matrix
    for pname, experts in state.matrices:
        param = module._parameters.get(pname)  # looked up by name: a parameter replaced since stays covered
        if param is None or base is not param:
            continue
        if experts is None:
            return state.linears[(pname, None)] if weight is param else None
        if weight.shape == param.shape[1:] and weight.stride() == param.stride()[1:]:
            expert, rest = divmod(weight.storage_offset() - param.storage_offset(), param.stride(0))
            if rest == 0 and 0 <= expert < param.shape[0]:
                return state.linears[(pname, expert)]
    return None


# Ops that multiply their operands as matrices (by name: torch.x, Tensor.x, F.x alike)
CONTRACTIONS = frozenset({
    "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "mv", "addmm", "addmm_", "baddbmm", "baddbmm_", "addbmm",
    "addmv", "einsum", "tensordot", "inner", "multi_dot", "chain_matmul", "linear", "bilinear", "conv1d", "conv2d",
    "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "scaled_dot_product_attention",
    "_grouped_mm", "grouped_mm",
})  # fmt: skip


class MatrixUses:
    """What a module's first call did with its matrices outside the checked ops (the module
    docstring): tensors derived from matrices alone are followed op by op (weakly held: the call's
    temporaries die as they would); an op that mixes one with the call's data — its inputs, a tensor
    that requires grad and is no matrix-derived one — is where the matrix is used: `contracted` by a
    contraction, `elementwise` by any other op."""

    def __init__(self) -> None:
        self.derived = WeakIdKeyDictionary()  # tensor of the weights' side → the matrices it derives from
        self.data = WeakIdKeyDictionary()  # tensor → True: the call's data
        self.contracted: dict[str, str] = {}  # matrix → the first contraction that multiplied it
        self.elementwise: set[str] = set()

    @classmethod
    def following(cls, module: nn.Module, inputs: tuple) -> MatrixUses:
        """The uses of `module`'s matrices, to follow through a call on `inputs`. The module's other
        parameters and buffers are on the weights' side too (no matrix of their own): a matrix scaled
        by a learned vector is still a weight."""
        uses = cls()
        matrices = {pname for pname, _ in module.aegis_matrix.matrices}
        for pname, p in module.named_parameters(recurse=False):
            uses.derived[p] = frozenset({pname} & matrices)
        for b in module.buffers(recurse=False):
            uses.derived[b] = frozenset()
        for t in _tensors(inputs):
            uses.data[t] = True
        return uses

    def inputs(self, args: tuple, kwargs: dict) -> tuple[set[str], bool, bool]:
        """An op's inputs: (the matrices they derive from, whether any is on the weights' side,
        whether any is the call's data)."""
        sources, weights, mixed = set(), False, False
        for t in _tensors((args, kwargs)):
            if t in self.derived:
                sources |= self.derived[t]
                weights = True
            elif t in self.data or t.requires_grad:
                mixed = True
        return sources, weights, mixed

    def record(self, func, inputs: tuple[set[str], bool, bool], args: tuple, out: object) -> None:
        """An op's result, given its `inputs` (taken before it ran)."""
        sources, weights, mixed = inputs
        outputs = _tensors(out)
        if _in_place(func) and args and isinstance(args[0], torch.Tensor):
            outputs.append(args[0])  # what it wrote into: `skew[:, i, j] = w` makes `skew` the weights'
        if weights and not mixed:  # still the weights alone: a view, a cast, exp(A_log), w·g
            for t in outputs:
                self.derived[t] = frozenset(sources)
            return
        if sources:  # a matrix meets the call's data here
            name = getattr(func, "__name__", "").split(".")[0]  # (an aten overload: "mm.default")
            if name in CONTRACTIONS:
                for pname in sources:
                    self.contracted.setdefault(pname, f"torch.{name.strip('_')}")
            else:
                self.elementwise |= sources
        if mixed:  # the data carried on (also where it no longer requires grad)
            for t in outputs:
                self.data[t] = True


def _in_place(func: object) -> bool:
    """An op that writes into its first argument: `add_`, `x[i] = v`, `x += v`."""
    name = getattr(func, "__name__", "")
    return (
        name == "__setitem__"
        or (name.startswith("__i") and name.endswith("__"))
        or (name.endswith("_") and not name.startswith("_"))
    )


def _tensors(value: object) -> list[torch.Tensor]:
    """The tensors in an op's arguments or result (nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


@dataclass
class MatrixState:
    """What a checked matrix module carries (its `aegis_matrix` attribute)."""

    name: str
    kind: str  # the user's class name
    matrices: list[tuple[str, int | None]]  # (parameter, experts of a 3-D one, None for 2-D)
    linears: dict[tuple[str, int | None], MatrixLinear]
    unseen: Callable[[str, str], None]  # names a matrix no checked op multiplied by
    seen: Callable[[str], None]  # takes back a name `unseen` gave (checked at last: see `uncalled`)
    release: Callable[[], None]  # puts the user's module back in the model
    first_call_done: bool = False

    def after_first_call(self, mode: _LinearsOf) -> None:
        """Name each matrix the first call did not check, unless it was used only elementwise (no
        matmul weight); with none checked at all, give the model its own module back (the mode would
        cost every later call Python work for nothing)."""
        self.first_call_done = True
        checked = mode.seen - mode.on_device
        # (no uses followed: a mode that takes every matrix it is given, multihead.py's projections)
        contracted, elementwise = (mode.uses.contracted, mode.uses.elementwise) if mode.uses else ({}, set())
        for pname, _ in self.matrices:
            elementwise_only = pname in elementwise and pname not in contracted
            if pname in checked or (elementwise_only and pname not in mode.on_device):
                self.seen(f"{self.name}.{pname}")
            else:
                reason = _unseen_reason(self.kind, pname, pname in mode.on_device, contracted.get(pname))
                self.unseen(f"{self.name}.{pname}", reason)
        if not checked:
            self.release()


_CHECKED_CLASSES: dict[type, type] = {}


def _forward_of(base: type) -> Callable[..., object]:
    def forward(self, *args, **kwargs):
        if not self.aegis_matrix.first_call_done and any(t.numel() for t in _tensors((args, kwargs))):
            return _first_forward(self, base, args, kwargs)
        with _LinearsOf(self):
            return base.forward(self, *args, **kwargs)

    return forward


@torch.compiler.disable
def _first_forward(module: nn.Module, base: type, args: tuple, kwargs: dict) -> object:
    """The module's first call with data, eager even in a compiled model (the uses are followed in
    Python, op by op), then its matrices named or handed back: `MatrixState.after_first_call`."""
    mode = _LinearsOf(module, MatrixUses.following(module, (args, kwargs)))
    with mode:
        out = base.forward(module, *args, **kwargs)
    module.aegis_matrix.after_first_call(mode)
    return out


def checked_matrix_class(base: type) -> type:
    """`Checked<base>`: the user's class with its forward run under `_LinearsOf` (one per class)."""
    return checked_subclass(base, _forward_of, _CHECKED_CLASSES)


def swap_matrix_modules(
    model: nn.Module,
    chosen: list[tuple[str, nn.Module]],
    make_hooks: Callable[[str, nn.Module], LinearHooks],
    unseen: Callable[[str, str], None],
    seen: Callable[[str], None],
) -> list[Swap]:
    """Replace each chosen module by its checked class; `make_hooks(name, module)` builds the sensors of
    each of its matrices, `unseen(name, reason)` names a matrix its first call did not check (or
    that no call reached in the first step: `uncalled`), `seen(name)` takes such a name back."""
    places = places_in(model)
    swaps: list[Swap] = []
    for name, module in chosen:
        parameters = matrix_parameters(module)
        linears = {}
        for site_name, pname, expert in _linear_names(name, parameters):
            hooks = make_hooks(site_name, module)
            linears[(pname, expert)] = MatrixLinear(site_name, pname, expert, hooks, linear_op.register(hooks))
        matrices = [(pname, None if p.dim() == 2 else p.shape[0]) for pname, p in parameters]
        _, mine = stand_checked(places, name, module, checked_matrix_class(type(module)), matrices, linears, unseen,
                                seen)  # fmt: skip
        swaps.extend(mine)
    return swaps


def stand_checked(
    places: dict[int, list[tuple[nn.Module, str]]], name: str, module: nn.Module, cls: type,
    matrices: list[tuple[str, int | None]], linears: dict, unseen: Callable[[str, str], None],
    seen: Callable[[str], None],
) -> tuple[nn.Module, list[Swap]]:  # fmt: skip
    """Stand an instance of the checked class `cls` sharing `module`'s state, with its `MatrixState`,
    wherever `module` stands: (the checked module, the swaps that undo it)."""
    checked = cls.__new__(cls)
    checked.__dict__.update(module.__dict__)  # shares _parameters, _buffers, _modules, hook dicts
    mine: list[Swap] = []  # filled below: the release undoes exactly these
    state = MatrixState(name, type(module).__name__, matrices, linears, unseen, seen,
                        lambda: restore_matrix_modules(mine))  # fmt: skip
    object.__setattr__(checked, "aegis_matrix", state)  # (also what marks it protected: is_protected)
    mine.extend(put_in_place(places.get(id(module), []), module, checked))
    return checked, mine


def _unseen_reason(kind: str, pname: str, grouped_on_device: bool, contraction: str | None) -> str:
    if grouped_on_device:
        return (
            f"{kind}.{pname}: its experts run as one grouped GEMM on the GPU, which is not checked (checking "
            "them expert by expert needs the routing on the host; experts_implementation='eager' is checked)"
        )
    if contraction is not None:
        return (f"{kind}.{pname}: multiplied by {contraction} in the module's first call, an op the guard does "
                "not check (F.linear, `@`, grouped GEMMs on the matrix itself are): not checked")  # fmt: skip
    return (f"{kind}.{pname}: no op of the module's first call multiplied its input by it (another kernel, a "
            "custom op, another module's forward): not checked")  # fmt: skip


def uncalled(swaps: list[Swap]) -> None:
    """After the first step: name the matrices of every checked module whose forward has not run — a
    parent that multiplies by a child's parameter itself (`F.linear(x, self.child.w)`) goes past the
    child's forward, and so past the mode. Named, not handed back: a first call later still checks
    and takes the names back."""
    for swap in swaps:
        state = swap.checked.aegis_matrix
        if swap.in_place and not state.first_call_done:
            for pname, _ in state.matrices:
                state.unseen(f"{state.name}.{pname}", f"{state.kind}.{pname}: its module's forward did not run in "
                             "the first step (a matrix another module multiplies by is not checked)")  # fmt: skip


def restore_matrix_modules(swaps: list[Swap]) -> None:
    """Put the user's modules back (those still in place; their Linears' handles unregistered)."""
    for checked in {id(s.checked): s.checked for s in swaps if s.in_place}.values():
        for linear in checked.aegis_matrix.linears.values():
            linear_op.unregister(linear.handle)
    put_back(swaps)
