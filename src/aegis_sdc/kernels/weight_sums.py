"""W·1 and Wᵀ·1 of a weight W [N, K] in one pass over it (fp64 sums), and their side matrices, in Triton.

The reference sides of a Linear's forward (c = Wᵀ·1 [K]) and dgrad (c = W·1 [N]) need both sums of
its weight once per step, as S matrices (kernels/gemm_side.py). Two launches per step for one weight,
or for a group of weights of one shape (`GroupSums`: a device table of their addresses and output
slots, a third grid dimension over the weights; a step's active weights of one shape together):

- `weight_blocks_kernel`: W cut into blocks of R rows × KC columns, one program each (a grid of
  ⌈N/R⌉·⌈K/KC⌉ programs: every SM busy, one read of W at full bandwidth); a program writes its
  block's row sums (`row_part` [⌈K/KC⌉, N]) and column sums (`col_part` [⌈N/R⌉, K]) in fp64.
- `weight_finish_kernel`: each sum over its parts in part order, and, for bf16 weights, its S row.

Every sum runs in one fixed order: the result is bit for bit the same on every run, as a replay
needs. fp16 weights take S from `SideMatrix.of` (its scale needs the vector's maximum first).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from aegis_sdc.kernels import triton_gemm as tg
from aegis_sdc.kernels.gemm_side import SIDE_COLUMNS, SIDE_N, SideMatrix, store_side
from aegis_sdc.kernels.grid import ceil_div

BLOCK_ROWS = 128  # R: rows per program of `weight_blocks_kernel` (read BR at a time)
BLOCK_COLS = 256  # KC: columns per program
FINISH_BLOCK = 256  # sums per program of `weight_finish_kernel`


@triton.jit(do_not_specialize=["stride_w", "N", "K"])
def weight_blocks_kernel(w_ptr, table_ptr, stride_w, row_part_ptr, col_part_ptr, N, K, GROUPED: tl.constexpr,
                         DT: tl.constexpr, R: tl.constexpr, BR: tl.constexpr, KC: tl.constexpr):  # fmt: skip
    """Block (program 0: rows, program 1: columns) of weight program 2: of `w_ptr`, or, GROUPED, of
    the weight whose address is table[g, 0] (all weights of a group share N, K, their row stride and
    dtype). Partials of weight g at row_part[g] [⌈K/KC⌉, N] and col_part[g] [⌈N/R⌉, K]."""
    rb = tl.program_id(0)  # row block
    kb = tl.program_id(1)  # column block
    g = tl.program_id(2).to(tl.int64)  # weight of the group
    if GROUPED:
        w_ptr = tl.load(table_ptr + 2 * g).to(tl.pointer_type(DT))
    row_part_ptr += g * tl.cdiv(K, KC) * N
    col_part_ptr += g * tl.cdiv(N, R) * K
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
def weight_finish_kernel(table_ptr, row_part_ptr, col_part_ptr, row_sum_ptr, col_sum_ptr, s_row_ptr, s_col_ptr, N, K,
                         row_parts, col_parts, row_programs, GROUPED: tl.constexpr, SIDE: tl.constexpr,
                         DT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Programs [0, row_programs) finish W·1 (row_parts parts of N), the rest Wᵀ·1 (col_parts of K),
    of weight program 1 — GROUPED: into slot table[g, 1] of the group's outputs ([slots, N], ...)."""
    p = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    slot = tl.load(table_ptr + 2 * g + 1) if GROUPED else g
    row_part_ptr += g * row_parts * N
    col_part_ptr += g * col_parts * K
    if p < row_programs:
        _finish_sums(row_part_ptr, row_parts, N, row_sum_ptr + slot * N, s_row_ptr + slot * N * SIDE_N, p, SIDE, DT,
                     BLOCK)  # fmt: skip
    else:
        _finish_sums(col_part_ptr, col_parts, K, col_sum_ptr + slot * K, s_col_ptr + slot * K * SIDE_N,
                     p - row_programs, SIDE, DT, BLOCK)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class WeightSideBuffers:
    """Where `weight_sides` writes one weight's results: kept by the caller and reused step after step."""

    col_sum: torch.Tensor  # fp64 [K]
    row_sum: torch.Tensor  # fp64 [N]
    s_col: torch.Tensor | None  # [K, 16] (bf16 weights)
    s_row: torch.Tensor | None  # [N, 16]

    @classmethod
    def empty(cls, w: torch.Tensor, sides: bool = True) -> WeightSideBuffers:
        n, k = w.shape
        dev, f64 = w.device, torch.float64
        side = sides and w.dtype == torch.bfloat16
        return cls(
            torch.empty(k, dtype=f64, device=dev),
            torch.empty(n, dtype=f64, device=dev),
            torch.empty(k, SIDE_COLUMNS, dtype=w.dtype, device=dev) if side else None,
            torch.empty(n, SIDE_COLUMNS, dtype=w.dtype, device=dev) if side else None,
        )

    def fits(self, w: torch.Tensor) -> bool:
        n, k = w.shape
        return (
            self.row_sum.shape[0] == n
            and self.col_sum.shape[0] == k
            and self.row_sum.device == w.device
            and (self.s_row is None) == (w.dtype != torch.bfloat16)
            and (self.s_row is None or self.s_row.dtype == w.dtype)
        )


