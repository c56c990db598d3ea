"""The coverage report: what a guard protects, what share of the model's matmul FLOPs it checks, and
what it leaves uncovered and why.

Two parts. At `protect()` the model's modules are read: the protected ones counted by type, and every
other module that does matmul work named with the reason (`unprotected_modules`) — a subclass of
`nn.Linear` (quantized, LoRA: other semantics), a subclass of `nn.MultiheadAttention` with a forward
of its own, `nn.Bilinear`, convolutions, recurrent layers, a Linear or attention module left out by
`include`/`exclude`/`filter`, a PEFT adapter layer whose adapters multiply by matrices outside
nn.Linear (VeRA, LoHa, LoKr, AdaLoRA, BOFT), and a module holding matrix parameters of its own that `include`/
`exclude` left out or whose parameters PEFT's LoRA wraps (the others are protected,
integrations/matrices.py, which names a matrix no checked op multiplied by after the module's first
call). After a step has run, the FLOPs are known from the
calls themselves: per step, each GEMM site's 2·M·N·K times its calls and each attention module's
FLOPs (forward and backward); the checked share is what the step's sampling actually checked, of
the protected modules' FLOPs (the unprotected modules' are not known: the report says how many
there are). `Guard.coverage_report()` builds it; the guard logs it once, after the first step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize


@dataclass(frozen=True)
class CoverageReport:
    protected: dict[str, int]  # module type → protected modules
    gemm_flops: float  # per step: the protected modules' GEMMs (forward, dgrad, wgrad), last step
    attention_flops: float  # per step: the attention calls the checked op took, last step
    checked_flops: float  # per step: what that step checked of the two
    not_covered: dict[str, str] = field(default_factory=dict)  # module or site → why

    @property
    def checked_share(self) -> float:
        total = self.gemm_flops + self.attention_flops
        return self.checked_flops / total if total else 0.0

    def describe(self) -> str:
        """A few lines for a log: counts, FLOPs, checked share, what is not covered."""
        modules = ", ".join(f"{count} {kind}" for kind, count in sorted(self.protected.items()))
        lines = [f"protected: {modules or 'nothing'}"]
        if self.gemm_flops or self.attention_flops:
            unprotected = sum(":" not in name for name in self.not_covered)  # modules, not sites
            of_what = f" (not counting {unprotected} unprotected modules)" if unprotected else ""
            lines.append(
                f"matmul FLOPs per step: {self.gemm_flops:.3g} in GEMMs, {self.attention_flops:.3g} in attention; "
                f"{self.checked_share:.1%} of them checked in the last step{of_what}"
            )
        for name, reason in sorted(self.not_covered.items()):
            lines.append(f"not covered: {name} — {reason}")
        return "\n".join(lines)


def parameter_wrapped(modules: Iterable[tuple[str, nn.Module]]) -> set[int]:
    """Ids of the modules whose parameters PEFT's LoRA wraps (`LoraConfig(target_parameters=...)`, a
    MoE layer's expert tensors): its `ParamWrapper` registers W + B·A as a parametrization of the
    module for each call and removes it after, changing the module's class both times — a module
    swapped for a checked one would break that, and the weight its kernels multiply by is no
    parameter of its own then."""
    wrapped = set()
    for _, module in modules:
        base = module
        while type(base).__name__ == "ParamWrapper" and isinstance(getattr(base, "base_layer", None), nn.Module):
            base = base.base_layer
        if base is not module:
            wrapped.add(id(base))
    return wrapped


def unprotected_modules(modules: Iterable[tuple[str, nn.Module]], protected: set[int]) -> dict[str, str]:
    """The modules (a model's (name, module) pairs) that do matmul work and are not among `protected`
    (ids), with why."""
    modules = list(modules)
    found: dict[str, str] = {}
    wrapped = parameter_wrapped(modules)
    adapters = {id(m): _adapter_matrices(m) for _, m in modules if _is_peft_tuner_layer(m)}
    # a tuner layer's adapter dictionaries are named with the layer, not one by one
    in_adapters = {id(d) for _, m in modules if id(m) in adapters for _, d in _adapter_dicts(m)}
    # an attention module's out_proj is multiplied by inside it, its own forward never runs: named
    # with the attention module, not as a Linear of its own
    inside = {id(m.out_proj) for _, m in modules if isinstance(m, nn.MultiheadAttention)}
    for name, module in modules:
        if id(module) in protected or id(module) in inside or id(module) in in_adapters:
            continue
        label = name or "<root>"
        kind = type(module).__name__
        if adapters.get(id(module)):
            reason = (f"{kind}, a PEFT adapter layer whose adapter multiplies by matrices outside nn.Linear "
                      f"({adapters[id(module)]}): not checked (its base layer is)")  # fmt: skip
        elif isinstance(module, nn.Linear):
            reason = (
                "an nn.Linear left out by GuardConfig.include/exclude or the filter"
                if type(module) is nn.Linear
                else f"{kind}, a subclass of nn.Linear (other semantics: not checked)"
            )
        elif isinstance(module, nn.MultiheadAttention):
            reason = (
                f"{kind}, a subclass of nn.MultiheadAttention with a forward of its own (not checked)"
                if type(module).forward is not nn.MultiheadAttention.forward
                else "an nn.MultiheadAttention left out by GuardConfig.include/exclude"
            )
        elif isinstance(module, nn.Bilinear):
            reason = "nn.Bilinear (not checked)"
        elif isinstance(module, nn.modules.conv._ConvNd):
            reason = f"{kind}, a convolution (not checked)"
        elif isinstance(module, (nn.RNNBase, nn.RNNCellBase)):
            reason = f"{kind}, a recurrent layer (its matrices run inside torch's fused RNN kernels: not checked)"
        elif kind == "Conv1D" and type(module).__module__.startswith("transformers."):
            reason = "Hugging Face Conv1D left out by GuardConfig.include/exclude or the filter"
        elif isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            continue  # a lookup, not a matmul (a tied output head is an nn.Linear of its own)
        elif isinstance(module, parametrize.ParametrizationList):
            continue  # the inputs of a parametrized weight: its owner module is what multiplies
        elif id(module) in wrapped and (matrices := _matrix_parameters(module)):
            reason = (f"{kind} with LoRA on its parameters ({matrices}; peft's target_parameters): W + B·A is "
                      "computed at each call and multiplied by the module's own kernels (not checked)")  # fmt: skip
        elif matrices := _matrix_parameters(module):
            # a module with matrices of its own (MoE experts and routers) that GuardConfig.include/
            # exclude left out, or the root model's own (integrations/matrices.py protects the others)
            reason = f"{kind} holds matrix parameters ({matrices}) that no checked op multiplies by"
        else:
            continue
        found[label] = reason
    return found


def _is_peft_tuner_layer(module: nn.Module) -> bool:
    """A PEFT tuner layer (LoRA, VeRA, LoHa, OFT, ...): a base layer and its adapters' tensors."""
    return type(module).__module__.startswith("peft.") and isinstance(getattr(module, "adapter_layer_names", None),
                                                                       tuple)  # fmt: skip


def _adapter_dicts(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """A tuner layer's dictionaries of adapter tensors (ParameterDict, BufferDict), each adapter's by
    name, with their attributes; its dictionaries of modules (LoRA's nn.Linear factors) are
    protected or named on their own."""
    names = (*module.adapter_layer_names, *getattr(module, "other_param_names", ()))
    found = []
    for attr in dict.fromkeys(names):
        value = getattr(module, attr, None)
        if isinstance(value, nn.Module) and not isinstance(value, nn.ModuleDict) and hasattr(value, "items"):
            found.append((attr, value))
    return found


def _adapter_matrices(module: nn.Module) -> str:
    """The matrices of a tuner layer's adapters (two or more dimensions above 1: not IA³'s scales
    [out, 1]), as 'attribute[adapter] [shape]'."""
    return ", ".join(
        f"{attr}[{adapter}] {list(tensor.shape)}"
        for attr, tensors in _adapter_dicts(module)
        for adapter, tensor in tensors.items()
        if isinstance(tensor, torch.Tensor) and sum(size > 1 for size in tensor.shape) >= 2
    )


def _matrix_parameters(module: nn.Module) -> str:
    """The module's own parameters of two or more dimensions, as 'name [shape]' (not its children's);
    a leading dimension of 1 marks a tensor added by broadcasting (a class token, a position table
    [1, T, D]), not a matrix, a last one of 1 a column of scales (IA³'s [out, 1]), and a bias is added
    (a relative position bias table, an expert's biases), as integrations/matrices.py has it."""
    params = module.named_parameters(recurse=False)
    return ", ".join(
        f"{name} {list(p.shape)}"
        for name, p in params
        if p.dim() >= 2 and p.shape[0] > 1 and p.shape[-1] > 1 and "bias" not in name
    )
