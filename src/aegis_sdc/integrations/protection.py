"""What a guard puts into the model, and the ledger of what it cannot check.

`Protection` swaps the model's matmul modules for checked ones — Linears and Hugging Face's Conv1D
(integrations/modules.py), modules holding matrices of their own such as MoE experts and routers
(integrations/matrices.py), nn.MultiheadAttention's projections (integrations/multihead.py) — names
every other matmul module at once, and puts the user's modules back on `restore()`.

`Uncovered` is where everything that runs unchecked is named, each once and with the reason: in a
warning, in an event for the step's record (the store), and in the coverage report's `not_covered`.
Three kinds: modules (named at `protect()`, or a matrix after its module's first call), protected
Linears whose calls run unchecked (a shape the GPU kernels cannot take, a torch.func transform), and
attention modules whose calls stay unchecked.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from aegis_sdc.events import AttentionKind, GemmKind
from aegis_sdc.integrations.attention import attention_outside_sdpa
from aegis_sdc.integrations.matrices import restore_matrix_modules, select_matrix_modules, swap_matrix_modules, uncalled
from aegis_sdc.integrations.modules import TRANSFORMED, Swap, module_names, restore_linears, swap_linears
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
        except BaseException:
            self.restore()  # a protect() that fails part way leaves the model as it was
            raise

    def counts(self) -> dict[str, int]:
        """Protected modules by the user's class name (a matrix module handed back is not counted)."""
        standing = [*self.linear_swaps, *(s for s in self.matrix_swaps if s.in_place)]
        originals = {id(s.checked): s.original for s in standing}.values()  # (a module standing under two names: once)
        return dict(Counter(type(original).__name__ for original in originals))

    def name_uncalled(self) -> None:
        """After the first step: the matrices of modules whose forward never ran are named."""
        uncalled(self.matrix_swaps)

    def restore(self) -> None:
        """The user's modules back in the model."""
        restore_linears(self.linear_swaps)
        restore_matrix_modules(self.matrix_swaps)
