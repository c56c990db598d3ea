"""torch's own module forms of a matmul: parametrized Linears (weight_norm, spectral_norm, pruning
masks) are protected as Linears (integrations/modules.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.helpers import guard_config
from torch import nn
from torch.nn.utils import parametrize

import aegis_sdc as aegis


class Masked(nn.Module):
    """A pruning mask as torch.ao.pruning applies it: W ⊙ mask, the mask a buffer."""

    def __init__(self, shape: torch.Size) -> None:
        super().__init__()
        self.register_buffer("mask", (torch.arange(shape.numel()).reshape(shape) % 3 != 0).float())

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.mask


def _parametrized_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 64), nn.Tanh(), nn.Linear(64, 8))
    if kind == "weight_norm":  # the second layer: its forward, dgrad and wgrad all run
        model[2] = nn.utils.parametrizations.weight_norm(model[2])
    elif kind == "spectral_norm":
        model[2] = nn.utils.parametrizations.spectral_norm(model[2])
    else:
        parametrize.register_parametrization(model[2], "weight", Masked(model[2].weight.shape))
    return model


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05)


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(96, 48, generator=gen), torch.randn(96, 8, generator=gen)
        loss = (model(x) - y).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "mask"])
def test_a_parametrized_linear_is_protected_and_trains_as_the_unprotected_one(tmp_path, kind):
    model = _parametrized_model(kind)
    reference = copy.deepcopy(model)
    optimizer = _optimizer(model)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    losses = _steps(model, optimizer, 6)
    report = guard.coverage_report()
    summary = guard.close()
    assert report.protected == {"ParametrizedLinear": 1, "Linear": 1}
    assert report.not_covered == {}
    assert summary.checks == 6 * 5 and summary.confirmed == 0  # the first layer has no dgrad
    # The checked GEMMs sum in another order than torch's (fp32, K ≤ 64): the losses agree to a few
    # ulps of fp32 per step, compounded over six SGD steps.
    assert losses == pytest.approx(_steps(reference, _optimizer(reference), 6), rel=1e-5)
    # the parametrization's own tensors are what the optimizer trained, under their own names
    assert model.state_dict().keys() == reference.state_dict().keys()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("site", ["2:fwd", "2:dgrad", "2:wgrad"])
def test_a_fault_in_a_parametrized_linear_is_confirmed_at_its_site_and_step(tmp_path, site):
    model = _parametrized_model("weight_norm")
    optimizer = _optimizer(model)
    fault = aegis.FaultSpec(site=site, model="bitflip", bit=27, steps=(4,))
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=(fault,)))
    with pytest.warns(UserWarning, match="confirmed SDC"):
        _steps(model, optimizer, 6)
    guard.close()
    assert [(i.step, i.site.name, i.verdict.kind.value) for i in guard.incidents] == [(4, site, "confirmed_sdc")]


def test_copies_of_a_protected_parametrized_linear_are_the_plain_parametrized_module(tmp_path):
    model = _parametrized_model("spectral_norm")
    optimizer = _optimizer(model)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    _steps(model, optimizer, 1)
    copied = copy.deepcopy(model)
    guard.close()
    assert type(copied[2]).__name__ == "ParametrizedLinear" and type(copied[2]).__bases__ == (nn.Linear,)
    assert not any(key.startswith("aegis_") for m in copied.modules() for key in vars(m))
    model.eval(), copied.eval()  # (a spectral norm's power iteration runs in training mode only)
    torch.testing.assert_close(copied[2].weight, model[2].weight)  # the same computed weight
