"""W·1 and Wᵀ·1 of a weight W [N, K] in one pass over it (fp64 sums), in Triton.

The reference sides of a Linear's forward (c = Wᵀ·1 [K]) and dgrad (c = W·1 [N]) need both sums of
its weight once per step. Program p owns rows [p·R, (p+1)·R): it walks K in chunks of BKC and, per
chunk, the rows in blocks of BR, so that a chunk's column sums over the program's rows complete in
registers (`col_part[p]`, summed over programs afterwards by one small reduction) while the row sums
accumulate chunk by chunk in the output (read-modify-write by the program that owns the rows). Every
sum runs in one fixed order: the result is bit for bit the same on every run, as a replay needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aegis_sdc.kernels.grid import ceil_div
from aegis_sdc.kernels.triton_gemm import INTERPRET, num_sms

PARTIALS_BYTES = 16 << 20  # cap on the column partials [programs, K] fp64


@triton.jit
def weight_sums_kernel(w_ptr, stride_w, row_sum_ptr, col_part_ptr, N, K, rows_per_program,
                       BR: tl.constexpr, BKC: tl.constexpr):  # fmt: skip
    p = tl.program_id(0)
    r_start = p * rows_per_program
    r_stop = tl.minimum(r_start + rows_per_program, N)
    for k0 in range(0, K, BKC):
        ks = k0 + tl.arange(0, BKC)
        kmask = ks < K
        col = tl.zeros((BKC,), dtype=tl.float64)
        for r0 in range(r_start, r_stop, BR):
            rows = r0 + tl.arange(0, BR)
            rmask = rows < r_stop
            w = tl.load(w_ptr + rows[:, None] * stride_w + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = w.to(tl.float32).to(tl.float64)
            col += tl.sum(w, axis=0)
            earlier = tl.load(row_sum_ptr + rows, mask=rmask & (k0 > 0), other=0.0)
            tl.store(row_sum_ptr + rows, earlier + tl.sum(w, axis=1), mask=rmask)
        tl.store(col_part_ptr + p * K + ks, col, mask=kmask)


def weight_sums(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Wᵀ·1 [K], W·1 [N]) in fp64 for W [N, K] with unit column stride, in one pass over W."""
    n, k = w.shape
    if w.stride(1) != 1:
        w = w.contiguous()
    programs = max(1, min(2 * num_sms(w.device), ceil_div(n, 32), PARTIALS_BYTES // (8 * k)))
    rows_per_program = ceil_div(n, programs)
    programs = ceil_div(n, rows_per_program)
    row_sum = torch.empty(n, dtype=torch.float64, device=w.device)
    col_part = torch.empty(programs, k, dtype=torch.float64, device=w.device)
    bkc = 32 if INTERPRET else 256
    weight_sums_kernel[(programs,)](w, w.stride(0), row_sum, col_part, n, k, rows_per_program, BR=32, BKC=bkc,
                                    num_warps=4)  # fmt: skip
    return col_part.sum(dim=0), row_sum
