"""Module swap: `nn.Linear` → `CheckedLinear`, and back.

A CheckedLinear is the same module state under another class: it shares the original's parameter,
buffer and hook dictionaries (not copies), so optimizers, state dicts, `named_parameters()` and
hooks registered by users or frameworks see no difference, and `restore` only puts the original
object back. A Linear reachable under several names (shared by two parents) is swapped under every
one of them, with the sensors of its first name.

Copies. The guard (its store, sensors, device state) is not part of the model: `copy.deepcopy`,
`pickle`/`torch.save` and `AveragedModel` of a protected model give the unprotected model — each
CheckedLinear becomes the plain `nn.Linear` it wraps, a hook the guard put on a module becomes a
no-op (`GuardHook`), a checkpoint function it rebound becomes the original again.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from aegis_sdc.ops import linear_op
from aegis_sdc.ops.checked_linear import CheckedLinearFunction, LinearHooks

LinearFilter = Callable[[str, nn.Linear], bool]


def detached_hook(*args: object, **kwargs: object) -> None:
    """What a guard's hook becomes in a copy of the model: nothing."""
    return None


def _detached() -> Callable[..., None]:
    return detached_hook


class GuardHook:
    """A hook the guard registers on a module of the model. A copy or pickle of the model holds
    `detached_hook` in its place (the guard is not copied)."""

    def __init__(self, fn: Callable[..., object]) -> None:
        self.fn = fn

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self.fn(*args, **kwargs)

    def __reduce_ex__(self, protocol: object) -> tuple:
        return (_detached, ())


class CheckedLinear(nn.Linear):
    """An `nn.Linear` whose forward, dgrad and wgrad GEMMs are checked."""

    aegis_name: str
    aegis_hooks: LinearHooks
    aegis_handle: int  # its hooks in ops/linear_op.py's registry (the compiled path)

    @classmethod
    def wrap(cls, linear: nn.Module, name: str, hooks: LinearHooks) -> CheckedLinear:
        checked = cls.__new__(cls)
        checked.__dict__.update(linear.__dict__)  # shares _parameters, _buffers, _modules, hook dicts
        object.__setattr__(checked, "aegis_name", name)
        object.__setattr__(checked, "aegis_hooks", hooks)
        object.__setattr__(checked, "aegis_handle", linear_op.register(hooks))
        return checked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return compiled_call(self.aegis_handle, x, self.weight, self.bias)
        plans = self.aegis_hooks.plans_for_call(x, self.weight)
        if plans is None:  # not sampled in this step: exactly nn.Linear
            return F.linear(x, self.weight, self.bias)
        return checked_call(self.aegis_name, self.aegis_hooks, x, self.weight, self.bias, self.weight, plans)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", checked=True"

    def __reduce_ex__(self, protocol: object) -> tuple:
        # copied or pickled as the plain module it wraps (the module docstring: copies)
        return _plain_reduce(self)


def _plain_reduce(module: nn.Module) -> tuple:
    state = {key: value for key, value in module.__dict__.items() if not key.startswith("aegis_")}
    return (object.__new__, (type(module).__mro__[1],), state)


def checked_call(name: str, hooks: LinearHooks, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 parameter: torch.Tensor, plans: tuple) -> torch.Tensor:  # fmt: skip
    """Y = X·Wᵀ + b for a planned call, W [out, in] (a Conv1D's transposed view too); `parameter`
    is the weight parameter (it keys the weight statistics when W is an autocast copy or a view)."""
    out_features, in_features = weight.shape
    _validate(name, x, weight, in_features)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise TypeError(
            f"{name}: input dtype {x.dtype} does not match weight dtype {weight.dtype}"
            + ("" if bias is None else f" / bias dtype {bias.dtype}")
            + "; cast the input or run under torch.autocast"
        )
    if x.numel() == 0 or in_features == 0 or out_features == 0:
        return F.linear(x, weight, bias)  # nothing to check: no products are summed
    x2d = x.reshape(-1, in_features)
    gap = hooks.gpu_gap(x2d, weight) or _transformed(x2d, weight)
    if gap is not None:
        hooks.uncovered(name, gap)
        return F.linear(x, weight, bias)
    # The parameter itself (detached: same storage and version counter) keys the weight-stats cache
    # when `weight` is an autocast copy.
    y = CheckedLinearFunction.apply(x2d, weight, bias, hooks, parameter.detach(), plans)
    return y.reshape(*x.shape[:-1], out_features)


# torch.func's transforms (grad, vmap, jacrev, functional_call under them) wrap their tensors; an
# autograd.Function under them needs a vmap rule and a separate setup_context, which the checked GEMMs'
# function (its backward checks dgrad and wgrad with state from the forward) does not have.
TRANSFORMED = "its calls under a torch.func transform (grad, vmap, jacrev, ...) run unchecked"