def _block_sizes() -> tuple[int, int, int]:
    return (32, 32, 32) if tg.INTERPRET else (BLOCK_ROWS, BLOCK_COLS, FINISH_BLOCK)


def _launch_sums(w: torch.Tensor, table: torch.Tensor | None, count: int, out: WeightSideBuffers | GroupSums,
                 side: bool) -> None:  # fmt: skip
    """The two launches for `count` weights shaped like `w` (the weights of `table`, or `w` itself)."""
    n, k = w.shape
    rows, cols, finish = _block_sizes()
    row_parts, col_parts = ceil_div(k, cols), ceil_div(n, rows)
    dev, f64 = w.device, torch.float64
    row_part = tg._workspace(dev, "weight_row_part", (count * row_parts, n), f64)
    col_part = tg._workspace(dev, "weight_col_part", (count * col_parts, k), f64)
    row_sum, col_sum = out.row_sum, out.col_sum
    s_row = out.s_row if side else row_sum
    s_col = out.s_col if side else col_sum
    grouped = table is not None
    table = table if grouped else row_sum  # never read
    largest = max(count * row_parts * n, count * col_parts * k, max(row_sum.numel(), col_sum.numel()) * SIDE_COLUMNS)
    wide = tg._wide(w.stride(0), n, k, largest)
    variant = (dev, w.dtype, wide)
    tg._launch(weight_blocks_kernel, (col_parts, row_parts, count), (w, table, w.stride(0), row_part, col_part, n, k),
               dict(GROUPED=grouped, DT=tg._TL_DTYPES[w.dtype], R=rows, BR=32, KC=cols), dict(num_warps=4),
               variant)  # fmt: skip
    row_programs = ceil_div(n, finish)
    tg._launch(weight_finish_kernel, (row_programs + ceil_div(k, finish), count),
               (table, row_part, col_part, row_sum, col_sum, s_row, s_col, n, k, row_parts, col_parts, row_programs),
               dict(GROUPED=grouped, SIDE=side, DT=tg._TL_DTYPES[w.dtype], BLOCK=finish), dict(num_warps=4),
               variant)  # fmt: skip


def weight_sides(w: torch.Tensor, sides: bool = True, out: WeightSideBuffers | None = None) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """(Wᵀ·1 [K], W·1 [N]) in fp64 for W [N, K], in one pass over W, and — `sides` and bf16 — their S
    matrices [K, 16] and [N, 16] written by the same two launches (else None). Into `out` when given
    (nothing allocated: the per-block partials live in the shared workspace, consumed by the second
    launch in stream order)."""
    if w.stride(1) != 1:
        w = w.contiguous()
    side = sides and w.dtype == torch.bfloat16
    if out is None:
        out = WeightSideBuffers.empty(w, sides)
    _launch_sums(w, None, 1, out, side)
    return out.col_sum, out.row_sum, (out.s_col if side else None), (out.s_row if side else None)


@dataclasses.dataclass(frozen=True)
class GroupSums:
    """The sums of a group of bf16 weights of one shape [N, K] and row stride, one slot per weight
    (slot i: `buffers(i)`): written by one pair of launches for the slots a step asks for."""

    col_sum: torch.Tensor  # fp64 [slots, K]
    row_sum: torch.Tensor  # fp64 [slots, N]
    s_col: torch.Tensor  # bf16 [slots, K, 16]
    s_row: torch.Tensor  # bf16 [slots, N, 16]

    @classmethod
    def empty(cls, slots: int, n: int, k: int, device: torch.device) -> GroupSums:
        f64, bf16 = torch.float64, torch.bfloat16
        return cls(
            torch.empty(slots, k, dtype=f64, device=device),
            torch.empty(slots, n, dtype=f64, device=device),
            torch.empty(slots, k, SIDE_COLUMNS, dtype=bf16, device=device),
            torch.empty(slots, n, SIDE_COLUMNS, dtype=bf16, device=device),
        )

    def buffers(self, slot: int) -> WeightSideBuffers:
        return WeightSideBuffers(self.col_sum[slot], self.row_sum[slot], self.s_col[slot], self.s_row[slot])

    def compute(self, like: torch.Tensor, table: torch.Tensor) -> None:
        """Sums of the weights of `table` (int64 [G, 2] on the device: each weight's address and its
        slot here), all shaped and strided like `like`, in two launches."""
        if like.dtype != torch.bfloat16 or like.stride(1) != 1:
            raise ValueError("a weight group takes bf16 weights with contiguous rows")
        _launch_sums(like, table, table.shape[0], self, True)


def weight_side_matrices(w: torch.Tensor, out: WeightSideBuffers | None = None) -> tuple[SideMatrix, SideMatrix]:
    """(S(Wᵀ·1), S(W·1)): the forward's and the dgrad's reference sides of the weight W [N, K]."""
    col_sum, row_sum, s_col, s_row = weight_sides(w, out=out)
    if s_col is None:  # fp16 (or fp32 under the interpreter): S needs a scale from the whole vector
        return SideMatrix.of(col_sum, w.dtype), SideMatrix.of(row_sum, w.dtype)
    return SideMatrix.written_by_kernel(col_sum, s_col), SideMatrix.written_by_kernel(row_sum, s_row)
