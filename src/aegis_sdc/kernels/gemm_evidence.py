"""Evidence of the checked GEMM: per-row (column) normalized differences, the launch's verdict, captures.

The GEMM's tiles leave per-tile partials (accumulator sums and sums of squares, rounded-output sums)
and the reference sides per K slice (tile j of a row block computed slice j of its A·c). The
evidence of a row (a column, under a column check) is its normalized difference |C·1 − A·c| /
(u·‖C_i‖), u = 2⁻²⁴, from those sums taken in fp64; the launch keeps the largest as a packed
(value, index) in its evidence slot. When every row and column is judged, one program compares the
maxima with the site's thresholds and, on an alarm, copies the replay context into a free slot of
the capture pool.

Two ways to run it (`TritonGemmConfig.inline_evidence`); either also finishes the by-product A·1
(and its S) that a later wgrad check reads, also for an unchecked call that asks for it:
- inline (the default): inside the GEMM launch, so a checked GEMM is one launch. Every tile adds its
  share to fp64 totals [3·M + 2·N] of the launch with relaxed atomics (`add_totals`: row sums and
  sums of squares of its accumulator, minus its K slice of A·c, plus its slice of A·1; the same per
  column for a column check); once its tiles are done, each program fences once and counts them
  into their row and column blocks (triton_gemm._finish_program_blocks); the program whose count
  completes a block reads that block's totals and leaves them zero by atomic exchange
  (`take_totals`), judges it into the slot and writes its by-product (`finish_rows`,
  `finish_cols`: all the blocks one program's counts completed at once); the launch's last program
  concludes (`count_done`, `conclude_slot`).
  Finishing is spread over the launch: no program judges the whole GEMM at its end. The order of
  the fp64 additions varies from launch to launch; the evidence moves by fp64 rounding of its terms
  only (~1e-16), nothing a verdict can see, and the partials a replay compares stay per tile and
  bit-exact. With `TritonGemmConfig.inline_totals` off, the tiles add nothing: the completing
  program sums the block's stored partials and side slices in their fixed order
  (`finish_row_block_parts`, `finish_col_block_parts`, as the second launch does) — no fp64 atomics
  in the tiles, more reads at the finish, and the slot's maxima bit for bit the second launch's.
- `evidence_kernel`: a second launch right after the GEMM on the same stream, one program per block,
  sums in a fixed order.

Layout of the evidence slot (int64 [STATS_LEN]), decoded by sensors.gemm.decode_triton_stats.
"""

from __future__ import annotations

import triton
import triton.language as tl

from aegis_sdc.kernels.gemm_side import store_side

# Kernels may read module globals only when they are tl.constexpr.
U32 = tl.constexpr(2.0**-24)
TINY = tl.constexpr(1.1754943508222875e-38)
NAN_VALUE = tl.constexpr(3.0e38)  # a non-finite difference is folded into the maximum as this (and flagged)

ST_ROW, ST_COL, ST_NONFINITE, ST_ALARM, ST_SLOT, ST_EVIDENCE_DONE, ST_ROW_L2SQ, ST_COL_L2SQ = range(8)
STATS_LEN = 8
_ST_ROW, _ST_COL, _ST_NONFINITE, _ST_ALARM, _ST_SLOT, _ST_EVIDENCE_DONE, _ST_ROW_L2SQ, _ST_COL_L2SQ = (
    tl.constexpr(i) for i in range(8)
)
# Capture kinds (constexpr): what the concluding program copies on an alarm
CAPTURE_NONE, CAPTURE_ROWS, CAPTURE_TILE = 0, 1, 2


@triton.jit
def _pack(value, index):
    """(non-negative fp32 value, int index) → int64 whose order is the value's, then the index's."""
    bits = value.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64)
    return (bits << 32) | index.to(tl.int64)


@triton.jit
def _unpack_value(packed):
    return (packed >> 32).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _sum_parts(ptr, parts, size, offs, mask, PCHUNK: tl.constexpr):
    """Σ_j ptr[j, offs] in fp64 over the `parts` rows of a [parts, size] array, PCHUNK rows per load
    (one load per row would leave the finishing program waiting on memory latency, part by part)."""
    total = tl.zeros(offs.shape, dtype=tl.float64)
    for p0 in range(0, parts, PCHUNK):
        p = p0 + tl.arange(0, PCHUNK)
        m = (p < parts)[:, None] & mask[None, :]
        v = tl.load(ptr + p[:, None] * size + offs[None, :], mask=m, other=0.0, cache_modifier=".cg")
        total += tl.sum(v.to(tl.float64), axis=0)
    return total


