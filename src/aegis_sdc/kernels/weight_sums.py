"""W·1 and Wᵀ·1 of a weight W [N, K] in one pass over it (fp64 sums), and their side matrices, in Triton.

The reference sides of a Linear's forward (c = Wᵀ·1 [K]) and dgrad (c = W·1 [N]) need both sums of
its weight once per step, as S matrices (kernels/gemm_side.py). Two launches per weight and step:

- `weight_blocks_kernel`: W cut into blocks of R rows × KC columns, one program each (a grid of
  ⌈N/R⌉·⌈K/KC⌉ programs: every SM busy, one read of W at full bandwidth); a program writes its
  block's row sums (`row_part` [⌈K/KC⌉, N]) and column sums (`col_part` [⌈N/R⌉, K]) in fp64.
- `weight_finish_kernel`: each sum over its parts in part order, and, for bf16 weights, its S row.

Every sum runs in one fixed order: the result is bit for bit the same on every run, as a replay
needs. fp16 weights take S from `SideMatrix.of` (its scale needs the vector's maximum first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aegis_sdc.kernels import triton_gemm as tg
from aegis_sdc.kernels.gemm_side import SIDE_COLUMNS, SideMatrix, store_side
from aegis_sdc.kernels.grid import ceil_div

BLOCK_ROWS = 128  # R: rows per program of `weight_blocks_kernel` (read BR at a time)
BLOCK_COLS = 256  # KC: columns per program
FINISH_BLOCK = 256  # sums per program of `weight_finish_kernel`


@triton.jit(do_not_specialize=["stride_w", "N", "K"])
def weight_blocks_kernel(w_ptr, stride_w, row_part_ptr, col_part_ptr, N, K, R: tl.constexpr, BR: tl.constexpr,
                         KC: tl.constexpr):  # fmt: skip
    rb = tl.program_id(0)  # row block
    kb = tl.program_id(1)  # column block
    ks = kb * KC + tl.arange(0, KC)
    kmask = ks < K
    col = tl.zeros((KC,), dtype=tl.float64)
    for r0 in range(rb * R, rb * R + R, BR):
        rows = r0 + tl.arange(0, BR)
        rmask = rows < N
        w = tl.load(w_ptr + rows[:, None] * stride_w + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = w.to(tl.float32).to(tl.float64)
        col += tl.sum(w, axis=0)
        tl.store(row_part_ptr + kb * N + rows, tl.sum(w, axis=1), mask=rmask)
    tl.store(col_part_ptr + rb * K + ks, col, mask=kmask)


@triton.jit
def _finish_sums(part_ptr, parts, size, sum_ptr, s_ptr, block, SIDE: tl.constexpr, DT: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    """Sums [block·BLOCK, (block+1)·BLOCK) of a vector of `size` over its `parts` (rows of part_ptr),
    in part order, and their S rows (SIDE)."""
    idx = block * BLOCK + tl.arange(0, BLOCK)
    mask = idx < size
    total = tl.zeros((BLOCK,), dtype=tl.float64)
    for j in range(parts):
        total += tl.load(part_ptr + j * size + idx, mask=mask, other=0.0)
    tl.store(sum_ptr + idx, total, mask=mask)
    if SIDE:
        store_side(s_ptr, idx, mask, total, DT)


@triton.jit(do_not_specialize=["N", "K", "row_parts", "col_parts", "row_programs"])
def weight_finish_kernel(row_part_ptr, col_part_ptr, row_sum_ptr, col_sum_ptr, s_row_ptr, s_col_ptr, N, K,
                         row_parts, col_parts, row_programs, SIDE: tl.constexpr, DT: tl.constexpr,
                         BLOCK: tl.constexpr):  # fmt: skip
    """Programs [0, row_programs) finish W·1 (row_parts parts of N), the rest Wᵀ·1 (col_parts of K)."""
    p = tl.program_id(0)
    if p < row_programs:
        _finish_sums(row_part_ptr, row_parts, N, row_sum_ptr, s_row_ptr, p, SIDE, DT, BLOCK)
    else:
        _finish_sums(col_part_ptr, col_parts, K, col_sum_ptr, s_col_ptr, p - row_programs, SIDE, DT, BLOCK)


def weight_sides(w: torch.Tensor, sides: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                                torch.Tensor | None]:  # fmt: skip
    """(Wᵀ·1 [K], W·1 [N]) in fp64 for W [N, K], in one pass over W, and — `sides` and bf16 — their S
    matrices [K, 16] and [N, 16] written by the same two launches (else None)."""
    n, k = w.shape
    if w.stride(1) != 1:
        w = w.contiguous()
    rows, cols, finish = (32, 32, 32) if tg.INTERPRET else (BLOCK_ROWS, BLOCK_COLS, FINISH_BLOCK)
    row_parts, col_parts = ceil_div(k, cols), ceil_div(n, rows)
    side = sides and w.dtype == torch.bfloat16
    dev, f64 = w.device, torch.float64
    row_part = torch.empty(row_parts, n, dtype=f64, device=dev)
    col_part = torch.empty(col_parts, k, dtype=f64, device=dev)
    row_sum = torch.empty(n, dtype=f64, device=dev)
    col_sum = torch.empty(k, dtype=f64, device=dev)
    s_row = torch.empty(n, SIDE_COLUMNS, dtype=w.dtype, device=dev) if side else row_sum
    s_col = torch.empty(k, SIDE_COLUMNS, dtype=w.dtype, device=dev) if side else col_sum
    variant = (dev, w.dtype, tg._wide(w.stride(0), n, k, row_parts * n, col_parts * k))
    tg._launch(weight_blocks_kernel, (col_parts, row_parts), (w, w.stride(0), row_part, col_part, n, k),
               dict(R=rows, BR=32, KC=cols), dict(num_warps=4), variant)  # fmt: skip
    row_programs = ceil_div(n, finish)
    tg._launch(weight_finish_kernel, (row_programs + ceil_div(k, finish),),
               (row_part, col_part, row_sum, col_sum, s_row, s_col, n, k, row_parts, col_parts, row_programs),
               dict(SIDE=side, DT=tg._TL_DTYPES[w.dtype], BLOCK=finish), dict(num_warps=4), variant)  # fmt: skip
    return col_sum, row_sum, (s_col if side else None), (s_row if side else None)


def weight_side_matrices(w: torch.Tensor) -> tuple[SideMatrix, SideMatrix]:
    """(S(Wᵀ·1), S(W·1)): the forward's and the dgrad's reference sides of the weight W [N, K]."""
    col_sum, row_sum, s_col, s_row = weight_sides(w)
    if s_col is None:  # fp16 (or fp32 under the interpreter): S needs a scale from the whole vector
        return SideMatrix.of(col_sum, w.dtype), SideMatrix.of(row_sum, w.dtype)
    return SideMatrix.written_by_kernel(col_sum, s_col), SideMatrix.written_by_kernel(row_sum, s_row)