def _transformed(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return TRANSFORMED if wrapped(x) or wrapped(weight) else None


def compiled_call(handle: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Under torch.compile: one opaque custom op; the decisions are taken inside it at run time."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    y = torch.ops.aegis_sdc.linear(x.reshape(-1, weight.shape[1]), weight, bias, handle)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face's `transformers.pytorch_utils.Conv1D` (GPT-2's projections): Y = X·W + b with W
    [in, out] — a Linear with its weight transposed (matched by name: transformers is optional)."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")


# Subclasses of nn.Linear whose forward is F.linear by another name, matched by module and class name
# (transformers is optional): protected like nn.Linear. Other subclasses (quantized, LoRA) change
# what the layer computes and stay unprotected, named in the coverage report.
LINEAR_EQUIVALENT = {("transformers.models.falcon.modeling_falcon", "FalconLinear")}  # x @ W.T + b


def is_linear_equivalent(module: nn.Module) -> bool:
    cls = type(module)
    return (cls.__module__, cls.__name__) in LINEAR_EQUIVALENT


def is_parametrized_linear(module: nn.Module) -> bool:
    """An nn.Linear with a parametrization (`weight_norm`, `spectral_norm`, torch.ao pruning's masks,
    `register_parametrization`): its class is torch's `ParametrizedLinear`, whose forward is
    nn.Linear's on the weight the parametrization computes — a Linear, with a weight that is a
    function of parameters."""
    cls = type(module)
    return parametrize.is_parametrized(module) and cls.__bases__ == (nn.Linear,) and "forward" not in vars(cls)


def _parametrized_forward(self, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward on a parametrized weight, checked. The weight is computed once per call, as
    nn.Linear's forward computes it (a spectral norm's power iteration runs once per access); the
    computed tensor keys its own weight statistics (a new value per call, ops/triton_linear.py)."""
    weight = self.weight  # [out, in], the parametrization's value
    if torch.compiler.is_compiling():
        return compiled_call(self.aegis_handle, x, weight, self.bias)
    plans = self.aegis_hooks.plans_for_call(x, weight)
    if plans is None:
        return F.linear(x, weight, self.bias)
    return checked_call(self.aegis_name, self.aegis_hooks, x, weight, self.bias, weight, plans)


def _plain_deepcopy(self, memo: dict) -> nn.Module:
    """A deep copy of the plain module (a parametrized class deep-copies through its own
    `__deepcopy__`, which would copy the guard's state along)."""
    plain = object.__new__(type(self).__mro__[1])
    plain.__dict__.update({key: value for key, value in self.__dict__.items() if not key.startswith("aegis_")})
    copied = copy.deepcopy(plain, memo)
    memo[id(self)] = copied
    return copied


def checked_subclass(base: type, make_forward: Callable[[type], Callable[..., object]], cache: dict[type, type],
                     **members: object) -> type:  # fmt: skip
    """`Checked<base>`: a subclass of the user's class with the forward `make_forward(base)` makes (and
    `members`), a repr that says it is checked, and copies and pickles that are the plain module;
    one per class, kept in `cache`."""
    cls = cache.get(base)
    if cls is None:

        def extra_repr(self) -> str:
            return base.extra_repr(self) + ", checked=True"

        def reduce(self, protocol: object) -> tuple:  # copies and pickles are the user's module
            return _plain_reduce(self)

        members = {"forward": make_forward(base), "extra_repr": extra_repr, "__reduce_ex__": reduce,
                   "__module__": __name__, **members}  # fmt: skip
        if "__deepcopy__" in vars(base):  # a parametrized class's own deep copy: of the plain module
            members["__deepcopy__"] = _plain_deepcopy
        cls = cache[base] = type(f"Checked{base.__name__}", (base,), members)
    return cls


_CHECKED_SUBCLASSES: dict[type, type] = {}


def _checked_subclass(base: type, forward: Callable[..., torch.Tensor]) -> type:
    """A checked Linear class: `checked_subclass` with CheckedLinear's `wrap`."""
    wrap = classmethod(CheckedLinear.wrap.__func__)
    return checked_subclass(base, lambda base: forward, _CHECKED_SUBCLASSES, wrap=wrap)


def checked_conv1d_class(base: type) -> type:
    """The checked subclass of a Conv1D class: its GEMMs those of the Linear with W [out, in] =
    Conv1D.weightᵀ (a view: the gradient reaches the parameter through it); unsampled calls run
    Conv1D's own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t()  # [out, in]
        if torch.compiler.is_compiling():
            return compiled_call(self.aegis_handle, x, weight, self.bias)
        plans = self.aegis_hooks.plans_for_call(x, weight)
        if plans is None:
            return base.forward(self, x)
        return checked_call(self.aegis_name, self.aegis_hooks, x, weight, self.bias, self.weight, plans)

    return _checked_subclass(base, forward)


def is_protected(module: nn.Module) -> bool:
    """Whether `module` is a checked module an open guard swapped in (copies of it are plain): a
    Linear's (`aegis_hooks`) or a matrix module's (`aegis_matrix`, integrations/matrices.py)."""
    return "aegis_hooks" in vars(module) or "aegis_matrix" in vars(module)


def checked_class(module: nn.Module) -> type | None:
    """The checked class that replaces `module`, or None for a module the guard does not protect:
    nn.Linear itself, a Linear by another name (`LINEAR_EQUIVALENT`: CheckedLinear's forward on a
    subclass of its own class), a parametrized Linear and HF's Conv1D; other subclasses of nn.Linear
    (quantized, LoRA) have other semantics."""
    if type(module) is nn.Linear:
        return CheckedLinear
    if is_linear_equivalent(module):
        return _checked_subclass(type(module), CheckedLinear.forward)
    if is_hf_conv1d(module):
        return checked_conv1d_class(type(module))
    if is_parametrized_linear(module):
        return _checked_subclass(type(module), _parametrized_forward)
    return None


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
    """A checked module standing where the user's stood (a Linear, or a matrix module)."""

    parent: nn.Module
    attr: str
    original: nn.Module
    checked: nn.Module

    @property
    def in_place(self) -> bool:
        """Whether the checked module still stands where the swap put it."""
        return getattr(self.parent, self.attr, None) is self.checked


# Attributes under which wrappers hold the user's module: torch.compile's OptimizedModule (a block
# compiled on its own, as torchtitan does), torch.distributed's CheckpointWrapper
# (apply_activation_checkpointing) and FSDP1; and `module` of DDP and DataParallel. Sites are named
# without them, so a site's name does not depend on whether the model was wrapped before or after
# protect() — a fault spec, a quarantine list or a study names the same site with DDP and without.
WRAPPER_ATTRIBUTES = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
DATA_PARALLEL = (nn.parallel.DistributedDataParallel, nn.DataParallel)  # hold the model as `module`


def module_names(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """`model.named_modules()` with the wrappers' attributes left out of the names (a wrapper and the
    module it holds share a name; the root's is ""). A child named `module` is left out only under
    DDP or DataParallel (a user's own submodule may be called that)."""
    named: dict[str, tuple[str, nn.Module]] = {}  # torch's name → (ours, the module)
    for name, module in model.named_modules():
        parent, _, attr = name.rpartition(".")
        ours, holder = named.get(parent, ("", None)) if name else ("", None)
        if name and not (attr in WRAPPER_ATTRIBUTES or (attr == "module" and isinstance(holder, DATA_PARALLEL))):
            ours = f"{ours}.{attr}" if ours else attr
        named[name] = (ours, module)
        yield ours, module


def selected(name: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    """Whether GuardConfig.include/exclude keep the module of this name."""
    return any(fnmatch.fnmatchcase(name, p) for p in include) and not any(fnmatch.fnmatchcase(name, p) for p in exclude)


def select_linears(
    model: nn.Module, include: Sequence[str], exclude: Sequence[str], keep: LinearFilter | None
) -> list[tuple[str, nn.Linear]]:
    """The Linears to protect, in module order (identical on every rank)."""
    chosen = []
    for name, module in module_names(model):
        if checked_class(module) is None:
            continue
        label = name or "<root>"
        if selected(label, include, exclude) and (keep is None or keep(label, module)):
            chosen.append((label, module))
    return chosen


def places_in(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (parent, attribute) holding each module of `model`, by the module's id."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in model.modules():
        for attr, child in parent.named_children():
            places.setdefault(id(child), []).append((parent, attr))
    return places


def put_in_place(places: list[tuple[nn.Module, str]], original: nn.Module, checked: nn.Module) -> list[Swap]:
    """Stand `checked` wherever `original` stood; the swaps that undo it."""
    swaps = [Swap(parent, attr, original, checked) for parent, attr in places]
    for swap in swaps:
        setattr(swap.parent, swap.attr, checked)
    return swaps


def swap_linears(model: nn.Module, chosen: list[tuple[str, nn.Linear]], make_hooks) -> list[Swap]:
    """Replace each chosen Linear by a CheckedLinear; `make_hooks(name, linear)` builds its sensors."""
    if any(name == "<root>" for name, _ in chosen):
        raise ValueError("protect() needs a model that contains Linear layers, not a bare nn.Linear; wrap it")
    places = places_in(model)
    swaps = []
    for name, linear in chosen:
        checked = checked_class(linear).wrap(linear, name, make_hooks(name, linear))
        swaps.extend(put_in_place(places[id(linear)], linear, checked))
    return swaps


def put_back(swaps: list[Swap]) -> None:
    """Stand the user's modules again wherever their checked ones still stand."""
    for swap in reversed(swaps):
        if swap.in_place:
            setattr(swap.parent, swap.attr, swap.original)


def restore_linears(swaps: list[Swap]) -> None:
    for handle in {swap.checked.aegis_handle for swap in swaps}:
        linear_op.unregister(handle)
    put_back(swaps)
