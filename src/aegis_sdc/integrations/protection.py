"""What a guard puts into the model, and the ledger of what it cannot check.

`Protection` swaps the model's matmul modules for checked ones — Linears and Hugging Face's Conv1D
(integrations/modules.py), modules holding matrices of their own such as MoE experts and routers
(integrations/matrices.py), nn.MultiheadAttention's projections (integrations/multihead.py) — names
every other matmul module at once, and puts the user's modules back on `restore()`.

`Uncovered` is where everything that runs unchecked is named, each once and with the reason: in a
warning, in an event for the step's record (the store), and in the coverage report's `not_covered`.
Three kinds: modules (named at `protect()`, a matrix after its module's first call, or a matmul
module put into the model after `protect()`), protected Linears whose calls run unchecked (a shape
the GPU kernels cannot take, a torch.func transform), and attention modules whose calls stay
unchecked.

`LateModules` watches the model's modules for children assigned after `protect()`: Hugging Face's
`resize_token_embeddings` puts a new nn.Linear where the checked lm_head stood (untied heads), a
fine-tune swaps in a new head, `get_peft_model` wraps each Linear in an adapter layer whose factors
are new Linears. Such modules run unchecked — sites are numbered once, at `protect()` — and are
named at the assignment.
"""

from __future__ import annotations

import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

from aegis_sdc.events import AttentionKind, GemmKind
from aegis_sdc.integrations.attention import attention_outside_sdpa
from aegis_sdc.integrations.matrices import restore_matrix_modules, select_matrix_modules, swap_matrix_modules, uncalled
from aegis_sdc.integrations.modules import (
    TRANSFORMED,
    Swap,
    is_protected,
    module_names,
    restore_linears,
    swap_linears,
)
from aegis_sdc.integrations.multihead import select_multihead, swap_multihead
from aegis_sdc.ops.checked_linear import LinearHooks
from aegis_sdc.runtime.coverage import unprotected_modules

Events = list[tuple[str, str, "int | None"]]  # (kind, message, site id) for the next step's record


