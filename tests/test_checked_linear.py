"""The checked Linear against torch.nn.Linear: values, gradients, shapes, dtypes, bad input."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from tests.helpers import guard_config
from torch import nn

import aegis_sdc as aegis
from aegis_sdc.integrations.modules import CheckedLinear

U32 = 2.0**-24
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (tokens M, in-features K, out-features N): the odd sizes of the issue, each in every role.
SHAPES = [(1, 1, 1), (7, 33, 7), (33, 1000, 7), (1000, 7, 33), (33, 7, 1000)]


def tolerance(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Elementwise bound on |ours − torch| for a product A·B rounded to `dtype`.

    Both implementations accumulate in fp32 (each within γ_K·Σ_k|A_ik||B_kj| of the exact value,
    γ_K = K·u/(1 − K·u), u = 2⁻²⁴) and round once to `dtype` (at most u_d·|y| each, u_d the
    dtype's unit roundoff). Their difference is bounded by the sum, doubled; `tiny` covers values
    that round into the dtype's subnormal range.
    """
    k = a.shape[-1]
    gamma = k * U32 / (1 - k * U32)
    magnitude = a.double().abs() @ b.double().abs()
    u_d = torch.finfo(dtype).eps / 2
    return 2 * gamma * magnitude + 4 * u_d * ref.double().abs() + 2 * torch.finfo(dtype).tiny


def protected_pair(m_in: int, n_out: int, dtype: torch.dtype, bias: bool, tmp_path):
    torch.manual_seed(m_in * 31 + n_out)
    reference = nn.Sequential(nn.Linear(m_in, n_out, bias=bias)).to(dtype)
    ours = copy.deepcopy(reference)
    guard = aegis.protect(ours, config=guard_config(tmp_path))
    assert isinstance(ours[0], CheckedLinear)
    return reference, ours, guard


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_match_nn_linear(shape, dtype, bias, tmp_path):
    m, k, n = shape
    reference, ours, guard = protected_pair(k, n, dtype, bias, tmp_path)
    x = torch.randn(m, k).to(dtype)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_ours = reference(x_ref), ours(x_ours)
    assert y_ours.dtype == dtype and y_ours.shape == y_ref.shape
    w = reference[0].weight.detach()
    assert torch.all((y_ours.double() - y_ref.double()).abs() <= tolerance(x, w.t(), y_ref, dtype))

    dy = torch.randn(m, n).to(dtype)
    y_ref.backward(dy)
    y_ours.backward(dy)
    assert torch.all((x_ours.grad.double() - x_ref.grad.double()).abs() <= tolerance(dy, w, x_ref.grad, dtype))
    w_ref, w_ours = reference[0].weight.grad, ours[0].weight.grad
    assert torch.all((w_ours.double() - w_ref.double()).abs() <= tolerance(dy.t(), x, w_ref, dtype))
    if bias:
        # Both reduce dY over the tokens; allow the reduction's fp32 error plus one rounding.
        db_tol = (
            m * U32 * dy.double().abs().sum(0) * 2
            + 2 * (torch.finfo(dtype).eps / 2) * reference[0].bias.grad.double().abs()
        )
        assert torch.all((ours[0].bias.grad.double() - reference[0].bias.grad.double()).abs() <= db_tol + 1e-30)
    guard.step()
    summary = guard.close()
    assert summary.checks == 3 and summary.confirmed == 0


@pytest.mark.parametrize("layout", ["3d", "transposed", "strided"])
def test_three_dimensional_and_non_contiguous_inputs(layout, tmp_path):
    reference, ours, guard = protected_pair(24, 16, torch.float32, True, tmp_path)
    base = torch.randn(5, 24, 6)
    x = {
        "3d": base.permute(0, 2, 1).contiguous(),  # [5, 6, 24]
        "transposed": base.permute(0, 2, 1),  # non-contiguous [5, 6, 24]
        "strided": torch.randn(5, 6, 48)[..., ::2],  # non-unit stride in the feature dimension
    }[layout]
    assert x.shape[-1] == 24
    y_ref, y_ours = reference(x), ours(x)
    assert y_ours.shape == (5, 6, 16)
    flat = x.reshape(-1, 24)
    tol = tolerance(flat, reference[0].weight.detach().t(), y_ref.reshape(-1, 16), torch.float32)
    assert torch.all((y_ours.reshape(-1, 16).double() - y_ref.reshape(-1, 16).double()).abs() <= tol)
    guard.close()


