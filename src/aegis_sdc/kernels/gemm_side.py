"""The reference side of the checked GEMM on the tensor cores: the side matrix S and its Triton helpers.

A row check compares the row sums of the fp32 accumulator, C·1, with A·c for c = B·1. The kernel
takes A·c as a narrow MMA on A's tiles, A [BM, BK] · S [BK, 16], each tile of a row block over its
own K slice (kernels/triton_gemm.py), with S [K, 16] in the operand dtype:

    columns 0, 1, 2:  c_hi, c_lo, c_lo2 — c·2ᵉ split into three parts (hi = rounded, lo = the rest
                      rounded, lo2 = what is still left), so hi + lo + lo2 = c·2ᵉ to three times the
                      dtype's precision (bf16: 24 bits, fp32-level); the products with A are exact in
                      fp32 and accumulate in fp32 like the main MMA's
    column 3:         ones: A·1, the by-product a later wgrad check of the same Linear needs
    columns 4–15:     zeros (tl.dot takes no operand dimension under 16)

The three columns' sums are added in fp64 after each slice and divided by 2ᵉ. 2ᵉ is 1 for bf16
(fp32's range); for fp16 it brings max|c| to 2¹⁴ (fp16 holds at most 65504; the sum of a wide row of
activations does not fit), computed on the device, never read by the host. A column check takes
Bᵀ·S(u1) the same way on B's tiles.

S is built once per vector, not per tile: a weight's two S matrices once per weight and step
(with its sums), a by-product's S by the kernel that computes it (`store_side`), anything else by
`SideMatrix.of` — and the kernel loads [BK, 16] of it per K step through a TMA descriptor (built on
the device, `side_descriptor`), like an operand tile: it lands in shared memory, where the MMA reads it.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from aegis_sdc.kernels.grid import ceil_div

SIDE_N = tl.constexpr(16)  # columns of S
SIDE_COLUMNS = 16
FP16_SIDE_MAX_LOG2 = 14.0


@dataclasses.dataclass(frozen=True, eq=False)
class SideMatrix:
    """A vector v (fp64 [K]) and what the kernel reads of it: S [K, 16] (operand dtype) and 2ᵉ
    (fp32 [1], a device tensor)."""

    vec: torch.Tensor
    matrix: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def of(cls, vec: torch.Tensor, dtype: torch.dtype) -> SideMatrix:
        """S of an fp64 vector for operands of `dtype`: one launch (`side_matrix_kernel`; fp16 adds the
        vector's max|v| for its scale), no host read."""
        n = vec.shape[0]
        matrix = torch.empty(n, SIDE_COLUMNS, dtype=dtype, device=vec.device)
        fp16 = dtype == torch.float16
        scale = torch.empty(1, dtype=torch.float32, device=vec.device) if fp16 else _unit_scale(vec.device)
        vec = vec.contiguous()
        top = torch.linalg.vector_norm(vec, float("inf")).reshape(1) if fp16 and n else scale  # max|v|, fp16 only
        if n:
            side_matrix_kernel[(ceil_div(n, SIDE_BLOCK),)](
                vec, top, matrix, scale, n, FP16=fp16, DT=_TL_DTYPES[dtype], BLOCK=SIDE_BLOCK
            )
        elif fp16:
            scale.fill_(1.0)
        return cls(vec, matrix, scale)

    @classmethod
    def written_by_kernel(cls, vec: torch.Tensor, matrix: torch.Tensor) -> SideMatrix:
        """The S a checked launch wrote of its by-product (`store_side`: bf16, 2ᵉ = 1)."""
        return cls(vec, matrix, _unit_scale(vec.device))


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    """fp32 [1] = 1 on the device, made once (by-products are read every checked call)."""
    scale = _UNIT_SCALES.get(device)
    if scale is None:
        scale = _UNIT_SCALES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return scale


SIDE_BLOCK = 1024  # vector elements per program of `side_matrix_kernel`
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def side_matrix_kernel(vec_ptr, top_ptr, s_ptr, scale_ptr, n, FP16: tl.constexpr, DT: tl.constexpr,
                       BLOCK: tl.constexpr):  # fmt: skip
    """S [n, 16] of the fp64 vector v [n] (the module docstring's columns), for operands of type DT.

    fp16: 2ᵉ = 2^(14 − ⌈log₂ max|v|⌉) from max|v| (`top_ptr`, fp64 [1]), taken from the bits of its
    fp32 value — exact, where a float log₂ may be approximate on the GPU and land one power of two
    off (2¹⁶ would not fit fp16); program 0 stores it for the kernel that reads S."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < n
    v = tl.load(vec_ptr + rows, mask=mask, other=0.0)
    if FP16:
        top = tl.maximum(tl.load(top_ptr).to(tl.float32), 1e-30)
        bits = top.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) - 127
        ceil_log2 = exponent + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = ((14 - ceil_log2 + 127) << 23).to(tl.float32, bitcast=True)
        if tl.program_id(0) == 0:
            tl.store(scale_ptr, scale)
        v = v * scale.to(tl.float64)  # a power of two: exact
    hi = v.to(DT).to(tl.float64)
    rest = v - hi
    lo = rest.to(DT).to(tl.float64)
    lo2 = rest - lo
    col = tl.arange(0, SIDE_N)[None, :]
    s = tl.where(col == 0, hi[:, None], tl.where(col == 1, lo[:, None], lo2[:, None]))
    s = tl.where(col == 3, 1.0, tl.where(col > 3, 0.0, s))
    tl.store(s_ptr + rows[:, None] * SIDE_N + col, s.to(DT), mask=mask[:, None])


@triton.jit
def side_descriptor(s_ptr, K, BK: tl.constexpr):
    """A TMA descriptor over an S [K, 16] (contiguous rows of 32 or 64 bytes: TMA's 16-byte rule
    holds), loaded [BK, 16] at a time."""
    return tl.make_tensor_descriptor(s_ptr, shape=[K, SIDE_N], strides=[SIDE_N, 1], block_shape=[BK, SIDE_N])


@triton.jit
def load_side(s_desc, k0, UPCAST: tl.constexpr):
    """S's rows k0 … k0 + BK [BK, 16] (TMA fills rows past K with zeros)."""
    s = s_desc.load([k0, 0])
    return s.to(tl.float32) if UPCAST else s


@triton.jit
def store_side(s_ptr, rows, mask, v, DT: tl.constexpr):
    """S's rows `rows` [R] of the fp64 values v [R] (2ᵉ = 1: bf16 operands only)."""
    hi = v.to(tl.float32).to(DT).to(tl.float32)
    rest = v - hi.to(tl.float64)
    lo = rest.to(tl.float32).to(DT).to(tl.float32)
    lo2 = (rest - lo.to(tl.float64)).to(tl.float32).to(DT).to(tl.float32)
    col = tl.arange(0, SIDE_N)[None, :]
    s = tl.where(col == 0, hi[:, None], tl.where(col == 1, lo[:, None], tl.where(col == 2, lo2[:, None], 0.0)))
    s = tl.where(col == 3, 1.0, s)
    tl.store(s_ptr + rows[:, None] * SIDE_N + col, s.to(DT), mask=mask[:, None])


@triton.jit
def side_columns(side, scale):
    """(v·x, column 3) [R] in fp64 from a reference-side accumulator [R, 16] (fp64): the three
    parts' sums added, divided by 2ᵉ (a power of two: exact)."""
    col = tl.arange(0, SIDE_N)[None, :]
    # each sum below has one nonzero term per row: exact
    hi = tl.sum(tl.where(col == 0, side, 0.0), axis=1)
    lo = tl.sum(tl.where(col == 1, side, 0.0), axis=1)
    lo2 = tl.sum(tl.where(col == 2, side, 0.0), axis=1)
    ones = tl.sum(tl.where(col == 3, side, 0.0), axis=1)
    return (hi + lo + lo2) / scale.to(tl.float64), ones
