"""t·1 of a 2-D activation in fp64, in one launch: the wgrad's reference vectors X·1 and dY·1 when no
checked forward or dgrad left them as by-products (ops/triton_linear.py).

torch's `t.sum(dim=1, dtype=torch.float64)` of a bf16 tensor first converts the whole tensor to fp64
(ATen's reductions read their input in the output's dtype; only half → float is special-cased): a copy
four times the tensor's size written and read again. Timed on the H100 inside the budget's cost model,
the two passes of a sampled 1.1B-Llama q/o wgrad (8192 tokens × 2048) cost ~0.27 ms, five times the
checked GEMM's own extra time. Here each program sums ROWS rows over their columns, COLS at a time,
every value converted to fp64 on load (bf16, fp16 and fp32 values are exact in fp64): one read of the
tensor, nothing written but the sums — where the weight-sums kernels (kernels/weight_sums.py), which
also take the column sums, need a second launch and partial buffers. The order of the additions is
fixed by the kernel's constants, so a rerun gives the same bits (the wgrad's replay reuses the vector
the step used, and no other code recomputes it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aegis_sdc.kernels import triton_gemm as tg
from aegis_sdc.kernels.grid import ceil_div

ROWS = 16  # rows per program: 512 programs for 8192 tokens, several per SM to keep loads in flight
COLS = 256  # columns per load: [16, 256] bf16 = 8 KB


@triton.jit(do_not_specialize=["R", "C", "stride"])
def row_sums_kernel(t_ptr, out_ptr, R, C, stride, ROWS: tl.constexpr, COLS: tl.constexpr):
    """out[r] = Σ_c t[r, c] in fp64 for the rows of one program (t's columns contiguous)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < R
    row_start = rows.to(tl.int64) * stride
    acc = tl.zeros((ROWS, COLS), dtype=tl.float64)
    for c0 in range(0, C, COLS):
        cols = c0 + tl.arange(0, COLS)
        mask = row_mask[:, None] & (cols < C)[None, :]
        acc += tl.load(t_ptr + row_start[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32).to(tl.float64)
    tl.store(out_ptr + rows, tl.sum(acc, axis=1), mask=row_mask)


def triton_row_sums(t: torch.Tensor) -> torch.Tensor:
    """t·1 (fp64 [R]) of t [R, C] with contiguous columns (t.stride(1) == 1), on the device."""
    r, c = t.shape
    out = torch.empty(r, dtype=torch.float64, device=t.device)
    if r == 0:
        return out
    if c == 0:
        return out.zero_()
    rows, cols = (8, 32) if tg.INTERPRET else (ROWS, COLS)
    variant = (t.device, t.dtype, tg._wide(r, c, t.stride(0), r * t.stride(0)))
    tg._launch(row_sums_kernel, (ceil_div(r, rows),), (t, out, r, c, t.stride(0)), dict(ROWS=rows, COLS=cols),
               dict(num_warps=4), variant)  # fmt: skip
    return out
