"""Reference checked GEMM in plain PyTorch: C = A·B with checksums of the fp32 accumulator.

Shapes: A [M, K], B [K, N], C [M, N]. The product is accumulated in fp32, checksummed, and only
then rounded to the output dtype (bf16/fp16/fp32), so rounding noise of the output never hides a
small corruption of the accumulator.

Checksums (taken from the fp32 accumulator, before rounding):

    row:  C·1        [M]  against  A·(B·1)      one value per row
    col:  1ᵀC        [N]  against  (1ᵀA)·B      one value per column

The checksum arithmetic itself (the sums of accumulator values, B·1, A·(B·1), (1ᵀA)·B) runs in
fp64. Its own rounding then vanishes next to the fp32 accumulator's, so the only noise a clean
check sees is the GEMM's accumulation error — the floor any accumulator checksum must live with.
Summing in fp32 instead adds an error that grows with the *mean* of the summed values: column sums
over thousands of correlated tokens carried it at 5–30× the accumulation noise on the workload,
and it changed with the training phase.

Normalization. A checksum difference is divided by u·s with u = 2⁻²⁴ (fp32 unit roundoff) and

    s_i = sqrt( Σ_k A_ik² ‖B_k,:‖² )      (rows),      s_j = sqrt( Σ_k ‖A_:,k‖² B_kj² )   (cols)

the root-sum-square of the products feeding the checksum: the accumulation error grows with exactly
that magnitude, so the normalized difference is scale-free and a threshold calibrated early stays
valid while activations and weights drift.

Reduction order. The GEMM is computed tile by tile, each tile by one `torch.mm` on freshly
allocated fp32 copies of a row block of A and a column block of B, by the same function
(`_compute_region`) that `replay_region` calls: a healthy device reproduces a tile bit for bit. A
BLAS call over a different shape (one row alone, or the whole matrix) would not promise that.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from aegis_sdc.kernels.numerics import exact_fp32

U32 = 2.0**-24  # unit roundoff of fp32 (round to nearest)
TINY = torch.finfo(torch.float32).tiny
F32_MAX = torch.finfo(torch.float32).max


class AccumulatorCorruption(Protocol):
    """A fault model applied to one accumulator element (see aegis_sdc.faults.models)."""

    def element(self, rows: int, cols: int) -> tuple[int, int]: ...

    def corrupt(self, value: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Tiling:
    rows: int = 128
    cols: int = 128

    def ranges(self, size: int, block: int) -> Iterator[tuple[int, int]]:
        for start in range(0, size, block):
            yield start, min(start + block, size)


@dataclass
class GemmChecksums:
    """The output of a checked GEMM and everything the sensors and the replay need."""

    out: torch.Tensor  # [M, N] out dtype: round(acc + bias)
    row_partials: torch.Tensor  # [column tiles, M] fp64: Σ_j acc_ij within each column tile
    row_sum: torch.Tensor  # [M] fp64: the partials summed in tile order
    row_ref: torch.Tensor  # [M] fp64: A·(B·1)
    row_scale: torch.Tensor  # [M] fp64: s_i
    b_rowsum: torch.Tensor  # [K] fp64: B·1
    col_partials: torch.Tensor | None = None  # [row tiles, N] fp64: Σ_i acc_ij within each row tile
    col_sum: torch.Tensor | None = None  # [N]
    col_ref: torch.Tensor | None = None  # [N]: (1ᵀA)·B
    col_scale: torch.Tensor | None = None  # [N]: s_j


@dataclass
class RegionReplay:
    """A tile-aligned region (rows × columns) of a checked GEMM, as computed by one execution."""

    out: torch.Tensor  # [R, C] out dtype
    row_partials: torch.Tensor  # [column tiles of the region, R] fp64
    col_partials: torch.Tensor  # [row tiles of the region, C] fp64
    row_ref: torch.Tensor  # [R] fp64: A·(B·1)
    b_rowsum: torch.Tensor  # [K] fp64: B·1 (recomputed when B is whole, else the saved vector)


def fresh_fp32(t: torch.Tensor) -> torch.Tensor:
    """An fp32 copy in a new, contiguous, allocator-aligned buffer (see the module docstring)."""
    return t.to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)


def _epilogue(acc: torch.Tensor, bias32: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    return (acc if bias32 is None else acc + bias32).to(out_dtype)


def _compute_region(
    a_part: torch.Tensor,
    b_part: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    tiling: Tiling,
    b_rowsum: torch.Tensor,
    fault: AccumulatorCorruption | None,
    fault_at: tuple[int, int] | None,
) -> RegionReplay:
    """The tiles of rows `a_part` × columns `b_part`: output, fp64 partial checksums, A·(B·1).

    The one implementation of a checked GEMM's tiles, shared by the training step and the replay.
    """
    f64 = torch.float64
    device = a_part.device
    bias32 = None if bias is None else bias.to(torch.float32)
    rows, width = a_part.shape[0], b_part.shape[1]
    row_ranges = list(tiling.ranges(rows, tiling.rows))
    col_ranges = list(tiling.ranges(width, tiling.cols))
    b_slabs = [fresh_fp32(b_part[:, c0:c1]) for c0, c1 in col_ranges]
    out = torch.empty(rows, width, dtype=out_dtype, device=device)
    row_partials = torch.empty(len(col_ranges), rows, dtype=f64, device=device)
    col_partials = torch.empty(len(row_ranges), width, dtype=f64, device=device)
    row_ref = torch.empty(rows, dtype=f64, device=device)
    for i, (r0, r1) in enumerate(row_ranges):
        a32 = fresh_fp32(a_part[r0:r1])  # [r, K]
        row_ref[r0:r1] = torch.mv(a32.to(f64), b_rowsum)
        for j, (c0, c1) in enumerate(col_ranges):
            acc = torch.mm(a32, b_slabs[j])  # [r, c] the fp32 accumulator tile
            if fault is not None and fault_at is not None and r0 <= fault_at[0] < r1 and c0 <= fault_at[1] < c1:
                ti, tj = fault_at[0] - r0, fault_at[1] - c0
                acc[ti, tj] = fault.corrupt(acc[ti, tj])
            row_partials[j, r0:r1] = acc.sum(dim=1, dtype=f64)
            col_partials[i, c0:c1] = acc.sum(dim=0, dtype=f64)
            out[r0:r1, c0:c1] = _epilogue(acc, None if bias32 is None else bias32[c0:c1], out_dtype)
    return RegionReplay(out, row_partials, col_partials, row_ref, b_rowsum)


def b_row_sums(b: torch.Tensor) -> torch.Tensor:
    """B·1 [K] in fp64, from the fp32 values of B."""
    return fresh_fp32(b).sum(dim=1, dtype=torch.float64)


def checked_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    col_check: bool = False,
    tiling: Tiling = Tiling(),
    fault: AccumulatorCorruption | None = None,
) -> GemmChecksums:
    """C = A·B (+ bias per column) with fp32 accumulation and checksums of the accumulator.

    `fault`, when given, corrupts one accumulator element before the checksums and the rounding.
    """
    m, n = a.shape[0], b.shape[1]
    f64 = torch.float64
    with exact_fp32(a.device.type):
        fault_at = fault.element(m, n) if fault is not None and m and n else None
        b_rowsum = b_row_sums(b)
        region = _compute_region(
            a,
            b,
            out_dtype=out_dtype,
            bias=bias,
            tiling=tiling,
            b_rowsum=b_rowsum,
            fault=fault,
            fault_at=fault_at,
        )
        a64, b64 = a.to(f64), b.to(f64)
        a_sq, b_sq = a64 * a64, b64 * b64
        result = GemmChecksums(
            out=region.out,
            row_partials=region.row_partials,
            row_sum=region.row_partials.sum(dim=0),
            row_ref=region.row_ref,
            row_scale=torch.mv(a_sq, b_sq.sum(dim=1)).sqrt(),
            b_rowsum=b_rowsum,
        )
        if col_check:
            result.col_partials = region.col_partials
            result.col_sum = region.col_partials.sum(dim=0)
            result.col_ref = torch.mv(b64.t(), a64.sum(dim=0))  # (1ᵀA)·B
            result.col_scale = torch.mv(b_sq.t(), a_sq.sum(dim=0)).sqrt()
        return result


def replay_region(
    a_part: torch.Tensor,
    b_part: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    tiling: Tiling,
    b_rowsum: torch.Tensor | None = None,
    fault: AccumulatorCorruption | None = None,
    fault_at: tuple[int, int] | None = None,
) -> RegionReplay:
    """Recompute the tiles of rows `a_part` × columns `b_part` exactly as `checked_gemm` did.

    `a_part` [R, K] holds whole row tiles of A (one row block, or all of A); `b_part` [K, C] whole
    column tiles of B (one column block, or all of B); `bias` [C] matches `b_part`. `b_rowsum`
    (B·1) is recomputed from `b_part` when None (B is whole), else the saved vector is used.
    `fault` at `fault_at` (row, column within the region) models a persistent fault that also hits
    the replay.
    """
    with exact_fp32(a_part.device.type):
        return _compute_region(
            a_part,
            b_part,
            out_dtype=out_dtype,
            bias=bias,
            tiling=tiling,
            b_rowsum=b_row_sums(b_part) if b_rowsum is None else b_rowsum,
            fault=fault,
            fault_at=fault_at,
        )


def exact_violations(
    a_part: torch.Tensor,
    b_part: torch.Tensor,
    *,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    row_partials: torch.Tensor,
    tiling: Tiling,
) -> int:
    """Count saved values that no correct fp32 execution could have produced.

    An independent fp64 recomputation E = A·B (exact for bf16/fp16/fp32 operands up to a 2⁻⁵³
    relative term) bounds every correct fp32 result deterministically:
        |acc_ij − E_ij| ≤ γ_K Σ_k |A_ik||B_kj|,   γ_K ≈ K·u'
    with u' = 2⁻²³ (twice fp32's unit roundoff, to admit accumulators that truncate instead of
    rounding). A tile's fp64 row partial sum adds next to nothing, the output one rounding to its
    dtype. A saved value outside its bound is wrong on every device: this is how a fault that
    replays identically (a stuck unit) is still confirmed, never by guesswork.
    """
    with exact_fp32(a_part.device.type):
        a64 = a_part.to(torch.float64)
        b64 = b_part.to(torch.float64)
        exact = a64 @ b64  # [R, C]
        magnitude = a64.abs() @ b64.abs()  # Σ_k |A_ik||B_kj|
        k = a_part.shape[1]
        u2 = 2.0 * U32
        acc_bound = (k * u2 / (1 - k * u2) + 2.0**-52) * magnitude + 2.0 * TINY
        violations = 0
        ranges = list(tiling.ranges(b_part.shape[1], tiling.cols))
        for j, (c0, c1) in enumerate(ranges):
            width = c1 - c0
            part_exact = exact[:, c0:c1].sum(dim=1)
            # the partial is an fp64 sum of fp32 accumulators: its own rounding is 2⁻⁵² per term
            part_bound = acc_bound[:, c0:c1].sum(dim=1) * (1 + width * 2.0**-52) + width * 2.0**-52 * magnitude[
                :, c0:c1
            ].sum(dim=1)
            diff = (row_partials[j].to(torch.float64) - part_exact).abs()
            # fp32 overflow to ±inf is correct wherever a partial sum of the row's products could pass
            # fp32's range: each is at most the sum of magnitudes (the exact sum may cancel below it)
            overflowed = magnitude[:, c0:c1].sum(dim=1) + part_bound >= F32_MAX
            violations += int((~((diff <= part_bound) | overflowed)).sum())
        exact_out = exact if bias is None else exact + bias.to(torch.float64)
        info = torch.finfo(out.dtype)
        out_u = info.eps / 2  # unit roundoff of the output dtype
        out_bound = acc_bound * (1 + u2) + (2 * out_u + u2) * exact_out.abs() + info.tiny
        within = (out.to(torch.float64) - exact_out).abs() <= out_bound
        # rounding a value past the dtype's range to ±inf is correct, and so is an accumulator that
        # passed fp32's range on the way (its magnitude sum bounds every partial sum)
        overflowed = (exact_out.abs() >= info.max) | (magnitude >= F32_MAX)
        violations += int((~(within | overflowed)).sum())
        return violations


def bitwise_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads and signed zeros included)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if not x.numel():  # two empty tensors are equal wherever they live ("no column checks" is made on the host)
        return True
    if not x.is_floating_point():
        return torch.equal(x, y)
    int_dtype = {torch.float32: torch.int32, torch.float64: torch.int64}.get(x.dtype, torch.int16)
    return torch.equal(x.contiguous().view(int_dtype), y.contiguous().view(int_dtype))