@triton.jit
def judge_block(total, sq, offs, mask, stats_ptr, stats_f64_ptr, SLOT: tl.constexpr, L2_SLOT: tl.constexpr):
    """Rows (columns) `offs` [R] — one block, or the blocks one program completed together: from their
    fp64 differences Σ − ref and sums of squares [R], the normalized differences |Σ − ref| / (u·√Σsq)
    folded into the launch's slot by atomics — the packed (value, index) maximum (the smallest row of
    a tie), the non-finite flag, Σ (Σ − ref)² (a statistic: order-free is fine). A sum of squares
    that overflowed fp32 (|C| ≳ 10¹⁹) counts as non-finite."""
    raw = tl.where(mask, tl.abs(total), 0.0)
    tl.atomic_add(stats_f64_ptr + L2_SLOT, tl.sum(raw * raw, axis=0))
    diff = raw / tl.maximum(U32 * tl.sqrt(sq), TINY)
    nonfinite = (diff != diff) | (diff == float("inf")) | (sq == float("inf"))
    diff = tl.where(nonfinite, NAN_VALUE, diff)
    diff = tl.where(mask, diff, 0.0).to(tl.float32)
    worst = tl.max(diff, axis=0)
    tl.atomic_max(stats_ptr + SLOT, _pack(worst, tl.min(tl.where(mask & (diff == worst), offs, 2**31 - 1), axis=0)))
    any_nonfinite = tl.max((nonfinite & mask).to(tl.int32), axis=0)
    if any_nonfinite > 0:
        tl.atomic_max(stats_ptr + _ST_NONFINITE, any_nonfinite.to(tl.int64))


