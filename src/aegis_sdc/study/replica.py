"""A replica of the study's training: model, optimizer, step clock, faults and its own RNG stream.

Replicas are built identically (same seed before the model is constructed, same optimizer), each
on its device. Each keeps its own torch RNG state and runs under it, so dropout-style randomness
draws the same numbers on every replica whatever order the harness steps them in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from aegis_sdc.events import Site
from aegis_sdc.faults.injector import FaultInjector
from aegis_sdc.faults.models import FaultSpec
from aegis_sdc.study.config import StudyConfig
from aegis_sdc.study.linear import StepClock, StudyLinear, install_study_linears
from aegis_sdc.study.taps import bit_mismatch
from aegis_sdc.workloads.data import SyntheticTokens, TokenStreamConfig
from aegis_sdc.workloads.llama import Llama, lm_loss

ModelFactory = Callable[[], nn.Module]  # builds a causal LM: tokens [B, T] int64 → logits [B, T, vocab]


class RngState:
    """A private torch RNG stream (the CPU generator and, on a GPU, that device's generator)."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        with torch.random.fork_rng(devices=self._cuda()):
            torch.manual_seed(seed)
            self.cpu = torch.get_rng_state()
            self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def _cuda(self) -> list:
        return [self.device] if self.device.type == "cuda" else []

    @contextmanager
    def active(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=self._cuda()):  # the caller's streams come back afterwards
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield
            self.cpu = torch.get_rng_state()
            if self.cuda is not None:
                self.cuda = torch.cuda.get_rng_state(self.device)


@dataclass
class Replica:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    clock: StepClock
    injector: FaultInjector | None
    sites: list[Site]
    rng: RngState

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, step: int) -> torch.Tensor:
        """The step's loss (0-d, on the device); gradients are left in `.grad`."""
        with self.rng.active():
            self.clock.start(step)
            self.optimizer.zero_grad(set_to_none=True)
            loss = lm_loss(self.model(inputs.to(self.device)), targets.to(self.device))
            loss.backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        with self.rng.active():
            self.optimizer.step()

    def disable_faults(self) -> None:
        """The faulty unit stops striking (fine-tuning measures the damage already done)."""
        self.injector = None
        for module in self.model.modules():
            if isinstance(module, StudyLinear):
                module.study_faults.injector = None


def token_stream(cfg: StudyConfig, *, sample_seed: int, chain_seed: int | None = None) -> SyntheticTokens:
    """The workload's Markov chain (`cfg.seed`, or `chain_seed`) sampled in the order of `sample_seed`."""
    return SyntheticTokens(
        TokenStreamConfig(
            vocab_size=cfg.model.vocab_size,
            seq_len=cfg.seq_len,
            batch_size=cfg.batch_size,
            seed=cfg.seed if chain_seed is None else chain_seed,
            sample_seed=sample_seed,
        )
    )


def build_replica(
    name: str,
    cfg: StudyConfig,
    device: torch.device,
    *,
    faults: tuple[FaultSpec, ...] = (),
    model_factory: ModelFactory | None = None,
) -> Replica:
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.seed)  # every replica starts from the same weights
        model = model_factory() if model_factory is not None else Llama(cfg.model)
    model = model.to(device)
    clock = StepClock()
    injector = FaultInjector(faults) if faults else None
    sites = install_study_linears(model, injector, clock)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    return Replica(name, model, optimizer, device, clock, injector, sites, RngState(cfg.seed, device))


@torch.no_grad()
def copy_state(src: Replica, dst: Replica) -> None:
    """Make `dst` continue from `src`'s parameters and optimizer state (param-sync)."""
    for p_src, p_dst in zip(src.model.parameters(), dst.model.parameters(), strict=True):
        p_dst.copy_(p_src)
        state = src.optimizer.state.get(p_src, {})
        dst.optimizer.state[p_dst] = {
            # Moments live with the parameter; AdamW's `step` counter stays on the CPU.
            k: (v.to(p_dst.device, copy=True) if v.device == p_src.device else v.clone()) if torch.is_tensor(v) else v
            for k, v in state.items()
        }


def layer_of(name: str) -> str:
    """`layers.3.mlp.up_proj.weight` → `layers.3`; `lm_head.weight` → `lm_head`; below a container
    (Hugging Face's `model.model.layers.3.…`, `model.lm_head.weight`) the same: the first indexed
    block, else the name's last module."""
    parts = name.split(".")
    for i in range(len(parts) - 2):
        if parts[i + 1].isdigit():
            return ".".join(parts[i : i + 2])
    return parts[-2] if len(parts) > 1 else parts[0]


def relative_deviation(pairs: Iterable[tuple[str, torch.Tensor | None, torch.Tensor | None]]) -> dict[str, float]:
    """Per layer and "all": ‖a − b‖ / ‖b‖ over the named pairs (b the healthy one), fp64, one transfer.

    A missing tensor (a gradient that was never produced) counts as zeros; 0/0 is 0, x/0 is inf.
    """
    sums: dict[str, list[torch.Tensor]] = {}
    for name, a, b in pairs:
        if a is None and b is None:
            continue
        ref = b if b is not None else torch.zeros_like(a)
        mine = (a if a is not None else torch.zeros_like(ref)).to(ref.device)
        diff = (mine.double() - ref.double()).square().sum()
        norm = ref.double().square().sum()
        entry = sums.setdefault(layer_of(name), [diff * 0, diff * 0])
        entry[0] = entry[0] + diff
        entry[1] = entry[1] + norm
    if not sums:
        return {"all": 0.0}
    layers = list(sums)
    values = torch.stack([torch.stack(sums[k]) for k in layers]).cpu().tolist()  # [layers, 2]
    out = {}
    total = [0.0, 0.0]
    for layer, (diff, norm) in zip(layers, values, strict=True):
        out[layer] = _ratio(diff, norm)
        total[0] += diff
        total[1] += norm
    out["all"] = _ratio(*total)
    return out


def _ratio(diff_sq: float, norm_sq: float) -> float:
    if diff_sq == 0.0:
        return 0.0
    return (diff_sq / norm_sq) ** 0.5 if norm_sq > 0 else float("inf")


def first_state_difference(a: Replica, b: Replica) -> str | None:
    """The first parameter, buffer or optimizer state of `a` that differs in any bit from `b`'s."""
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        if x.shape != y.shape or bool(bit_mismatch(x, y.to(x.device)).any()):
            return f"{name} (model state)"
    names = {p: n for n, p in a.model.named_parameters()}
    for p_a, p_b in zip(a.model.parameters(), b.model.parameters(), strict=True):
        state_a, state_b = a.optimizer.state.get(p_a, {}), b.optimizer.state.get(p_b, {})
        for key in sorted(set(state_a) | set(state_b)):
            x, y = state_a.get(key), state_b.get(key)
            if x is None or y is None or (torch.is_tensor(x) and bool(bit_mismatch(x, y.to(x.device)).any())):
                return f"{names[p_a]} optimizer state {key!r}"
    return None