class Uncovered:
    """What runs unchecked and why, each named once (module docstring)."""

    def __init__(self, events: Events, site_id: Callable[[str], int], register_attention: Callable[[str], Any]) -> None:
        self.events = events
        self.site_id = site_id
        self.register_attention = register_attention  # an attention module's sites, so the store can name them
        self.modules: dict[str, str] = {}  # module (or matrix: `<module>.<parameter>`) → why it is not protected
        self.linears: dict[str, str] = {}  # protected Linear → why some of its calls run unchecked
        self.attention: dict[str, str] = {}  # attention module → why its calls run unchecked
        self._warned_transformed = False  # calls under a torch.func transform: warned of once
        self._warned_late = False  # modules put into the model after protect(): warned of once

    def name_modules(self, found: dict[str, str]) -> None:
        """The matmul modules `protect()` left out: one warning for all (the report names each)."""
        self.modules.update(found)
        if found:
            first, reason = next(iter(found.items()))
            warnings.warn(
                f"aegis-sdc: {len(found)} matmul modules not protected, e.g. {first}: {reason} "
                "(guard.coverage_report() names each)",
                stacklevel=6,
            )  # fmt: skip  (at protect())

    def linear(self, module: str, reason: str) -> None:
        """A protected Linear whose calls run unchecked — the GPU kernels cannot take them, or they run
        under a torch.func transform: named once, in a warning and the coverage."""
        if module not in self.linears:
            self.linears[module] = reason
            message = f"{module}: not checked — {reason}"
            self.events.append(("not_covered", message, self.site_id(f"{module}:fwd")))
            self._warn(message, reason)

    def matrix(self, name: str, reason: str) -> None:
        """A matrix of a protected matrix module that its first call multiplied by another kernel than
        the checked ones: named once, in a warning and the coverage, as an unprotected module is."""
        if name not in self.modules:
            self.modules[name] = reason
            self.events.append(("not_covered", f"{name}: {reason}", None))
            warnings.warn(f"aegis-sdc: {name}: {reason}", stacklevel=4)

    def late_modules(self, found: dict[str, str]) -> None:
        """Matmul modules put into the model after `protect()` (LateModules): an event each, in the
        coverage, and one warning for the guard's life (get_peft_model assigns one per layer)."""
        fresh = {name: reason for name, reason in found.items() if name not in self.modules}
        self.modules.update(fresh)
        for name, reason in fresh.items():
            self.events.append(("not_covered", f"{name}: {reason}", None))
        if fresh and not self._warned_late:
            self._warned_late = True
            name, reason = next(iter(fresh.items()))
            # stacklevel: past this method, the hook and Module.__setattr__, to the assignment
            warnings.warn(f"aegis-sdc: {name}: {reason} (guard.coverage_report() names each such module)", stacklevel=4)

    def matrix_checked(self, name: str) -> None:
        """A matrix named as not checked was checked at a later first call of its module."""
        self.modules.pop(name, None)

    def attention_module(self, module: str, reason: str, warn: bool = True) -> None:
        """An attention module of the model whose calls stay unchecked: named once, in a warning and
        the coverage (its sites are registered so the report and the store can name them)."""
        if module not in self.attention:
            self.attention[module] = reason
            self.register_attention(module)
            message = f"{module}: attention not checked — {reason}"
            self.events.append(("not_covered", message, self.site_id(f"{module}:attn_fwd")))
            if warn:
                self._warn(message, reason)

    def attention_outside_sdpa(self, model: nn.Module) -> None:
        """A Hugging Face model computing attention without SDPA: its attention modules named, with one
        warning for all (the fix is the model's, not each layer's)."""
        implementation, modules = attention_outside_sdpa(model)
        if not modules:
            return
        reason = (f"transformers' {implementation!r} attention runs without scaled_dot_product_attention "
                  "(where the model supports it, load it with attn_implementation='sdpa')")  # fmt: skip
        for module in modules:
            self.attention_module(module, reason, warn=False)
        warnings.warn(
            f"aegis-sdc: the attention of {len(modules)} modules (e.g. {modules[0]}) is not checked — {reason}",
            stacklevel=5,
        )  # fmt: skip  (the user's protect() call)

    def not_covered(self) -> dict[str, str]:
        """Modules and sites → why, for the coverage report."""
        named = dict(self.modules)
        for module, reason in self.linears.items():
            named.update({f"{module}:{kind.value}": reason for kind in GemmKind})
        for module, reason in self.attention.items():
            named.update({f"{module}:{kind.value}": reason for kind in AttentionKind})
        return named

    def _warn(self, message: str, reason: str) -> None:
        """Warn of an unchecked module; a transform's calls reach every module at once: one warning."""
        if reason == TRANSFORMED:
            if self._warned_transformed:
                return
            self._warned_transformed = True
            message += " (every module so called is named in guard.coverage_report())"
        warnings.warn(f"aegis-sdc: {message}", stacklevel=5)


