"""The reference checked GEMM: checksum formulas, bit-exact replay of every region, fault effects."""

import itertools
import math

import pytest
import torch

from aegis_sdc.faults.models import AccumulatorFault
from aegis_sdc.kernels.reference import (
    U32,
    Tiling,
    bitwise_equal,
    checked_gemm,
    exact_violations,
    replay_region,
)
from aegis_sdc.sensors.thresholds import worst_case_bound

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def operands(m, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(k, n, generator=g).to(dtype)
    return a, b


@pytest.mark.parametrize("dtype", DTYPES)
def test_checksums_follow_their_formulas(dtype):
    a, b = operands(150, 70, 90, dtype)
    bias = torch.randn(90).to(dtype)
    r = checked_gemm(a, b, out_dtype=dtype, bias=bias, col_check=True, tiling=Tiling(64, 32))
    a64, b64 = a.double(), b.double()
    exact = a64 @ b64
    # The fp64 checksums of the fp32 accumulator differ from the exact product only by the fp32
    # accumulation error: |Σ_j (acc_ij − E_ij)| ≤ γ_K Σ_jk |A_ik||B_kj| (deterministic bound).
    magnitude = a64.abs() @ b64.abs()
    gamma_k = 70 * U32 / (1 - 70 * U32)
    assert torch.all((r.row_sum - exact.sum(1)).abs() <= gamma_k * magnitude.sum(1) + 1e-300)
    assert torch.all((r.col_sum - exact.sum(0)).abs() <= gamma_k * magnitude.sum(0) + 1e-300)
    # The reference side is A·(B·1) and (1ᵀA)·B, computed in fp64 from exactly representable values:
    # only fp64 reassociation separates it from the exact sums (2⁻⁵² relative per term).
    assert torch.allclose(r.row_ref, exact.sum(1), rtol=0, atol=1e-10 * float(magnitude.max()))
    assert torch.allclose(r.col_ref, exact.sum(0), rtol=0, atol=1e-10 * float(magnitude.max()))
    # Scales are the root-sum-squares of the products feeding each checksum.
    assert torch.allclose(r.row_scale, ((a64**2) @ (b64**2).sum(1)).sqrt(), rtol=1e-12)
    assert torch.allclose(r.col_scale, ((b64**2).t() @ (a64**2).sum(0)).sqrt(), rtol=1e-12)
    # The output is the accumulator plus bias, rounded once to the output dtype.
    assert r.out.dtype == dtype
    u_out = torch.finfo(dtype).eps / 2
    bound = (
        gamma_k * magnitude * (1 + 2 * u_out)
        + 2 * u_out * (exact + bias.double()).abs()
        + 2 * U32 * bias.double().abs()
    )
    assert torch.all((r.out.double() - (exact + bias.double())).abs() <= bound + torch.finfo(dtype).tiny)


def test_clean_differences_are_rounding_noise_far_below_the_worst_case_bound():
    a, b = operands(512, 256, 384, torch.bfloat16)
    r = checked_gemm(a, b, out_dtype=torch.bfloat16, col_check=True)
    rows = (r.row_sum - r.row_ref).abs() / (U32 * r.row_scale)
    cols = (r.col_sum - r.col_ref).abs() / (U32 * r.col_scale)
    # Random-walk accumulation error of K terms is O(sqrt(K)) units of u·s; the exact worst case is
    # 4(K+N)·sqrt(KN) units. Clean values must sit orders of magnitude below it.
    assert 0 < float(rows.max()) < 100 < worst_case_bound(256, 384) / 1000
    assert 0 < float(cols.max()) < 100 < worst_case_bound(256, 512) / 1000


SHAPES = [(1, 1, 1), (7, 33, 5), (33, 7, 130), (130, 64, 33), (257, 40, 70)]
TILINGS = [Tiling(128, 128), Tiling(32, 16)]


@pytest.mark.parametrize(("shape", "dtype", "tiling"), list(itertools.product(SHAPES, DTYPES, TILINGS)))
def test_every_region_replays_bit_for_bit(shape, dtype, tiling):
    m, k, n = shape
    a, b = operands(m, k, n, dtype, seed=m + k + n)
    bias = torch.randn(n).to(dtype)
    r = checked_gemm(a, b, out_dtype=dtype, bias=bias, col_check=True, tiling=tiling)
    row_blocks = list(tiling.ranges(m, tiling.rows))
    col_blocks = list(tiling.ranges(n, tiling.cols))
    for i, (r0, r1) in enumerate(row_blocks):
        # "rows" region: one row block against the whole of B (B·1 recomputed from B).
        whole = replay_region(a[r0:r1], b, out_dtype=dtype, bias=bias, tiling=tiling)
        assert bitwise_equal(whole.out, r.out[r0:r1])
        assert bitwise_equal(whole.row_partials, r.row_partials[:, r0:r1])
        assert bitwise_equal(whole.row_ref, r.row_ref[r0:r1])
        assert bitwise_equal(whole.b_rowsum, r.b_rowsum)
        for j, (c0, c1) in enumerate(col_blocks):
            # "tile" region: copies of one row block and one column block, saved B·1.
            tile = replay_region(
                a[r0:r1].clone(),
                b[:, c0:c1].clone(),
                out_dtype=dtype,
                bias=bias[c0:c1],
                tiling=tiling,
                b_rowsum=r.b_rowsum,
            )
            assert bitwise_equal(tile.out, r.out[r0:r1, c0:c1])
            assert bitwise_equal(tile.row_partials[0], r.row_partials[j, r0:r1])
            assert bitwise_equal(tile.col_partials[0], r.col_partials[i, c0:c1])
            assert bitwise_equal(tile.row_ref, r.row_ref[r0:r1])
    for c0, c1 in col_blocks:
        # "cols" region: all of A against one column block.
        cols = replay_region(
            a, b[:, c0:c1].clone(), out_dtype=dtype, bias=bias[c0:c1], tiling=tiling, b_rowsum=r.b_rowsum
        )
        assert bitwise_equal(cols.out, r.out[:, c0:c1])
        assert bitwise_equal(cols.col_partials, r.col_partials[:, c0:c1])


def test_replays_stay_bit_identical_over_repetitions():
    a, b = operands(300, 200, 260, torch.bfloat16, seed=3)
    first = replay_region(a[128:256], b, out_dtype=torch.bfloat16, bias=None, tiling=Tiling())
    for _ in range(20):
        again = replay_region(a[128:256].clone(), b, out_dtype=torch.bfloat16, bias=None, tiling=Tiling())
        assert bitwise_equal(again.out, first.out) and bitwise_equal(again.row_partials, first.row_partials)


@pytest.mark.parametrize("model", ["perturb", "bitflip"])
def test_an_accumulator_fault_changes_the_element_and_its_checksums(model):
    a, b = operands(64, 48, 40, torch.float32)
    clean = checked_gemm(a, b, out_dtype=torch.float32, col_check=True)
    fault = AccumulatorFault(model=model, bit=27, delta=0.5, row=10, col=17, row_u=0.0, col_u=0.0)
    bad = checked_gemm(a, b, out_dtype=torch.float32, col_check=True, fault=fault)
    changed = (bad.out != clean.out).nonzero().tolist()
    assert changed == [[10, 17]]
    assert float((bad.row_sum - clean.row_sum)[10]) != 0 and float((bad.col_sum - clean.col_sum)[17]) != 0
    assert bitwise_equal(bad.row_ref, clean.row_ref)  # the reference side does not see the fault
    if model == "perturb":
        assert math.isclose(float(bad.out[10, 17] - clean.out[10, 17]), 0.5, rel_tol=1e-5)


def test_bitflip_of_the_sign_bit_negates_the_element():
    fault = AccumulatorFault(model="bitflip", bit=31, delta=0.0, row=0, col=0, row_u=0, col_u=0)
    assert float(fault.corrupt(torch.tensor(3.5))) == -3.5
    assert float(AccumulatorFault("bitflip", 23, 0.0, 0, 0, 0, 0).corrupt(torch.tensor(3.0))) == 6.0  # exponent LSB


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_bound_accepts_every_clean_result_and_rejects_a_wrong_one(dtype):
    a, b = operands(96, 300, 80, dtype, seed=5)
    bias = torch.randn(80).to(dtype)
    r = checked_gemm(a, b, out_dtype=dtype, bias=bias, tiling=Tiling(32, 32))
    assert exact_violations(a, b, bias=bias, out=r.out, row_partials=r.row_partials, tiling=Tiling(32, 32)) == 0
    wrong = r.out.clone()
    wrong[5, 6] = wrong[5, 6] * 1.5 + 1  # far outside any rounding
    assert exact_violations(a, b, bias=bias, out=wrong, row_partials=r.row_partials, tiling=Tiling(32, 32)) == 1


def test_an_accumulator_that_passes_fp32s_range_on_the_way_is_no_proof_of_a_fault():
    # 3e38 + 3e38 − 3e38: the exact sum (3e38) fits fp32, but the running sum passes its range first,
    # so a correct fp32 execution ends at +inf. A bound that looked only at the exact sum counted that
    # as a value no correct execution gives — the proof that confirms a fault that replays identically.
    a = torch.tensor([[3e38, 3e38, -3e38], [1.0, 2.0, 3.0]])
    b = torch.ones(3, 1)
    r = checked_gemm(a, b, out_dtype=torch.float32, tiling=Tiling(2, 1))
    assert torch.isinf(r.out[0, 0]) and torch.isinf(r.row_partials[0, 0])  # the correct fp32 result
    assert exact_violations(a, b, bias=None, out=r.out, row_partials=r.row_partials, tiling=Tiling(2, 1)) == 0
    wrong = r.out.clone()
    wrong[1, 0] = 7.0  # the row that stays in range is still held to the bound
    assert exact_violations(a, b, bias=None, out=wrong, row_partials=r.row_partials, tiling=Tiling(2, 1)) == 1


def test_bitwise_equal_tells_nan_payloads_and_signed_zeros_apart():
    assert bitwise_equal(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    assert not bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not bitwise_equal(torch.zeros(2), torch.zeros(3))
