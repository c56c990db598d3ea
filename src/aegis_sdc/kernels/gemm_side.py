"""The reference side of the checked GEMM on the tensor cores (Triton helpers).

A row check compares the row sums of the fp32 accumulator, C·1, with A·c for c = B·1. The kernel
takes A·c as a second, narrow MMA on the A tile the main MMA already holds: A [BM, BK] · S [BK, 16]
with S's columns

    0, 1, 2:  c_hi, c_lo, c_lo2  — c split into three parts of the operand dtype (hi = c rounded,
              lo = the rest rounded, lo2 = what is still left), so c_hi + c_lo + c_lo2 = c to three
              times the dtype's precision (bf16: 24 bits, fp32-level); the products with A are
              exact in fp32 and accumulate in fp32 like the main MMA's
    3:        ones (row side): A·1, the by-product a later wgrad check of the same Linear needs
    4–15:     zeros (tl.dot takes no operand dimension under 16)

and the three columns' sums are added in fp64 after the loop. A column check takes Bᵀ·S(u1) the
same way on the B tile. fp16 parts are taken of v·2ᵉ, the power of two that brings max|v| to 2¹⁴:
fp16's range (≤ 65504) would not hold the sums of wide rows; bf16 has fp32's range and needs none.
"""

from __future__ import annotations

import triton
import triton.language as tl

SIDE_N = tl.constexpr(16)  # columns of the reference-side MMA
FP16_SIDE_MAX_LOG2 = tl.constexpr(14.0)


@triton.jit
def side_scale(vec_ptr, K, DT: tl.constexpr):
    """The power of two the vector's parts are taken of: 1 unless DT is fp16, where it brings
    max|v| to at most 2¹⁴ (a pass over the K-vector, in the tiles that run the reference side)."""
    if DT == tl.float16:  # noqa: SIM300  (DT is the compile-time operand dtype)
        vmax = tl.zeros((1024,), dtype=tl.float64)
        for k0 in range(0, K, 1024):
            offs = k0 + tl.arange(0, 1024)
            vmax = tl.maximum(vmax, tl.abs(tl.load(vec_ptr + offs, mask=offs < K, other=0.0)))
        top = tl.maximum(tl.max(vmax, axis=0).to(tl.float32), 1e-30)
        exponent = FP16_SIDE_MAX_LOG2 - tl.ceil(tl.log2(top))
        return tl.exp2(exponent)
    else:
        return 1.0


@triton.jit
def side_operand(vec_ptr, k0, K, scale, ONES: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr,
                  BK: tl.constexpr):  # fmt: skip
    """S [BK, 16] for K rows k0…k0+BK: columns 0–2 the parts hi, lo, lo2 (in DT) of v·scale, whose
    sum is v·scale to 3× DT's precision; column 3 ones when ONES; the rest zeros. v is fp64."""
    offs = k0 + tl.arange(0, BK)
    v = tl.load(vec_ptr + offs, mask=offs < K, other=0.0) * scale
    hi = v.to(tl.float32).to(DT).to(tl.float32)
    rest = v - hi.to(tl.float64)
    lo = rest.to(tl.float32).to(DT).to(tl.float32)
    lo2 = (rest - lo.to(tl.float64)).to(tl.float32).to(DT).to(tl.float32)
    col = tl.arange(0, SIDE_N)[None, :]
    side = tl.where(col == 0, hi[:, None], tl.where(col == 1, lo[:, None], tl.where(col == 2, lo2[:, None], 0.0)))
    if ONES:
        side = tl.where(col == 3, 1.0, side)
    return side if UPCAST else side.to(DT)


@triton.jit
def side_columns(side, scale):
    """(v·x, column 3) [R] in fp64 from a reference-side accumulator [R, 16] (fp64): the three
    parts' sums added, divided by the vector's scale (a power of two: exact)."""
    col = tl.arange(0, SIDE_N)[None, :]
    # each sum below has one nonzero term per row: exact
    hi = tl.sum(tl.where(col == 0, side, 0.0), axis=1)
    lo = tl.sum(tl.where(col == 1, side, 0.0), axis=1)
    lo2 = tl.sum(tl.where(col == 2, side, 0.0), axis=1)
    ones = tl.sum(tl.where(col == 3, side, 0.0), axis=1)
    return (hi + lo + lo2) / scale, ones