def test_one_dimensional_input_like_nn_linear(tmp_path):
    reference, ours, guard = protected_pair(8, 3, torch.float32, True, tmp_path)
    x = torch.randn(8)
    assert ours(x).shape == reference(x).shape == (3,)
    guard.close()


def test_autocast_runs_the_checked_gemm_in_the_autocast_dtype(tmp_path):
    reference, ours, guard = protected_pair(64, 32, torch.float32, True, tmp_path)
    x = torch.randn(16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref, y_ours = reference(x), ours(x)
    assert y_ours.dtype == y_ref.dtype == torch.bfloat16
    tol = tolerance(x.bfloat16(), reference[0].weight.detach().bfloat16().t(), y_ref, torch.bfloat16)
    # the bias is rounded to bf16 first by both; one more bf16 rounding of it is allowed
    tol = tol + 2 * (2.0**-9) * reference[0].bias.detach().double().abs()
    assert torch.all((y_ours.double() - y_ref.double()).abs() <= tol)
    y_ours.float().sum().backward()
    assert ours[0].weight.grad.dtype == torch.float32  # gradient flows back through the cast
    guard.step()
    assert guard.close().checks == 2  # forward and wgrad; x needs no gradient, so no dgrad runs


def test_the_guard_restores_the_original_modules(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    originals = [model[0], model[2][0]]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with aegis.protect(model, config=guard_config(tmp_path)) as guard:
        assert isinstance(model[0], CheckedLinear) and isinstance(model[2][0], CheckedLinear)
        assert model[0].weight is originals[0].weight  # the same Parameter, not a copy
        assert list(model.state_dict()) == list(state)
        assert [s.name for s in guard.sites][:3] == ["0:fwd", "0:dgrad", "0:wgrad"]
    assert model[0] is originals[0] and model[2][0] is originals[1]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_filter_and_patterns_choose_the_protected_linears(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    guard = aegis.protect(model, config=guard_config(tmp_path, exclude=("2",)), filter=lambda name, lin: name != "0")
    assert [type(m) for m in model] == [nn.Linear, CheckedLinear, nn.Linear]
    guard.close()
    with pytest.raises(ValueError, match=r"no nn.Linear"):
        aegis.protect(model, config=guard_config(tmp_path, include=("nothing*",)))


# -- bad input -------------------------------------------------------------------------------------
@pytest.fixture
def protected(tmp_path):
    model = nn.Sequential(nn.Linear(8, 4))
    guard = aegis.protect(model, config=guard_config(tmp_path))
    yield model
    guard.close()


def test_mixed_dtypes_get_a_clear_error(protected):
    with pytest.raises(TypeError, match=r"input dtype torch.bfloat16 does not match weight dtype torch.float32"):
        protected(torch.randn(2, 8, dtype=torch.bfloat16))


def test_integer_input_gets_a_clear_error(protected):
    with pytest.raises(TypeError, match="floating-point input"):
        protected(torch.ones(2, 8, dtype=torch.int64))


def test_shape_mismatch_gets_a_clear_error(protected):
    with pytest.raises(ValueError, match=r"last dimension is 7 .* expects 8 features"):
        protected(torch.randn(2, 7))
    with pytest.raises(ValueError, match="scalar"):
        protected(torch.tensor(1.0))


def test_mixed_devices_get_a_clear_error(protected):
    with pytest.raises(ValueError, match="input is on meta, the weight on cpu"):
        protected(torch.randn(2, 8, device="meta"))


def test_empty_inputs_behave_like_nn_linear(protected):
    x = torch.randn(0, 8, requires_grad=True)
    y = protected(x)
    assert y.shape == (0, 4)
    y.sum().backward()
    assert x.grad.shape == (0, 8)


def test_nonfinite_input_is_reported_as_such_never_as_sdc(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="aegis_sdc")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    for step in range(20):
        x = torch.randn(64, 32)
        if step in (17, 18):
            x[3, 5] = float("nan") if step == 17 else float("inf")
        y = model(x)
        optimizer.zero_grad()
        y.square().mean().backward()
        optimizer.step()
    summary = guard.close()
    assert summary.confirmed == 0
    assert summary.nonfinite_inputs >= 2
    import sqlite3

    conn = sqlite3.connect(next((tmp_path / "run").glob("*.sqlite")))
    kinds = {row[0] for row in conn.execute("SELECT kind FROM verdicts")}
    assert "confirmed_sdc" not in kinds and "nonfinite_input" in kinds
    steps = {row[0] for row in conn.execute("SELECT step FROM events WHERE kind = 'nonfinite_input'")}
    # From step 17 on: the NaN gradient of step 17 also reaches the weights, whose non-finite values
    # are inputs of the next steps' GEMMs — still reported as non-finite input, never as SDC.
    assert min(steps) == 17 and {17, 18} <= steps
    # and on the console: one line per step that had any, naming the sites
    lines = [r.getMessage() for r in caplog.records if "NaN/Inf in the inputs" in r.getMessage()]
    logged_steps = [int(line.split("step ")[1].split(":")[0]) for line in lines]
    assert sorted(logged_steps) == sorted(steps) and len(set(logged_steps)) == len(logged_steps)
    first = conn.execute("SELECT s.name FROM events e JOIN sites s ON s.id = e.site_id "
                         "WHERE e.kind = 'nonfinite_input' AND e.step = 17").fetchone()[0]  # fmt: skip
    assert all("not an SDC" in line for line in lines) and first in lines[0].split(" at ")[1]


def test_finite_inputs_that_overflow_are_reported_as_from_the_data_never_as_false_alarm_or_sdc(tmp_path):
    # Finite operands whose products pass fp32's range (a diverging run; downstream of a corrupted
    # value): the checksums are ±inf/NaN, the replay reproduces them bit for bit — the data's values,
    # not the device, and not the checker's noise either (a false alarm would count against it).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    with torch.no_grad():
        model[0].weight.fill_(0.5)  # 32 products of 1.5e38 in a row: past fp32's 3.4e38
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    for step in range(19):
        x = torch.randn(64, 32)
        if step == 17:
            x[3] = 3e38  # finite
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    summary = guard.close()
    assert summary.confirmed == 0 and summary.false_alarms == 0 and summary.nonfinite_inputs >= 1
    import sqlite3

    conn = sqlite3.connect(next((tmp_path / "run").glob("*.sqlite")))
    first = conn.execute("SELECT s.name, v.kind, v.detail FROM verdicts v JOIN vtasks t ON t.id = v.vtask_id "
                         "JOIN sites s ON s.id = t.site_id WHERE t.step = 17 ORDER BY t.id").fetchone()  # fmt: skip
    assert first[:2] == ("0:fwd", "nonfinite_input") and "overflow" in first[2]


def test_a_gradient_penalty_differentiates_through_protected_linears(tmp_path):
    """backward(create_graph=True): the Linears' dgrad and wgrad run as differentiable torch GEMMs,
    and the second-order gradient equals the unprotected model's."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.randn(6, 8)

    def penalty_grads(model):
        xi = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(model(xi).sum(), xi, create_graph=True)
        g.square().sum().backward()
        return [p.grad for p in model.parameters()]

    expected = penalty_grads(copy.deepcopy(base))
    model = copy.deepcopy(base)
    guard = aegis.protect(model, config=guard_config(tmp_path, sampling=aegis.SamplingConfig.every_call()))
    got = penalty_grads(model)
    guard.step()
    assert guard.close().confirmed == 0
    assert [g is None for g in got] == [g is None for g in expected] == [False, False, False, True]  # ∂g/∂b₂ = 0
    for ours, ref in zip(got[:3], expected[:3], strict=True):
        # the same fp32 GEMMs on both sides, in the same order: agreement to rounding of the sums
        assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-6)
