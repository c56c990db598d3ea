"""What a campaign injects and where: fault locations, the trials drawn over them, and the faults
no protected op injects itself (a norm's output, the optimizer's writes, state at rest).

A trial is one fault at the first step of a short run from the campaign's snapshot. Locations:

- `gemm_fwd`, `gemm_dgrad`, `gemm_wgrad`: one fp32 accumulator element of a Linear's GEMM (the
  fault injector, `FaultSpec`);
- `attention_fwd`, `attention_bwd`: one value of an attention stage (`qk`, `softmax`, `pv`; then `pv`
  (dV), `dp`, `ds`, `dq`, `dk`) (the fault injector, `stage`);
- `saved`: a floating-point tensor saved for backward, between forward and backward (the injector,
  `:saved` sites that save one: a fault never flips an index);
- `recompute`: a checkpointed segment's recomputed output (the injector, `:recompute` site);
- `elementwise`: one element of an element-wise op's result in forward (the step's first call, a
  hook): `norm` an RMSNorm's output; `activation` the MLP's activation product silu(gate)·up (the
  down projection's input); `residual` the residual sum after attention (the MLP norm's input, which
  the block's second residual add reads too) — the last two corrupted in place, so every reader of
  the value sees the wrong one, as on a faulty device;
- `optimizer_update`: one element of a parameter as the optimizer step wrote it (an optimizer
  post-hook run before the guard's);
- `optimizer_state`: one element of Adam's `exp_avg`, between steps (the campaign, before the step);
- `weights`: one element of a parameter, between steps (the campaign, before the step).

Magnitudes: a bit position (`bitflip`: 0 = the lowest mantissa bit of the element's own dtype, the
sign last) and, for GEMM accumulators, r (`perturb`: r × the site's median clean checksum difference,
the AEGIS unit).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from aegis_sdc.faults.injector import flip_bit
from aegis_sdc.faults.models import FaultSpec

GEMM_LOCATIONS = {"gemm_fwd": "fwd", "gemm_dgrad": "dgrad", "gemm_wgrad": "wgrad"}
ATTENTION_STAGES = {"attention_fwd": ("qk", "softmax", "pv"), "attention_bwd": ("pv", "dp", "ds", "dq", "dk")}
ELEMENTWISE_OPS = ("norm", "activation", "residual")  # the stages of `elementwise`
STAGES = {**ATTENTION_STAGES, "elementwise": ELEMENTWISE_OPS}
INJECTED = (*GEMM_LOCATIONS, *ATTENTION_STAGES, "saved", "recompute")  # by the fault injector
HOOKED = ("elementwise", "optimizer_update", "optimizer_state", "weights")  # by the campaign
LOCATIONS = (*INJECTED, *HOOKED)


@dataclass(frozen=True)
class Trial:
    """One fault. `site`: a site name (injected locations), a module (`elementwise`) or a parameter."""

    index: int
    location: str
    site: str
    model: str  # bitflip | perturb
    magnitude: float  # the bit (bitflip) or r (perturb)
    seed: int
    stage: str | None = None  # attention locations; the op of `elementwise`

    @property
    def cell(self) -> str:
        unit = f"bit {int(self.magnitude)}" if self.model == "bitflip" else f"r {self.magnitude:g}"
        stage = f" {self.stage}" if self.stage else ""
        return f"{self.location}{stage} {unit}"

    def spec(self, step: int) -> FaultSpec | None:
        """The injector's fault for injected locations (None for the campaign's own)."""
        if self.location in HOOKED:
            return None  # (attention stages are the injector's; an element-wise op's is the campaign's)
        size = {"bit": int(self.magnitude)} if self.model == "bitflip" else {"scale": float(self.magnitude)}
        stage = {"stage": self.stage} if self.stage else {}
        return FaultSpec(site=self.site, model=self.model, steps=(step,), seed=self.seed, **size, **stage)


@dataclass(frozen=True)
class Targets:
    """Where a campaign may inject in one protected model (names found after its warm-up)."""

    gemm: dict[str, tuple[str, ...]]  # location → GEMM site names
    attention: dict[str, tuple[str, ...]]  # location → attention site names
    saved: tuple[str, ...]
    recompute: tuple[str, ...]
    elementwise: dict[str, tuple[str, ...]]  # op → the modules whose output (`norm`) or input it corrupts
    params: tuple[str, ...]

    def sites(self, location: str, stage: str | None = None) -> tuple[str, ...]:
        if location in GEMM_LOCATIONS:
            return self.gemm[location]
        if location in ATTENTION_STAGES:
            return self.attention[location]
        if location == "elementwise":
            ops = (stage,) if stage else ELEMENTWISE_OPS
            return tuple(m for op in ops for m in self.elementwise[op])
        return {"saved": self.saved, "recompute": self.recompute}.get(location, self.params)


def targets_of(model: nn.Module, guard) -> Targets:
    """The sites and modules of a protected model once a step has run (saved and recompute sites are
    named when first seen)."""
    gemm = {loc: tuple(s.site.name for s in guard.registry.gemm if s.site.name.endswith(f":{kind}"))
            for loc, kind in GEMM_LOCATIONS.items()}  # fmt: skip
    checked = [m for m in guard.attention_sensors if m not in guard.uncovered.attention]  # (unchecked: no fault)
    attention = {loc: tuple(f"{m}:{loc.replace('attention', 'attn')}" for m in checked) for loc in ATTENTION_STAGES}
    extra = [s.name for s in guard.registry.extra]
    modules = dict(model.named_modules())
    elementwise = {  # the project's Llama (workloads/llama.py): blocks with attn_norm, mlp_norm, mlp.down_proj
        "norm": tuple(name for name, m in modules.items() if type(m).__name__.endswith("RMSNorm")),
        "activation": tuple(name for name in modules if name.endswith("mlp.down_proj")),
        "residual": tuple(name for name in modules if name.endswith("mlp_norm")),
    }
    params = tuple(name for name, p in model.named_parameters() if p.requires_grad)
    checker = guard._saved_checker  # saved sites holding an activation: a `:saved` fault skips indices
    activations = checker.activation_modules if checker is not None else frozenset()
    saved = tuple(n for n in extra if n.endswith(":saved") and n.removesuffix(":saved") in activations)
    return Targets(gemm, attention, saved,
                   tuple(n for n in extra if n.endswith(":recompute")), elementwise, params)  # fmt: skip


def draw_trials(targets: Targets, n: int, seed: int, bits: tuple[int, ...], rs: tuple[float, ...],
                locations: tuple[str, ...] = LOCATIONS) -> list[Trial]:  # fmt: skip
    """`n` trials spread evenly over the locations, and within a location over its cells (magnitude ×
    stage), each at a site drawn at random: round robin, so a short campaign touches every location
    and every stage and, given enough trials, every cell."""
    rng = random.Random(seed)
    cells: dict[str, list[tuple[str | None, str, float]]] = {}
    for location in locations:
        magnitudes = [("bitflip", float(b)) for b in bits]
        if location in GEMM_LOCATIONS:
            magnitudes += [("perturb", float(r)) for r in rs]
        stages = [stage for stage in STAGES.get(location, (None,)) if targets.sites(location, stage)]
        if stages:
            # stages inner: a short campaign meets every stage before it meets every magnitude
            cells[location] = [(stage, model, m) for model, m in magnitudes for stage in stages]
    order = list(cells)
    trials = []
    for index in range(n):
        location = order[index % len(order)]
        stage, model, magnitude = cells[location][(index // len(order)) % len(cells[location])]
        site = rng.choice(targets.sites(location, stage))
        trials.append(Trial(index, location, site, model, magnitude, rng.randrange(1 << 31), stage))
    return trials


# -- the campaign's own faults ------------------------------------------------------------------------


def flip_element(t: torch.Tensor, bit: int, seed: int) -> int:
    """Flip bit `bit` (modulo the element's width) of one element of `t` in place, drawn from `seed`;
    returns its index."""
    index = random.Random(seed).randrange(t.numel())
    flip_bit(t, index, bit)
    return index


def install(trial: Trial, model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """Arm the trial's fault for the next step when the campaign injects it itself; returns the undo
    (hooks removed). `optimizer_state` and `weights` strike at once: the state at rest before the step."""
    bit = int(trial.magnitude)
    if trial.location == "elementwise":
        return _corrupt_elementwise(trial, dict(model.named_modules())[trial.site], bit)
    param = dict(model.named_parameters())[trial.site]
    if trial.location == "optimizer_update":
        fired_update = {"done": False}

        def corrupt_update(opt, args, kwargs):
            if not fired_update["done"]:  # the trial's first step (the hook is removed by the undo)
                fired_update["done"] = True
                with torch.no_grad():
                    flip_element(param, bit, trial.seed)

        handle = optimizer.register_step_post_hook(corrupt_update)
        # before the guard's post-hook (hooks run in the order of their dict): the update as written
        optimizer._optimizer_step_post_hooks.move_to_end(handle.id, last=False)
        return handle.remove
    with torch.no_grad():
        if trial.location == "weights":
            flip_element(param, bit, trial.seed)
        elif trial.location == "optimizer_state":
            state = optimizer.state.get(param, {})
            target = state.get("exp_avg")
            if target is not None:
                flip_element(target, bit, trial.seed)
        else:
            raise ValueError(f"unknown campaign location {trial.location!r}")
    return lambda: None


def _corrupt_elementwise(trial: Trial, module: nn.Module, bit: int) -> Callable[[], None]:
    """Flip one element of an element-wise op's result at the module's first call of the step (its
    recomputation in backward is clean, as a transient fault's would be): `norm` the module's output;
    `activation` and `residual` the module's input, in place before anything reads it — the activation
    product is read only by the down projection, the residual sum by the MLP's norm and by the block's
    second residual add, so every reader sees the wrong value."""
    fired = {"done": False}

    def first_call() -> bool:
        done, fired["done"] = fired["done"], True
        return not done

    def corrupt_output(module, args, output):
        if first_call():
            with torch.no_grad():
                flip_element(output, bit, trial.seed)
        return output

    def corrupt_input(module, args):
        if first_call():
            with torch.no_grad():
                flip_element(args[0], bit, trial.seed)

    if trial.stage in (None, "norm"):
        handle = module.register_forward_hook(corrupt_output)
    else:
        handle = module.register_forward_pre_hook(corrupt_input)
    return handle.remove