@triton.jit
def block_evidence(part_ptr, sq_ptr, ref_ptr, parts, ref_parts, size, start, stats_ptr, stats_f64_ptr,
                   SLOT: tl.constexpr, L2_SLOT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Finish one row (or column) block: fp64 sums of its partials, normalized difference, packed max.

    `part_ptr`, `sq_ptr` [parts, size]: accumulator sums and sums of squares per tile; `ref_ptr`
    [ref_parts, size]: the reference side per K slice. A sum of squares that
    overflowed fp32 (|C| ≳ 10¹⁹) counts as non-finite."""
    offs = start + tl.arange(0, BLOCK)
    mask = offs < size
    total = _sum_parts(part_ptr, parts, size, offs, mask, 16)
    sq = _sum_parts(sq_ptr, parts, size, offs, mask, 16)
    ref = _sum_parts(ref_ptr, ref_parts, size, offs, mask, 16)
    judge_block(total - ref, sq, offs, mask, stats_ptr, stats_f64_ptr, SLOT, L2_SLOT)


@triton.jit
def _copy_rows(src_ptr, src_stride, dst_ptr, row0, rows_total, width, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr):
    """dst[r, :width] = src[row0 + r, :width] for r < BLOCK_R (rows past rows_total are zero)."""
    r = tl.arange(0, BLOCK_R)
    rmask = (row0 + r) < rows_total
    for c0 in range(0, width, CHUNK):
        c = c0 + tl.arange(0, CHUNK)
        m = rmask[:, None] & (c < width)[None, :]
        v = tl.load(src_ptr + (row0 + r)[:, None] * src_stride + c[None, :], mask=m, other=0.0, cache_modifier=".cg")
        tl.store(dst_ptr + r[:, None] * width + c[None, :], v, mask=(c < width)[None, :])


@triton.jit
def _copy_cols(src_ptr, src_stride, dst_ptr, col0, cols_total, height, BLOCK_C: tl.constexpr, CHUNK: tl.constexpr):
    """dst[h, c] = src[h, col0 + c] for h < height, c < BLOCK_C (columns past cols_total are zero)."""
    c = tl.arange(0, BLOCK_C)
    cmask = (col0 + c) < cols_total
    for h0 in range(0, height, CHUNK):
        h = h0 + tl.arange(0, CHUNK)
        m = (h < height)[:, None] & cmask[None, :]
        v = tl.load(src_ptr + h[:, None] * src_stride + (col0 + c)[None, :], mask=m, other=0.0, cache_modifier=".cg")
        tl.store(dst_ptr + h[:, None] * BLOCK_C + c[None, :], v, mask=(h < height)[:, None])


@triton.jit
def _copy_parts(src_ptr, parts, size, start, dst_ptr, BLOCK: tl.constexpr):
    """dst[j, :BLOCK] = src[j, start:start + BLOCK] for the `parts` rows of a [parts, size] array."""
    offs = tl.arange(0, BLOCK)
    mask = start + offs < size
    for j in range(parts):
        v = tl.load(src_ptr + j * size + start + offs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(dst_ptr + j * BLOCK + offs, v)


@triton.jit
def _capture(a_ptr, b_ptr, row_part_ptr, out_part_ptr, col_part_ptr, rowref_ptr, colref_ptr,
             pool_data_ptr, pool_f32_ptr, pool_counter_ptr, stats_ptr, row0, col0, M, N, K, row_parts, col_parts,
             stride_a, stride_b, data_len, f32_len, POOL: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr,
             CAPTURE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """Copy the replay context of an alarm into a free slot of the capture pool.

    Slot, data part (operand dtype): A's row block [BM, K] ([K, BM] when A_T); for a tile capture
    also B's column block [BN, K] when B_T else [K, BN].
    Slot, fp64 part — rows capture (all tiles j of the row block): row_part [tiles_n, BM],
    out_part [tiles_n, BM], the row reference A·c per K slice [row_parts, BM]; tile capture (tile
    i, j): row_part [BM], out_part [BM], A·c per slice [row_parts, BM], col_part [BN], the column
    reference u1ᵀB per slice [col_parts, BN] (ops/triton_replay.TritonGemmCapture reads them).
    """
    slot = tl.atomic_add(pool_counter_ptr, 1)
    if slot < POOL:
        data = pool_data_ptr + slot * data_len
        f32 = pool_f32_ptr + slot * f32_len
        if A_T:
            _copy_cols(a_ptr, stride_a, data, row0, M, K, BM, 64)
        else:
            _copy_rows(a_ptr, stride_a, data, row0, M, K, BM, 64)
        if CAPTURE == 2:
            data += BM * K
            if B_T:
                _copy_rows(b_ptr, stride_b, data, col0, N, K, BN, 64)
            else:
                _copy_cols(b_ptr, stride_b, data, col0, N, K, BN, 64)
            i = row0 // BM
            j = col0 // BN
            _copy_parts(row_part_ptr + j * M, 1, M, row0, f32, BM)
            _copy_parts(out_part_ptr + j * M, 1, M, row0, f32 + BM, BM)
            _copy_parts(rowref_ptr, row_parts, M, row0, f32 + 2 * BM, BM)
            f32 += (2 + row_parts) * BM
            _copy_parts(col_part_ptr + i * N, 1, N, col0, f32, BN)
            _copy_parts(colref_ptr, col_parts, N, col0, f32 + BN, BN)
        else:
            tiles_n = tl.cdiv(N, BN)
            _copy_parts(row_part_ptr, tiles_n, M, row0, f32, BM)
            _copy_parts(out_part_ptr, tiles_n, M, row0, f32 + tiles_n * BM, BM)
            _copy_parts(rowref_ptr, row_parts, M, row0, f32 + 2 * tiles_n * BM, BM)
        tl.store(stats_ptr + _ST_SLOT, (slot + 1).to(tl.int64))


@triton.jit
def conclude(row_packed, col_packed, nonfinite, stats_ptr, a_ptr, b_ptr, row_part_ptr, out_part_ptr, col_part_ptr,
             rowref_ptr, colref_ptr, pool_data_ptr, pool_f32_ptr, pool_counter_ptr, row_threshold, col_threshold, M, N,
             K, row_parts, col_parts, stride_a, stride_b, data_len, f32_len, ROW_CHECK: tl.constexpr,
             COL_CHECK: tl.constexpr,
             CAPTURE: tl.constexpr, POOL: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """The launch's verdict from its packed row and column maxima and non-finite flag: the maxima
    against thresholds, the alarm bits (1 rows, 2 columns), and on an alarm the capture of the worst
    row's (and column's) block."""
    row_alarm = ((_unpack_value(row_packed) > row_threshold) | (nonfinite > 0)) & ROW_CHECK
    col_alarm = (_unpack_value(col_packed) > col_threshold) & COL_CHECK
    alarm = row_alarm.to(tl.int64) + 2 * col_alarm.to(tl.int64)
    tl.store(stats_ptr + _ST_ALARM, alarm)
    tl.store(stats_ptr + _ST_EVIDENCE_DONE, 1)
    if CAPTURE != 0:  # noqa: SIM102  (a compile-time branch around a run-time one)
        if alarm != 0:
            _capture(a_ptr, b_ptr, row_part_ptr, out_part_ptr, col_part_ptr, rowref_ptr, colref_ptr,
                     pool_data_ptr, pool_f32_ptr, pool_counter_ptr, stats_ptr,
                     ((row_packed & 0xFFFFFFFF) // BM) * BM, ((col_packed & 0xFFFFFFFF) // BN) * BN,
                     M, N, K, row_parts, col_parts, stride_a, stride_b, data_len, f32_len,
                     POOL, A_T, B_T, CAPTURE, BM, BN)  # fmt: skip


@triton.jit
def add_totals(total_ptr, offs, mask, values):
    """Inline evidence: a tile's fp64 values [R] added to the launch's totals at offs. Relaxed
    atomics nobody waits on. Their order is the arrival order: a total of a few dozen fp32 sums and
    references moves by ~1e-16 of its terms from one order to another, where a clean difference is
    ~1e-7 of them and the thresholds are in units of 2⁻²⁴ — nothing a verdict can see."""
    tl.atomic_add(total_ptr + offs, values, mask=mask, sem="relaxed", scope="gpu")


@triton.jit
def fence_gpu(INTERPRETED: tl.constexpr):
    """Every thread's `fence.acq_rel.gpu` (CUDA's __threadfence): its own earlier writes and atomics
    are visible at gpu scope before its later ones. Before a CTA barrier and one thread's release of
    a counter, it publishes all threads' totals (the release alone orders only its own thread's;
    without the fence the finishing program read totals that other programs' atomics had not reached).
    The interpreter runs programs one after another: nothing to order there."""
    if not INTERPRETED:
        tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.b32 $0, $1;", "=r,r", [tl.arange(0, 256)],
                                  dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@triton.jit
def take_totals(total_ptr, offs, mask):
    """The program that finishes blocks: totals [R] at offs read and put back to zero in one atomic
    exchange each (fp64 moved as its int64 bits; masked lanes read 0).

    Why atomics: with plain loads and stores of zero there (`.cg`, or volatile), 6–9% of the
    launches of a protected 1.1B-model step judged wrong totals — among them rows whose dY is zero,
    whose every addition is 0, read non-zero (normalized differences of 1e26–1e34 against ~10² from
    the same GEMM's second-launch evidence: the comparison `benchmarks/evidence_shadow.py` makes),
    although every program fences before it counts itself done. The exchange is an atomic at the
    same point of coherence as the tiles' additions, and it reads and zeroes in one step: 0
    disagreements in the same runs, and no slower (benchmarks/results/alarms/README.md)."""
    bits = tl.atomic_xchg(total_ptr.to(tl.pointer_type(tl.int64)) + offs, tl.zeros(offs.shape, dtype=tl.int64),
                          mask=mask, sem="relaxed", scope="gpu")  # fmt: skip
    return tl.where(mask, bits.to(tl.float64, bitcast=True), 0.0)


@triton.jit
def finish_rows(totals_ptr, stats_ptr, stats_f64_ptr, byproduct_ptr, offs, mask, M, ROW_CHECK: tl.constexpr,
                ONES: tl.constexpr, BYPRODUCT: tl.constexpr):  # fmt: skip
    """Inline evidence, by the program whose counts complete row blocks: the rows `offs` [R] of those
    blocks (all of them at once: their exchanges in flight together), their totals taken (and left
    zero) — the row evidence folded into the slot, the by-product A·1 stored; A·1 [R] returned
    (with ONES) for the caller to store its S (`store_side`) block by block."""
    if ROW_CHECK:
        diff = take_totals(totals_ptr, offs, mask)
        sq = take_totals(totals_ptr + M, offs, mask)
        judge_block(diff, sq, offs, mask, stats_ptr, stats_f64_ptr, _ST_ROW, _ST_ROW_L2SQ)
    ones = tl.zeros(offs.shape, dtype=tl.float64)
    if ONES:
        ones = take_totals(totals_ptr + 2 * M, offs, mask)
        if BYPRODUCT:
            tl.store(byproduct_ptr + offs, ones, mask=mask)
    return ones


@triton.jit
def finish_cols(totals_ptr, stats_ptr, stats_f64_ptr, offs, mask, M, N):
    """Inline evidence, by the program whose counts complete column blocks: the columns `offs` [R] of
    those blocks, their totals taken (and left zero), the column evidence folded into the slot."""
    diff = take_totals(totals_ptr + 3 * M, offs, mask)
    sq = take_totals(totals_ptr + 3 * M + N, offs, mask)
    judge_block(diff, sq, offs, mask, stats_ptr, stats_f64_ptr, _ST_COL, _ST_COL_L2SQ)


@triton.jit
def count_done(counter_ptr, expected):
    """Count one more contribution to a launch (or block) whose `expected` contributions complete it;
    whether this one completed it (then the counter is put back to zero for the next launch). The
    caller has fenced its writes (`fence_gpu`) and joined its threads: the acq_rel count publishes them
    to the completing program and, there, acquires everyone's."""
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = done == expected - 1
    if last:
        tl.store(counter_ptr, 0)
    return last


@triton.jit
def conclude_slot(stats_ptr, a_ptr, b_ptr, row_part_ptr, out_part_ptr, col_part_ptr, rowref_ptr, colref_ptr,
                  pool_data_ptr, pool_f32_ptr, pool_counter_ptr, row_threshold, col_threshold, M, N, K, row_parts,
                  col_parts, stride_a, stride_b, data_len, f32_len, ROW_CHECK: tl.constexpr,
                  COL_CHECK: tl.constexpr, CAPTURE: tl.constexpr, POOL: tl.constexpr, A_T: tl.constexpr,
                  B_T: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """The launch's last program, once every block is judged: the blocks' atomic maxima read by
    atomics (as `take_totals` reads the totals: at the point of coherence of the blocks' atomics),
    then the verdict (`conclude`)."""
    row_packed = tl.atomic_add(stats_ptr + _ST_ROW, 0, sem="relaxed", scope="gpu")
    col_packed = tl.atomic_add(stats_ptr + _ST_COL, 0, sem="relaxed", scope="gpu")
    nonfinite = tl.atomic_add(stats_ptr + _ST_NONFINITE, 0, sem="relaxed", scope="gpu")
    conclude(row_packed, col_packed, nonfinite, stats_ptr, a_ptr, b_ptr, row_part_ptr, out_part_ptr, col_part_ptr,
             rowref_ptr, colref_ptr, pool_data_ptr, pool_f32_ptr, pool_counter_ptr, row_threshold, col_threshold, M, N,
             K, row_parts, col_parts, stride_a, stride_b, data_len, f32_len, ROW_CHECK, COL_CHECK, CAPTURE, POOL, A_T,
             B_T, BM, BN)  # fmt: skip


@triton.jit
def finish_byproduct(rowones_ptr, parts, M, start, byproduct_ptr, side_out_ptr, BYPRODUCT: tl.constexpr,
                     SIDE_OUT: tl.constexpr, DT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """A·1 of rows [start, start + BLOCK): its K slices summed in fp64 in slice order, stored as the
    by-product (fp64 [M]) and as S(A·1) [M, 16] (gemm_side.store_side)."""
    offs = start + tl.arange(0, BLOCK)
    mask = offs < M
    ones = _sum_parts(rowones_ptr, parts, M, offs, mask, 16)
    if BYPRODUCT:
        tl.store(byproduct_ptr + offs, ones, mask=mask)
    if SIDE_OUT:
        store_side(side_out_ptr, offs, mask, ones, DT)


@triton.jit
def finish_row_block_parts(row_part_ptr, rsq_part_ptr, rowref_ptr, rowones_ptr, tiles_n, row_parts, M, start,
                           stats_ptr, stats_f64_ptr, byproduct_ptr, side_out_ptr, ROW_CHECK: tl.constexpr,
                           BYPRODUCT: tl.constexpr, SIDE_OUT: tl.constexpr, DT: tl.constexpr,
                           BLOCK: tl.constexpr):  # fmt: skip
    """Row block [start, start + BLOCK) from the tiles' stored partials and side slices, summed in their
    fixed order: the row evidence folded into the slot, the by-product A·1 and its S stored (the
    second launch's row blocks, and the inline finish without totals)."""
    if ROW_CHECK:
        block_evidence(row_part_ptr, rsq_part_ptr, rowref_ptr, tiles_n, row_parts, M, start, stats_ptr, stats_f64_ptr,
                       _ST_ROW, _ST_ROW_L2SQ, BLOCK)  # fmt: skip
    if BYPRODUCT or SIDE_OUT:
        finish_byproduct(rowones_ptr, row_parts, M, start, byproduct_ptr, side_out_ptr, BYPRODUCT, SIDE_OUT, DT, BLOCK)


@triton.jit
def finish_col_block_parts(col_part_ptr, csq_part_ptr, colref_ptr, tiles_m, col_parts, N, start, stats_ptr,
                           stats_f64_ptr, BLOCK: tl.constexpr):  # fmt: skip
    """Column block [start, start + BLOCK) from the tiles' stored partials and side slices."""
    block_evidence(col_part_ptr, csq_part_ptr, colref_ptr, tiles_m, col_parts, N, start, stats_ptr, stats_f64_ptr,
                   _ST_COL, _ST_COL_L2SQ, BLOCK)  # fmt: skip


@triton.jit(do_not_specialize=["M", "N", "K", "row_parts", "col_parts", "stride_a", "stride_b", "data_len", "f32_len"])
def evidence_kernel(
    a_ptr,
    b_ptr,
    row_part_ptr,
    rsq_part_ptr,
    out_part_ptr,
    col_part_ptr,
    csq_part_ptr,
    rowref_ptr,  # [row_parts, M] fp64: A·c per K slice
    rowones_ptr,  # [row_parts, M] fp64: A·1 per K slice
    colref_ptr,  # [col_parts, N] fp64: u1ᵀB per K slice
    byproduct_ptr,  # [M] fp64 out (BYPRODUCT): A·1
    side_out_ptr,  # [M, 16] out (SIDE_OUT): S(A·1), the by-product as a later wgrad's side reads it
    counter_ptr,  # int32 [1]: zero before, left zero after
    stats_ptr,
    stats_f64_ptr,  # the same slot as fp64 (the L2 statistics)
    pool_data_ptr,
    pool_f32_ptr,
    pool_counter_ptr,
    row_threshold,
    col_threshold,
    M,
    N,
    K,
    row_parts,
    col_parts,
    stride_a,
    stride_b,
    data_len,
    f32_len,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    ROW_CHECK: tl.constexpr,
    COL_CHECK: tl.constexpr,
    CAPTURE: tl.constexpr,
    POOL: tl.constexpr,
    BYPRODUCT: tl.constexpr,
    SIDE_OUT: tl.constexpr,
    DT: tl.constexpr,  # the operands' dtype (of S(A·1))
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """The evidence as a second launch: one program per row block (then per column block); the last
    program to finish concludes. A row block's program also sums the by-product A·1 when asked."""
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    pid = tl.program_id(0)
    row_blocks = tiles_m if (ROW_CHECK or BYPRODUCT or SIDE_OUT) else 0
    if pid < row_blocks:
        finish_row_block_parts(row_part_ptr, rsq_part_ptr, rowref_ptr, rowones_ptr, tiles_n, row_parts, M, pid * BM,
                               stats_ptr, stats_f64_ptr, byproduct_ptr, side_out_ptr, ROW_CHECK, BYPRODUCT, SIDE_OUT,
                               DT, BM)  # fmt: skip
    else:
        finish_col_block_parts(col_part_ptr, csq_part_ptr, colref_ptr, tiles_m, col_parts, N, (pid - row_blocks) * BN,
                               stats_ptr, stats_f64_ptr, BN)  # fmt: skip
    if ROW_CHECK or COL_CHECK:  # noqa: SIM102  (a compile-time branch around a run-time one)
        if count_done(counter_ptr, tl.num_programs(0)):
            conclude_slot(stats_ptr, a_ptr, b_ptr, row_part_ptr, out_part_ptr, col_part_ptr, rowref_ptr, colref_ptr,
                          pool_data_ptr, pool_f32_ptr, pool_counter_ptr, row_threshold, col_threshold, M, N, K,
                          row_parts, col_parts, stride_a, stride_b, data_len, f32_len, ROW_CHECK, COL_CHECK, CAPTURE,
                          POOL, A_T, B_T, BM, BN)  # fmt: skip