class Protection:
    """The model's matmul modules swapped for checked ones (module docstring); `restore()` undoes it."""

    def __init__(
        self,
        model: nn.Module,
        linears: Sequence[tuple[str, nn.Module]],
        include: Sequence[str],
        exclude: Sequence[str],
        make_hooks: Callable[[str, nn.Module], LinearHooks],
        uncovered: Uncovered,
    ) -> None:
        self.linear_swaps: list[Swap] = []
        self.matrix_swaps: list[Swap] = []
        self.late: LateModules | None = None
        try:
            self.linear_swaps = swap_linears(model, list(linears), make_hooks)
            # MoE experts and routers: matrix parameters multiplied by F.linear (integrations/matrices.py)
            self.matrix_swaps = swap_matrix_modules(model, select_matrix_modules(model, include, exclude), make_hooks,
                                                    uncovered.matrix, uncovered.matrix_checked)  # fmt: skip
            # nn.MultiheadAttention's projections, F.linear calls inside F.multi_head_attention_forward
            # (integrations/multihead.py); its out_proj child is checked through it
            multihead = swap_multihead(model, select_multihead(model, include, exclude), make_hooks, uncovered.matrix,
                                       uncovered.matrix_checked, uncovered.attention_module)  # fmt: skip
            self.matrix_swaps += multihead
            protected = {id(swap.checked) for swap in [*self.linear_swaps, *self.matrix_swaps]}
            protected |= {id(swap.checked.out_proj) for swap in multihead}
            # named at once: nothing matmul-bearing is left out silently
            uncovered.name_modules(unprotected_modules(module_names(model), protected))
            # and what is put into the model from here on, named when it is
            swaps = [*self.linear_swaps, *self.matrix_swaps]
            ours = protected | {id(swap.original) for swap in swaps}  # (matrix modules are handed back)
            self.late = LateModules(model, ours, uncovered.late_modules)
        except BaseException:
            self.restore()  # a protect() that fails part way leaves the model as it was
            raise

    def counts(self) -> dict[str, int]:
        """Protected modules by the user's class name (a matrix module handed back, or a module
        replaced after protect(), is not counted)."""
        standing = [s for s in [*self.linear_swaps, *self.matrix_swaps] if s.in_place]
        originals = {id(s.checked): s.original for s in standing}.values()  # (a module standing under two names: once)
        return dict(Counter(type(original).__name__ for original in originals))

    def name_uncalled(self) -> None:
        """After the first step: the matrices of modules whose forward never ran are named."""
        uncalled(self.matrix_swaps)

    def restore(self) -> None:
        """The user's modules back in the model."""
        if self.late is not None:
            self.late.remove()  # first: putting the user's modules back is no late assignment
        restore_linears(self.linear_swaps)
        restore_matrix_modules(self.matrix_swaps)


LATE = ("put into the model after protect(): not checked (change the model's modules — "
        "resize_token_embeddings, a new head, get_peft_model — before protect(), or close the guard and "
        "protect the model again)")  # fmt: skip


class LateModules:
    """Children assigned to the model's modules after `protect()` (module docstring): the matmul
    modules among them are named through `name_found` at the assignment. A hook common to all
    modules (torch's module registration hook: every `parent.attr = child`, `add_module`, ModuleList
    and ModuleDict assignment) that looks the parent up among the model's modules — a dictionary
    lookup, at assignments only; nothing on the training path. Writes into a container's `_modules`
    that bypass `register_module` (`ModuleList.insert`) are not seen."""

    def __init__(self, model: nn.Module, ours: set[int], name_found: Callable[[dict[str, str]], None]) -> None:
        self._ours = ours  # ids of the checked modules and the user's modules they stand for
        self._name_found = name_found
        # the model's modules → their names; weak, so a module dropped from the model is forgotten
        # (and an id reused by a new object is never taken for it)
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        for name, module in module_names(model):  # (torch's own named_modules needs modules hashable)
            self._names.setdefault(module, name)
        self._handle = register_module_module_registration_hook(self._assigned)

    def remove(self) -> None:
        self._handle.remove()

    def _assigned(self, parent: nn.Module, attr: str, child: nn.Module | None) -> None:
        if torch.compiler.is_compiling():
            # A compiled forward's assignments are temporaries (HF slices its ModuleList of layers on
            # every forward: a new list, its children added to it). Traced, the lookup below would
            # hand Dynamo a global path to this model's modules through this hook, and the graph's
            # guards would check those — always the first protected model's — instead of the
            # compiled model's own: a second protected model ran the first one's graph, its checks
            # reported to the first guard (found with two compiled models in one process).
            return
        prefix = self._names.get(parent)
        if prefix is None or child is None or id(child) in self._ours or is_protected(child):
            return  # not the model's, a removal, or a module of the guard's (a swap, a hand-back)
        base = f"{prefix}.{attr}" if prefix else attr
        # what the model held already (a wrapper around its layers) was named at protect()
        new = [(f"{base}.{name}" if name else base, module) for name, module in module_names(child)
               if module not in self._names]  # fmt: skip
        for name, module in new:
            self._names[module] = name  # assignments inside the new modules are seen too
        kinds = {name: type(module).__name__ for name, module in new}
        found = unprotected_modules(new, self._ours)
        if found:
            self._name_found({name: f"{kinds[name]} {LATE}" for name in found})
