"""Fused checked GEMM for CUDA tensors: C = A·B with checksums of the fp32 accumulator, in Triton.

One persistent kernel computes the GEMM tile by tile (TMA descriptors, fp32 accumulation, no
split-K: every tile is reduced by one program in one fixed K order wherever it sits, so a tile
replays bit for bit). What the checks add rides on work the kernel already does:

- reference side on the tensor cores (kernels/gemm_side.py): A·c as a narrow MMA A·S, S [K, 16]
  holding c = B·1 split into three parts of the operand dtype and a ones column (built once per
  vector, loaded [BK, 16] per K step by TMA) — A·c at fp32-level precision and A·1, the by-product a
  later wgrad check needs. The side is spread over the row block's tiles by K range: tile j of a
  row block computes slice j of tiles_n, after its own K loop, re-reading that slice's A tiles (from
  L2: the tile has just read them). The GEMM's K loop stays the unchecked loop with one MMA per step;
  every tile adds the same ~1/tiles_n of a narrow pass, so no tile straggles. (Measured before on the
  H200, the side inside the K loop of one column of tiles cost 3–25% of the GEMM: a second MMA in
  the loop stalled its pipeline, and in a single wave every other tile waited for those.) The
  slices are summed in fp64 in a fixed order by the evidence. A column check does the same with
  Bᵀ·S(u1), u1 = 1ᵀA, slice i in the tiles of row block i. No second pass over an activation.
  (Options, TritonGemmConfig: the row side over all of K as a second MMA in the K loop,
  `side_in_loop`; either side's slices inside the K loop on the CUDA cores, `side_on_cuda_cores`,
  `col_side_on_cuda_cores`.)
- epilogue: per tile, the row sums and row sums of squares of the fp32 accumulator before rounding
  and a checksum of each row of the rounded output (`_output_checksums`: integer sums of its bits)
  — `row_part`, `rsq_part`, `out_part` [tiles_n, M] — and for a
  column check the column sums and sums of squares, `col_part`, `csq_part` [tiles_m, N]. A row's
  difference is scaled by the accumulator row's own norm ‖C_i‖: for products of independent signs
  E‖C_i‖² = Σ_k A_ik²‖B_k,:‖², the reference path's scale (kernels/reference.py), here free in the
  epilogue instead of a pass over A².
- evidence (kernels/gemm_evidence.py): per block, fp64 sums of the partials and side slices, the
  normalized differences, a packed atomic maximum; then the verdict against the site's thresholds
  and, on an alarm, the capture of the replay context, with the by-product A·1 (and its S) for a
  later wgrad — inside this launch (`inline_evidence`, the default) or in a second.

Operand orientation (logical C[M, N] = A[M, K]·B[K, N]):
    A_T = False: `a` is A [M, K] row-major;   A_T = True: `a` is Aᵀ stored [K, M] row-major (wgrad's dYᵀ)
    B_T = True:  `b` is Bᵀ stored [N, K] (a Linear weight in forward);  B_T = False: `b` is B [K, N]

Under TRITON_INTERPRET=1 bf16 arithmetic is wrong in Triton's interpreter (bit patterns are
multiplied), so operands are upcast to fp32 after loading there (UPCAST); loads/stores stay exact,
and the reference-side parts are still split in the operand dtype before the upcast.
"""

from __future__ import annotations

import math
import os

import triton
import triton.language as tl

from aegis_sdc.kernels.gemm_evidence import (  # noqa: F401  (the evidence layout is part of this module's API)
    CAPTURE_NONE,
    CAPTURE_ROWS,
    CAPTURE_TILE,
    ST_ALARM,
    ST_COL,
    ST_COL_L2SQ,
    ST_EVIDENCE_DONE,
    ST_NONFINITE,
    ST_ROW,
    ST_ROW_L2SQ,
    ST_SLOT,
    STATS_LEN,
    add_totals,
    conclude_slot,
    count_done,
    evidence_kernel,
    fence_gpu,
    finish_col_block_parts,
    finish_cols,
    finish_row_block_parts,
    finish_rows,
)
from aegis_sdc.kernels.gemm_side import (
    SIDE_COLUMNS,
    SIDE_N,
    SideMatrix,
    load_side,
    side_columns,
    side_descriptor,
    store_side,
)
from aegis_sdc.kernels.grid import ceil_div

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# int32 slots from one evidence counter to the next: one 128-byte L2 line each, so that the tiles'
# counts into different row (column) blocks never queue at one line. Measured neutral on the H200
# against the counters packed side by side (benchmarks/gemm_diagnose.py --evidence-parts,
# `counters_packed`, within 1–3% either way); the evidence's inside-launch cost is in finishing the
# blocks (docs/gpu.md, "Where the evidence inside the launch costs").
COUNTER_STRIDE = tl.constexpr(32)
# Fault models (constexpr): 0 none, 1 perturb (add delta), 2 bitflip (xor bits)
FAULT_NONE, FAULT_PERTURB, FAULT_BITFLIP = 0, 1, 2


@triton.jit
def _tile_coords(tile_id, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Grouped (L2-friendly) order: GROUP_M row tiles sweep all column tiles together (tile_id a
    scalar or a vector of tiles)."""
    in_group = GROUP_M * tiles_n
    group = tile_id // in_group
    first_m = group * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile_id % size_m), (tile_id % in_group) // size_m


@triton.jit
def _load_a(a_desc, off_m, k, A_T: tl.constexpr, UPCAST: tl.constexpr):
    """A's tile [BM, BK] (from Aᵀ storage when A_T)."""
    a = a_desc.load([k, off_m]).T if A_T else a_desc.load([off_m, k])
    return a.to(tl.float32) if UPCAST else a


@triton.jit
def _load_b(b_desc, off_n, k, B_T: tl.constexpr, UPCAST: tl.constexpr):
    """B's tile [BK, BN] (from Bᵀ storage when B_T)."""
    b = b_desc.load([off_n, k]).T if B_T else b_desc.load([k, off_n])
    return b.to(tl.float32) if UPCAST else b


@triton.jit
def _main_loop(a_desc, b_desc, s_desc, s_ptr, u_ptr, off_m, off_n, K, k_tiles, row_lo, row_hi, col_lo, col_hi,
               A_T: tl.constexpr, B_T: tl.constexpr, SIDE_IN_LOOP: tl.constexpr, COL_IN_LOOP: tl.constexpr,
               UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """acc [BM, BN] = A·B of one tile, its K tiles in one fixed order: the unchecked GEMM's loop, one
    MMA per step (a narrow side MMA on the steps of the tile's K slice, tried on the H200, made the
    loop 10–50% slower than the side after it). With the row side in the loop
    (TritonGemmConfig.side_in_loop, side_on_cuda_cores) also — SIDE_IN_LOOP 1: side [BM, 16] = A·S
    over all of K, a second MMA on the A tile each step has loaded; 2: ref = A·(c·2ᵉ) and ones = A·1
    [BM] in fp32 over K tiles [row_lo, row_hi) (the tile's K slice), on the CUDA cores from the same A
    tile (`_row_side_step`) beside the step's MMA in flight. COL_IN_LOOP (a column check with
    col_side_on_cuda_cores): col_ref = (u1·2ᵉ)ᵀB [BN] over K tiles [col_lo, col_hi) the same way from
    the B tile (`_col_side_step`). Returns (acc, side, ref, ones, col_ref)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    side = tl.zeros((BM, SIDE_N), dtype=tl.float32)
    ref = tl.zeros((BM,), dtype=tl.float32)
    ones = tl.zeros((BM,), dtype=tl.float32)
    col_ref = tl.zeros((BN,), dtype=tl.float32)
    for ki in range(k_tiles):
        a = _load_a(a_desc, off_m, ki * BK, A_T, UPCAST)
        b = _load_b(b_desc, off_n, ki * BK, B_T, UPCAST)
        acc = tl.dot(a, b, acc)
        if SIDE_IN_LOOP == 1:
            side = tl.dot(a, load_side(s_desc, ki * BK, UPCAST), side)
        if SIDE_IN_LOOP == 2:
            if (ki >= row_lo) & (ki < row_hi):
                ref, ones = _row_side_step(a, s_ptr, ki * BK, K, ref, ones, BK)
        if COL_IN_LOOP:
            if (ki >= col_lo) & (ki < col_hi):
                col_ref = _col_side_step(b, u_ptr, ki * BK, K, col_ref, BK)
    return acc, side, ref, ones, col_ref


@triton.jit
def _side_vector(s_ptr, k0, K, BK: tl.constexpr):
    """v·2ᵉ [BK] in fp32 for K rows k0 … k0 + BK of a side matrix S (gemm_side.py): its three parts
    added, hi + lo + lo2 (zeros past K)."""
    offs_k = k0 + tl.arange(0, BK)
    mask = offs_k < K
    hi = tl.load(s_ptr + offs_k * SIDE_N, mask=mask, other=0.0).to(tl.float32)
    lo = tl.load(s_ptr + offs_k * SIDE_N + 1, mask=mask, other=0.0).to(tl.float32)
    lo2 = tl.load(s_ptr + offs_k * SIDE_N + 2, mask=mask, other=0.0).to(tl.float32)
    return hi + lo + lo2


@triton.jit
def _row_side_step(a, s_ptr, k0, K, ref, ones, BK: tl.constexpr):
    """One K step of the row side on the CUDA cores: ref += A_tile·c, ones += A_tile·1 [BM], c [BK] in
    fp32 (`_side_vector`). The A tile [BM, BK] is read from the shared memory the step's MMA reads it
    from; the products and their per-step sums run while that MMA is in flight, so a tile's K loop
    keeps one MMA per step (a second, narrow MMA stalled it: SIDE_IN_LOOP = 1). Each row's sum is a
    fixed tree per step and a chain over the steps: a replay of the tile repeats it bit for bit."""
    x = a.to(tl.float32)
    ref += tl.sum(x * _side_vector(s_ptr, k0, K, BK)[None, :], axis=1)
    ones += tl.sum(x, axis=1)
    return ref, ones


@triton.jit
def _col_side_step(b, u_ptr, k0, K, col_ref, BK: tl.constexpr):
    """One K step of the column side on the CUDA cores: col_ref += u1ᵀ·B_tile [BN], from the B tile
    [BK, BN] the step's MMA reads (`_row_side_step`'s reasons)."""
    col_ref += tl.sum(b.to(tl.float32) * _side_vector(u_ptr, k0, K, BK)[:, None], axis=0)
    return col_ref


@triton.jit
def _side_part(x_desc, s_desc, scale_ptr, off, part, parts, k_tiles, ref_ptr, ones_ptr, diff_total_ptr,
               ones_total_ptr, size, ROW: tl.constexpr, X_T: tl.constexpr, ONES: tl.constexpr,
               REF_TOTAL: tl.constexpr, ONES_TOTAL: tl.constexpr, UPCAST: tl.constexpr, R: tl.constexpr,
               BK: tl.constexpr):  # fmt: skip
    """One K slice of a reference side: X·S over K tiles [part·k_tiles/parts, (part+1)·k_tiles/parts)
    for the R rows of X from `off` — X = A's row block (ROW) or Bᵀ's column block — in one fp32
    chain, re-reading the slice's X tiles; then stored (`_store_side_part`)."""
    k_lo = part * k_tiles // parts
    k_hi = (part + 1) * k_tiles // parts
    side = tl.zeros((R, SIDE_N), dtype=tl.float32)
    for ki in range(k_lo, k_hi):
        x = _load_a(x_desc, off, ki * BK, X_T, UPCAST) if ROW else tl.trans(_load_b(x_desc, off, ki * BK, X_T, UPCAST))
        side = tl.dot(x, load_side(s_desc, ki * BK, UPCAST), side)
    _store_side_part(side, scale_ptr, off, part, ref_ptr, ones_ptr, diff_total_ptr, ones_total_ptr, size, ONES,
                     REF_TOTAL, ONES_TOTAL, R)  # fmt: skip


@triton.jit
def _store_side_part(side, scale_ptr, off, part, ref_ptr, ones_ptr, diff_total_ptr, ones_total_ptr, size,
                     ONES: tl.constexpr, REF_TOTAL: tl.constexpr, ONES_TOTAL: tl.constexpr, R: tl.constexpr):  # fmt: skip
    """A side slice's X·S [R, 16] in fp64 (`side_columns`), stored by `_store_side_values`."""
    ref, ones = side_columns(side.to(tl.float64), tl.load(scale_ptr))
    _store_side_values(ref, ones, off, part, ref_ptr, ones_ptr, diff_total_ptr, ones_total_ptr, size, ONES,
                       REF_TOTAL, ONES_TOTAL, R)  # fmt: skip


@triton.jit
def _store_side_values(ref, ones, off, part, ref_ptr, ones_ptr, diff_total_ptr, ones_total_ptr, size,
                       ONES: tl.constexpr, REF_TOTAL: tl.constexpr, ONES_TOTAL: tl.constexpr, R: tl.constexpr):  # fmt: skip
    """A side slice's values [R] in fp64 — X·v and X·1 — to ref_ptr[part, off:off+R] (and ones_ptr),
    and where the evidence inside the launch reads them, subtracted from the difference totals and
    the ones added to theirs (gemm_evidence.finish_rows)."""
    offs = off + tl.arange(0, R)
    mask = offs < size
    tl.store(ref_ptr + part * size + offs, ref, mask=mask)
    if ONES:
        tl.store(ones_ptr + part * size + offs, ones, mask=mask)
    if REF_TOTAL:
        add_totals(diff_total_ptr, offs, mask, -ref)
    if ONES_TOTAL:
        add_totals(ones_total_ptr, offs, mask, ones)


@triton.jit
def _slices_of(block, tiles, parts, replay):
    """The reference-side slices [first, stop) a tile computes: at block `block` of `tiles` along the
    side's direction, `parts` slices in all, slice p in the tile of block p·⌈tiles / parts⌉ (one tile
    in ⌈tiles / parts⌉: TritonGemmConfig.side_group); a replay of one tile computes every slice."""
    group = tl.cdiv(tiles, parts)
    index = block // group
    owner = (block % group) == 0
    return tl.where(replay, 0, index), tl.where(replay, parts, tl.where(owner, index + 1, index))


@triton.jit
def _output_checksums(out, UPCAST: tl.constexpr, BN: tl.constexpr):
    """A checksum of each row of the rounded output [BM, BN] (`out_part`), what a replay compares to
    tell whether a fault reached the output: the wrapping int32 sum of the row's 16-bit elements
    taken two at a time as 32 bits (columns 2i and 2i + 1, the first in the low half), folded to 24
    bits (the top byte XORed into the low one) so that it is exact as fp32. A change to one
    element's bits always moves it (a change δ of the pattern moves the sum by δ or δ·2¹⁶, |δ| < 2¹⁶,
    and the fold keeps such moves apart), and integer sums do not depend on their order, so a replay
    reproduces it bit for bit by construction. On the GPU each pair is the 32-bit register the
    rounding packs it in (inline PTX: no element unpacked); in the interpreter the same sum from
    the elements. Against the row sums of the values in fp32 — each element rounded on its own,
    unpacked and added — ~320 SASS instructions per thread fewer in a 128 × 256 forward tile's
    epilogue (sm_90a, Triton 3.6); fp32 outputs (interpreter tests) keep the fp32 row sums."""
    if out.dtype == tl.float32:
        return tl.sum(out, axis=1)
    if UPCAST:
        bits = out.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        lo, hi = tl.split(tl.reshape(bits, (bits.shape[0], BN // 2, 2)))
        pairs = lo | (hi << 16)
    else:
        pairs = tl.inline_asm_elementwise(
            "mov.b32 $0, $2;\n mov.b32 $1, 0;", "=r,=r,r", [out], dtype=tl.int32, is_pure=True, pack=2
        )  # fmt: skip  (the pair's bits, then a zero)
    total = tl.sum(pairs, axis=1)
    return ((total & 0xFFFFFF) ^ ((total >> 24) & 0xFF)).to(tl.float32)


@triton.jit
def _store_partials(acc, AXIS: tl.constexpr, part_ptr, sq_ptr, offs, mask, diff_total_ptr, sq_total_ptr,
                    EVIDENCE: tl.constexpr):  # fmt: skip
    """A tile's accumulator sums and sums of squares [R] along AXIS (1: of each row, 0: of each
    column), stored as its partials at offs and, where the evidence is finished inside the launch,
    added to the launch's totals (gemm_evidence.finish_rows)."""
    total = tl.sum(acc, axis=AXIS)
    sq = tl.sum(acc * acc, axis=AXIS)
    tl.store(part_ptr + offs, total, mask=mask)
    tl.store(sq_ptr + offs, sq, mask=mask)
    if EVIDENCE:
        add_totals(diff_total_ptr, offs, mask, total.to(tl.float64))
        add_totals(sq_total_ptr, offs, mask, sq.to(tl.float64))


@triton.jit
def _finish_completed(done, index, block, counter_ptr, totals_ptr, parts, stats_ptr, stats_f64_ptr, byproduct_ptr,
                      side_out_ptr, M, N, ROWS: tl.constexpr, ROW_CHECK: tl.constexpr, BYPRODUCT: tl.constexpr,
                      SIDE_OUT: tl.constexpr, TOTALS: tl.constexpr, DT: tl.constexpr, BLOCK: tl.constexpr,
                      CHUNK: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    """Finish the blocks [CHUNK] (`block`) whose tickets `done` completed them: everyone's writes
    acquired (one fence), the blocks' counters put back to zero, and the blocks judged — from the
    fp64 totals the tiles added to, all of them at once (TOTALS: gemm_evidence.finish_rows /
    finish_cols over the blocks' rows [CHUNK·BLOCK], so that their exchanges and the slot's atomics
    are in flight together), or from the tiles' stored partials and side slices, one block after
    another, summed in their fixed order (gemm_evidence.finish_row_block_parts /
    finish_col_block_parts). Why all at once: finishing the blocks made the evidence inside the
    launch 5–9% of the GEMM where counting the tiles cost nothing (benchmarks/gemm_diagnose.py
    --evidence-parts), and the program whose tiles end last completes every block it holds the last
    tile of, at the launch's end: one after another, each a few round trips. All at once, the forwards
    gained 3–5% on the H200 (results/gemm_diagnose_evidence_parts.json). `parts`: (row_part, rsq_part, rowref, rowones, row_parts, col_part, csq_part,
    colref, col_parts, tiles_m, tiles_n)."""
    row_part, rsq_part, rowref, rowones, row_parts, col_part, csq_part, colref, col_parts, tiles_m, tiles_n = parts
    if TOTALS:
        if tl.max(done.to(tl.int32), axis=0) > 0:
            fence_gpu(INTERPRETED)
            tl.store(counter_ptr + block * COUNTER_STRIDE, 0, mask=done)
            # the completed blocks' rows (columns) [CHUNK·BLOCK], lane by lane; other lanes masked
            offs = tl.reshape(block[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :], [CHUNK * BLOCK])
            lanes = tl.reshape(tl.broadcast_to(done[:, None], [CHUNK, BLOCK]), [CHUNK * BLOCK])
            if ROWS:
                ones = finish_rows(totals_ptr, stats_ptr, stats_f64_ptr, byproduct_ptr, offs, lanes & (offs < M), M,
                                   ROW_CHECK, BYPRODUCT or SIDE_OUT, BYPRODUCT)  # fmt: skip
                if SIDE_OUT:
                    # S(A·1) [BLOCK, 16] block by block: all [CHUNK·BLOCK, 16] at once took every register
                    # (kernel_registers.py), and plain stores leave nothing to wait for between blocks
                    ones = tl.reshape(ones, [CHUNK, BLOCK])
                    lane = tl.arange(0, CHUNK)
                    for c in tl.static_range(CHUNK):
                        if tl.sum(tl.where(lane == c, done.to(tl.int32), 0), axis=0) > 0:
                            rows = tl.sum(tl.where(lane == c, block, 0), axis=0) * BLOCK + tl.arange(0, BLOCK)
                            block_ones = tl.sum(tl.where(lane[:, None] == c, ones, 0.0), axis=0)
                            store_side(side_out_ptr, rows, rows < M, block_ones, DT)
            else:
                finish_cols(totals_ptr, stats_ptr, stats_f64_ptr, offs, lanes & (offs < N), M, N)
    else:
        for _ in range(tl.sum(done.to(tl.int32), axis=0)):
            first = tl.min(tl.where(done, index, 2**30), axis=0)
            start = tl.sum(tl.where(index == first, block, 0), axis=0)
            done = done & (index != first)
            fence_gpu(INTERPRETED)
            tl.store(counter_ptr + start * COUNTER_STRIDE, 0)
            if ROWS:
                finish_row_block_parts(row_part, rsq_part, rowref, rowones, tiles_n, row_parts, M, start * BLOCK,
                                       stats_ptr, stats_f64_ptr, byproduct_ptr, side_out_ptr, ROW_CHECK, BYPRODUCT,
                                       SIDE_OUT, DT, BLOCK)  # fmt: skip
            else:
                finish_col_block_parts(col_part, csq_part, colref, tiles_m, col_parts, N, start * BLOCK, stats_ptr,
                                       stats_f64_ptr, BLOCK)  # fmt: skip


@triton.jit
def _finish_program_blocks(row_done, col_done, tiles_m, tiles_n, totals_ptr, parts, stats_ptr, stats_f64_ptr,
                           byproduct_ptr, side_out_ptr, M, N, ROWS: tl.constexpr, ROW_CHECK: tl.constexpr,
                           COL_CHECK: tl.constexpr, BYPRODUCT: tl.constexpr, SIDE_OUT: tl.constexpr,
                           TOTALS: tl.constexpr, DT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                           GROUP_M: tl.constexpr, INTERPRETED: tl.constexpr, CHUNK: tl.constexpr = 8):  # fmt: skip
    """Inline evidence, once a program's tiles are done and fenced: each of its tiles counted into its
    row block and column block, CHUNK tiles in one vector of relaxed atomics (their round trips in
    parallel; the count before each is the tile's ticket, and the ticket contributions − 1 completes
    its block), and the blocks each vector of counts completed finished here, together. CHUNK = 8:
    the finish's vectors are CHUNK·BLOCK rows (a program holds ~10–20 tiles, so 2–3 rounds). The
    fence before the counts makes them a release of the program's additions, the fence before a
    finish an acquire of everyone's (`_finish_completed`)."""
    first_tile = tl.program_id(0)
    step = tl.num_programs(0)
    mine = tl.cdiv(tiles_m * tiles_n - first_tile, step)
    for c0 in range(0, mine, CHUNK):
        index = c0 + tl.arange(0, CHUNK)
        valid = index < mine
        tiles = tl.where(valid, first_tile + index * step, first_tile)  # lanes past the last: a real tile
        pid_m, pid_n = _tile_coords(tiles, tiles_m, tiles_n, GROUP_M)
        if ROWS:
            ticket = tl.atomic_add(row_done + pid_m * COUNTER_STRIDE, 1, mask=valid, sem="relaxed", scope="gpu")
            _finish_completed(valid & (ticket == tiles_n - 1), index, pid_m, row_done, totals_ptr, parts, stats_ptr,
                              stats_f64_ptr, byproduct_ptr, side_out_ptr, M, N, True, ROW_CHECK, BYPRODUCT, SIDE_OUT,
                              TOTALS, DT, BM, CHUNK, INTERPRETED)  # fmt: skip
        if COL_CHECK:
            ticket = tl.atomic_add(col_done + pid_n * COUNTER_STRIDE, 1, mask=valid, sem="relaxed", scope="gpu")
            _finish_completed(valid & (ticket == tiles_m - 1), index, pid_n, col_done, totals_ptr, parts, stats_ptr,
                              stats_f64_ptr, byproduct_ptr, side_out_ptr, M, N, False, ROW_CHECK, BYPRODUCT, SIDE_OUT,
                              TOTALS, DT, BN, CHUNK, INTERPRETED)  # fmt: skip


# Integer arguments are not specialized on their values (a shape seen for the first time reuses the
# compiled variant: no compile mid-run, and the launch path below can key variants on constexprs).
_RUNTIME_INTS = ["stride_a", "stride_b", "stride_c", "data_len", "f32_len", "fault_row", "fault_col", "fault_mask", "side_all",
                 "row_parts", "col_parts", "M", "N", "K"]  # fmt: skip


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def checked_gemm_kernel(
    a_ptr,  # A [M, K] row stride stride_a (Aᵀ [K, M] when A_T)
    b_ptr,  # B [K, N] row stride stride_b (Bᵀ [N, K] when B_T)
    c_ptr,  # C [M, N] row stride stride_c (TMA store)
    bias_ptr,
    side_c_ptr,  # S(c) [K, 16] operand dtype, contiguous: c = B·1 (row side; gemm_side.py)
    side_u_ptr,  # S(u1) [K, 16]: u1 = 1ᵀA (column side)
    c_scale_ptr,  # fp32 [1]: 2ᵉ of S(c)
    u_scale_ptr,  # fp32 [1]: 2ᵉ of S(u1)
    row_part_ptr,  # [tiles_n, M] fp32 out: Σ_j acc per tile
    rsq_part_ptr,  # [tiles_n, M] fp32 out: Σ_j acc² per tile
    out_part_ptr,  # [tiles_n, M] fp32 out: a checksum of the rounded output's row per tile (_output_checksums)
    col_part_ptr,  # [tiles_m, N] fp32 out: Σ_i acc per tile
    csq_part_ptr,  # [tiles_m, N] fp32 out: Σ_i acc² per tile
    rowref_ptr,  # [row_parts, M] fp64 out: A·c per K slice (slice j from the tiles of column block j)
    rowones_ptr,  # [row_parts, M] fp64 out: A·1 per K slice, the by-product's parts
    colref_ptr,  # [col_parts, N] fp64 out: u1ᵀB per K slice (slice i from the tiles of row block i)
    byproduct_ptr,  # [M] fp64 out (BYPRODUCT, inline): A·1
    side_out_ptr,  # [M, 16] out (SIDE_OUT, inline): S(A·1), as a later wgrad's side reads it
    counters_ptr,  # int32 [(1 + tiles_m + tiles_n)·COUNTER_STRIDE], zero: programs, row and column blocks done
    #                (inline), one line each; left zero
    totals_ptr,  # fp64 [3·M + 2·N], zero: the launch's sums (gemm_evidence.finish_rows), left zero
    stats_ptr,  # int64 [STATS_LEN], zero
    stats_f64_ptr,  # the same slot as fp64
    pool_data_ptr,
    pool_f32_ptr,
    pool_counter_ptr,
    row_threshold,
    col_threshold,
    stride_a,
    stride_b,
    stride_c,
    data_len,
    f32_len,
    fault_row,
    fault_col,
    fault_delta,
    fault_mask,
    side_all,  # replays of one tile: that tile computes every K slice of both reference sides
    row_parts,  # K slices of the row side: tiles_n of the launch being computed (or replayed)
    col_parts,  # K slices of the column side: tiles_m of it
    M,
    N,
    K,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROW_CHECK: tl.constexpr,  # row partials (and row evidence)
    ROW_SIDE: tl.constexpr,  # A·c and A·1
    SIDE_IN_LOOP: tl.constexpr,  # (ROW_SIDE) A·c in the K loop: 1 an MMA over all of K, one slice; 2 its slices on
    #                              the CUDA cores (TritonGemmConfig)
    COL_IN_LOOP: tl.constexpr,  # (COL_CHECK) u1ᵀB's slices in the K loop on the CUDA cores (TritonGemmConfig)
    COL_CHECK: tl.constexpr,  # column partials and u1ᵀB (and column evidence)
    FAULT: tl.constexpr,
    EVIDENCE: tl.constexpr,  # evidence and by-product finished inside this launch (gemm_evidence)
    TOTALS: tl.constexpr,  # (EVIDENCE only) tiles add to fp64 totals by atomics, else the finish sums their parts
    BYPRODUCT: tl.constexpr,
    SIDE_OUT: tl.constexpr,
    CAPTURE: tl.constexpr,
    POOL: tl.constexpr,
    DT: tl.constexpr,  # the operands' dtype
    UPCAST: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # The TMA descriptors, built on the device once per program (in global scratch that `_launch`
    # provides): the host passes plain pointers, so a launch builds no descriptor object.
    if A_T:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[stride_a, 1], block_shape=[BK, BM])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_a, 1], block_shape=[BM, BK])
    if B_T:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_b, 1], block_shape=[BN, BK])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_b, 1], block_shape=[BK, BN])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_c, 1], block_shape=[BM, BN])
    side_c_desc = side_descriptor(side_c_ptr, K, BK)
    side_u_desc = side_descriptor(side_u_ptr, K, BK)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    replay = side_all != 0
    # Inline evidence: fp64 totals [3·M + 2·N] — row differences Σ_j acc − A·c, row sums of squares,
    # A·1; column differences and sums of squares — that every tile adds its share to
    row_diff = totals_ptr
    row_sq_total = totals_ptr + M
    ones_total = totals_ptr + 2 * M
    col_diff = totals_ptr + 3 * M
    col_sq_total = col_diff + N
    for tile_id in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile_id, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        if SIDE_IN_LOOP == 2 or COL_IN_LOOP:
            # The reference sides' K slices inside the K loop, on the CUDA cores: this tile's slice of
            # its row block's row side (SIDE_IN_LOOP 2) and of its column block's column side
            # (COL_IN_LOOP) — none where side_group leaves it without one — in one pass; a replay of
            # one tile runs the tile once per slice: the same loop with the same per-step sums, so
            # every slice's bits are its owner's (a separate slice loop could sum in another register
            # layout). Replays are rare.
            first, stop = _slices_of(pid_n, tiles_n, row_parts, replay)
            first_c, stop_c = _slices_of(pid_m, tiles_m, col_parts, replay)
            rows_in_loop = SIDE_IN_LOOP == 2
            passes = tl.maximum(
                tl.maximum(stop - first if rows_in_loop else 0, stop_c - first_c if COL_IN_LOOP else 0), 1
            )
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            side = tl.zeros((BM, SIDE_N), dtype=tl.float32)
            for r in range(passes):
                part, part_c = first + r, first_c + r
                owned = (part < stop) & rows_in_loop
                owned_c = (part_c < stop_c) & COL_IN_LOOP
                acc, side, ref, ones, col_ref = _main_loop(
                    a_desc, b_desc, side_c_desc, side_c_ptr, side_u_ptr, off_m, off_n, K, k_tiles,
                    tl.where(owned, part * k_tiles // row_parts, 0), tl.where(owned, (part + 1) * k_tiles // row_parts, 0),
                    tl.where(owned_c, part_c * k_tiles // col_parts, 0),
                    tl.where(owned_c, (part_c + 1) * k_tiles // col_parts, 0), A_T, B_T, SIDE_IN_LOOP, COL_IN_LOOP,
                    UPCAST, BM, BN, BK)  # fmt: skip
                if owned:  # (÷ 2ᵉ: the scale S's parts carry, a power of two — exact)
                    _store_side_values(ref.to(tl.float64) / tl.load(c_scale_ptr).to(tl.float64), ones.to(tl.float64),
                                       off_m, part, rowref_ptr, rowones_ptr, row_diff, ones_total, M, True,
                                       TOTALS and ROW_CHECK, TOTALS and (BYPRODUCT or SIDE_OUT), BM)  # fmt: skip
                if owned_c:  # (no ones column on the column side)
                    col_ref64 = col_ref.to(tl.float64) / tl.load(u_scale_ptr).to(tl.float64)
                    _store_side_values(col_ref64, col_ref64, off_n, part_c, colref_ptr, colref_ptr, col_diff, col_diff,
                                       N, False, TOTALS, False, BN)  # fmt: skip
        else:
            acc, side, _, _, _ = _main_loop(a_desc, b_desc, side_c_desc, side_c_ptr, side_u_ptr, off_m, off_n, K,
                                            k_tiles, 0, 0, 0, 0, A_T, B_T, SIDE_IN_LOOP, False, UPCAST, BM, BN,
                                            BK)  # fmt: skip
        offs_m = off_m + tl.arange(0, BM)
        offs_n = off_n + tl.arange(0, BN)
        mask_m = offs_m < M
        mask_n = offs_n < N
        if FAULT != 0:  # a faulty matrix unit: one accumulator element goes wrong
            hit = (offs_m == fault_row)[:, None] & (offs_n == fault_col)[None, :]
            if FAULT == 1:
                acc = tl.where(hit, acc + fault_delta, acc)
            else:
                flipped = (acc.to(tl.int32, bitcast=True) ^ fault_mask).to(tl.float32, bitcast=True)
                acc = tl.where(hit, flipped, acc)
        out = acc
        if HAS_BIAS:
            out = out + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out = out.to(c_ptr.dtype.element_ty)
        # The order of the epilogue's reductions follows the registers: a row-only check sums the
        # accumulator first and then rounds and stores the output (measured 2–3% faster on the H200);
        # with a column check too, the output's row sums and its store go first, so that `out` is dead
        # before the sums of squares are formed (with out, acc and acc² live at once the row+col
        # variants spilled 312–424 bytes per thread: benchmarks/kernel_registers.py).
        if ROW_CHECK and not COL_CHECK:
            _store_partials(acc, 1, row_part_ptr + pid_n * M, rsq_part_ptr + pid_n * M, offs_m, mask_m, row_diff,
                            row_sq_total, TOTALS)  # fmt: skip
        if ROW_CHECK:
            tl.store(out_part_ptr + pid_n * M + offs_m, _output_checksums(out, UPCAST, BN), mask=mask_m)
        c_desc.store([off_m, off_n], out)
        if COL_CHECK:
            if ROW_CHECK:
                _store_partials(acc, 1, row_part_ptr + pid_n * M, rsq_part_ptr + pid_n * M, offs_m, mask_m, row_diff,
                                row_sq_total, TOTALS)  # fmt: skip
            _store_partials(acc, 0, col_part_ptr + pid_m * N, csq_part_ptr + pid_m * N, offs_n, mask_n, col_diff,
                            col_sq_total, TOTALS)  # fmt: skip
        # The reference sides, after the tile's stores are issued: this tile's K slice of its row
        # block's A·S(c) (slice pid_n of tiles_n) and of its column block's Bᵀ·S(u1) (slice pid_m),
        # re-reading the slice's operand tiles (from L2: the tile has just read them). Every tile does
        # the same small share, so none straggles; a replay of one tile (side_all) does every slice.
        # (One streaming pass per block instead, as work items after the tiles, measured slower on the
        # H200: a long narrow pass is latency-bound too, and it lands at the end of the launch.)
        # With side_group g > 1 (TritonGemmConfig) only every g-th tile of a row (column) block takes a
        # slice, g times as long: row_parts = ⌈tiles_n / g⌉ slices, slice p in the tile of column block
        # p·⌈tiles_n / row_parts⌉ — fewer slice loops, each paying its first loads' latency once.
        if SIDE_IN_LOOP == 1:  # (set only with ROW_SIDE)
            # every tile of the row block computed A·S over all of K in its loop; one slice (row_parts
            # = 1), kept by the tile of column block 0, or by a replay of any tile
            if pid_n == 0 or replay:
                _store_side_part(side, c_scale_ptr, off_m, 0, rowref_ptr, rowones_ptr, row_diff, ones_total, M, True,
                                 TOTALS and ROW_CHECK, TOTALS and (BYPRODUCT or SIDE_OUT), BM)  # fmt: skip
        elif ROW_SIDE and SIDE_IN_LOOP == 0:
            first, stop = _slices_of(pid_n, tiles_n, row_parts, replay)
            for part in range(first, stop):
                _side_part(a_desc, side_c_desc, c_scale_ptr, off_m, part, row_parts, k_tiles, rowref_ptr, rowones_ptr,
                           row_diff, ones_total, M, True, A_T, True, TOTALS and ROW_CHECK,
                           TOTALS and (BYPRODUCT or SIDE_OUT), UPCAST, BM, BK)  # fmt: skip
        if COL_CHECK and not COL_IN_LOOP:
            first, stop = _slices_of(pid_m, tiles_m, col_parts, replay)
            for part in range(first, stop):
                _side_part(b_desc, side_u_desc, u_scale_ptr, off_n, part, col_parts, k_tiles, colref_ptr, colref_ptr,
                           col_diff, col_diff, N, False, B_T, False, TOTALS, False, UPCAST, BN, BK)  # fmt: skip
    if EVIDENCE:
        # A block is finished by the program whose count completes it (per-block counters after the
        # launch's counter: row blocks, then column blocks); then the program counts itself into the
        # launch, whose last program concludes from the blocks' verdicts. One fence per program: each
        # thread fences its own additions, the barrier joins them. No one program judges the whole
        # launch: the single finishing program it replaces made a 1.1B model's q_o forward with its
        # by-product 9% slower and a GQA k/v forward 70% slower (benchmarks/gemm_diagnose.py, same
        # run); counting each tile after the next tile's K loop instead measured the same and cost
        # registers.
        fence_gpu(UPCAST)  # UPCAST is set exactly under the interpreter
        tl.debug_barrier()
        parts = (row_part_ptr, rsq_part_ptr, rowref_ptr, rowones_ptr, row_parts, col_part_ptr, csq_part_ptr,
                 colref_ptr, col_parts, tiles_m, tiles_n)  # fmt: skip
        _finish_program_blocks(counters_ptr + COUNTER_STRIDE, counters_ptr + (1 + tiles_m) * COUNTER_STRIDE, tiles_m,
                               tiles_n, totals_ptr, parts, stats_ptr, stats_f64_ptr, byproduct_ptr, side_out_ptr, M, N,
                               ROW_CHECK or BYPRODUCT or SIDE_OUT, ROW_CHECK, COL_CHECK, BYPRODUCT, SIDE_OUT, TOTALS,
                               DT, BM, BN, GROUP_M, UPCAST)  # fmt: skip
        if ROW_CHECK or COL_CHECK:
            fence_gpu(UPCAST)
            tl.debug_barrier()
            if count_done(counters_ptr, tl.num_programs(0)):
                conclude_slot(stats_ptr, a_ptr, b_ptr, row_part_ptr, out_part_ptr, col_part_ptr, rowref_ptr,
                              colref_ptr, pool_data_ptr, pool_f32_ptr, pool_counter_ptr, row_threshold, col_threshold,
                              M, N, K, row_parts, col_parts, stride_a, stride_b, data_len, f32_len, ROW_CHECK,
                              COL_CHECK, CAPTURE, POOL, A_T, B_T, BM, BN)  # fmt: skip


# -- host side --------------------------------------------------------------------------------------
import dataclasses  # noqa: E402
import functools  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402


@dataclasses.dataclass(frozen=True)
class TritonGemmConfig:
    """Tile and pipeline of the checked GEMM. The tile is also the unit of capture and replay."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    # The evidence (and by-product) inside the GEMM launch, else in a second launch. Inside: one
    # launch per checked GEMM (20–50 µs less host time per call); tiles add their sums to fp64 totals,
    # the program whose count completes a row (column) block judges it, the launch's last program concludes.
    inline_evidence: bool = True
    # Inside the launch, how a block's sums reach the program that finishes it: every tile adds its
    # row (column) sums and side slices to fp64 totals by relaxed atomics (True), or the finishing
    # program sums the block's stored per-tile partials and slices in their fixed order, as the
    # second launch does (False: no fp64 atomics in the tiles, more reads at the finish).
    inline_totals: bool = True
    # Tiles per reference-side slice: 1 — every tile of a row block computes one K slice of A·S after
    # its own K loop (slice j in column block j); g > 1 — every g-th tile computes a slice g times as
    # long (⌈tiles_n / g⌉ slices; the same for the column side over row blocks). A slice loop pays its
    # first loads' latency unhidden (the side's cost on the H200, docs/gpu.md); fewer, longer loops pay
    # it fewer times, at the price of tiles that run longer than their neighbours. Part of the
    # configuration because the slices' fp32 chains, and so the bits a replay compares, depend on it.
    side_group: int = 1
    # The row side A·S in the K loop instead: every tile runs a second, narrow MMA [BM, 16] on each A
    # tile it loads, over all of K, and the tile of column block 0 keeps it (one slice). Costs every
    # tile a narrow MMA per K step (8–28% of a wide GEMM on the H200: docs/gpu.md) but no re-read of
    # A — for the narrow classes (tiles_n ≤ 4), where the slice after the loop re-reads 1/tiles_n of
    # A's row block from L2 (`HOPPER_TABLE` has the measurements). The column side stays after the loop.
    side_in_loop: bool = False
    # The row side's K slices inside the K loop on the CUDA cores (overrides side_in_loop): on the K
    # steps of its slice (slice j in column block j, or as side_group spreads them) a tile multiplies
    # the step's A tile, read from the shared memory the step's MMA reads, by c in fp32
    # (`_row_side_step`) while that MMA is in flight. The K loop keeps one MMA per step, nothing
    # re-reads A, and each tile adds work on 1/tiles_n of its steps.
    side_on_cuda_cores: bool = False
    # The column side's the same way (a column check: wgrad's row+col): its B tile times u1 on the
    # steps of its column slice (`_col_side_step`; the sums over the tile's BK rows cross warps, and
    # the B tile is read into registers on every step).
    col_side_on_cuda_cores: bool = False


# Hopper: 128×256×64 tiles, 8 warps, 3 stages run bf16 GEMMs at cuBLAS speed on the H200.
# The interpreter runs one program at a time on the CPU: small tiles keep tests fast (BK = 16: the
# reference-side MMA's S operand is [BK, 16], and tl.dot takes no dimension under 16).
HOPPER_CONFIG = TritonGemmConfig()
INTERPRETER_CONFIG = TritonGemmConfig(block_m=32, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1)
# The configuration of each shape class on the H200 (`shape_class`), chosen by
# `benchmarks/gemm_tune.py` and fixed here: no autotuning at run time, so every rank and every
# replay runs the configuration that a tile's bits depend on.
HOPPER_TABLE: dict[str, TritonGemmConfig] = {
    # Winners of benchmarks/gemm_tune.py (GPU time, geometric mean of cuBLAS ÷ ours over the class's
    # GEMMs; results/gemm_tune.json). Small classes want more, smaller tiles: the machine has 132 SMs.
    # The narrow forwards (GQA k/v: tiles_n ≤ 4) run the row side in the K loop: on the H100 the k/v
    # forwards at N = 128 / 256 / 1024 went 0.38 → 0.61 / 0.32 → 0.34 / 0.51 → 0.59 of cuBLAS, while a
    # square one (tiles_n = 8) lost 0.77 → 0.70 and the wgrads gained nothing
    # (results/gemm_diagnose_side_in_loop.json).
    "narrow-n": TritonGemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=4, side_in_loop=True),  # N ≤ 256
    "narrow-m": TritonGemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=4),  # M ≤ 256: its wgrad
    "short-k": HOPPER_CONFIG,  # K ≤ 512: its dgrad (the reduction runs over N)
    "few-tiles": TritonGemmConfig(block_m=64, block_n=256, num_warps=4, num_stages=4),  # under one wave of 128×256
    "mid-n": dataclasses.replace(HOPPER_CONFIG, side_in_loop=True),  # N ≤ 1024: Llama-3's k/v, 70B/8's q
    "large": HOPPER_CONFIG,
}
_config_override: TritonGemmConfig | None = None


def shape_class(m: int, n: int, k: int) -> str:
    """The class of a GEMM C[M, N] = A[M, K]·B[K, N] whose configuration `HOPPER_TABLE` holds."""
    if n <= 256:
        return "narrow-n"
    if m <= 256:
        return "narrow-m"
    if k <= 512:
        return "short-k"
    if ceil_div(m, 128) * ceil_div(n, 256) < 132:
        return "few-tiles"
    if n <= 1024:
        return "mid-n"
    return "large"


def config_for(m: int, n: int, k: int) -> TritonGemmConfig:
    """The tile configuration of a GEMM of this shape (a benchmark's override first)."""
    if _config_override is not None:
        return _config_override
    if INTERPRET:
        return INTERPRETER_CONFIG
    return HOPPER_TABLE[shape_class(m, n, k)]


def default_config() -> TritonGemmConfig:
    """The configuration where no shape is known (the shape classes' common default)."""
    if _config_override is not None:
        return _config_override
    return INTERPRETER_CONFIG if INTERPRET else HOPPER_CONFIG


def set_config(cfg: TritonGemmConfig | None) -> None:
    """Use `cfg` for every launch from now on (benchmarks); None restores the table."""
    global _config_override
    _config_override = cfg


@functools.cache
def num_sms(device: torch.device) -> int:
    if INTERPRET or device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def tma_compatible(t: torch.Tensor) -> bool:
    """TMA needs a contiguous last dimension, 16-byte aligned rows and a 16-byte aligned base."""
    return (
        t.dim() == 2
        and t.stride(1) == 1
        and (t.stride(0) * t.element_size()) % 16 == 0
        and t.data_ptr() % 16 == 0
        and t.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@dataclasses.dataclass(eq=False)
class CapturePool:
    """Slots the kernel copies replay contexts into on an alarm; claimed with an atomic counter."""

    data: torch.Tensor  # [slots, data_len] operand dtype
    f32: torch.Tensor  # [slots, f32_len] fp64: partial sums (fp32 values, upcast exactly) and fp64 references
    counter: torch.Tensor  # int32 [1]: slots claimed this step

    @property
    def slots(self) -> int:
        return self.data.shape[0]

    @staticmethod
    def layout(m: int, n: int, k: int, capture: int, cfg: TritonGemmConfig) -> tuple[int, int]:
        """(data_len, f32_len) one capture of this GEMM needs (see gemm_evidence._capture)."""
        bm, bn = cfg.block_m, cfg.block_n
        tiles_m, tiles_n = -(-m // bm), -(-n // bn)
        row_parts, col_parts = row_side_parts(tiles_n, cfg), side_parts(tiles_m, cfg)
        if capture == CAPTURE_TILE:
            return bm * k + bn * k, (2 + row_parts) * bm + (1 + col_parts) * bn
        return bm * k, (2 * tiles_n + row_parts) * bm

    @classmethod
    def allocate(cls, slots: int, data_len: int, f32_len: int, dtype: torch.dtype, device) -> CapturePool:
        return cls(
            torch.empty(slots, data_len, dtype=dtype, device=device),
            torch.empty(slots, f32_len, dtype=torch.float64, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
        )


def side_parts(tiles: int, cfg: TritonGemmConfig) -> int:
    """K slices of the column side over `tiles` = tiles_m tiles (and of the row side: `row_side_parts`)."""
    return ceil_div(tiles, cfg.side_group)


def row_side_parts(tiles_n: int, cfg: TritonGemmConfig) -> int:
    """K slices of the row side over tiles_n tiles: one when an MMA in the K loop computes it over all
    of K (`side_in_loop` without `side_on_cuda_cores`)."""
    return 1 if side_in_loop_mode(cfg) == 1 else side_parts(tiles_n, cfg)


def side_in_loop_mode(cfg: TritonGemmConfig) -> int:
    """The kernel's SIDE_IN_LOOP: 0 the row side's slices after the K loop, 1 an MMA over all of K in
    it, 2 its slices in it on the CUDA cores."""
    return 2 if cfg.side_on_cuda_cores else 1 if cfg.side_in_loop else 0


def counters_needed(m: int, n: int, cfg: TritonGemmConfig) -> int:
    """int32 slots the evidence of a launch uses: programs (or blocks) done, then, for evidence
    inside the launch, the tiles done of each row block and of each column block — each counter in a
    line of its own (COUNTER_STRIDE slots). Zero before a launch, left zero after it."""
    counters = 1 + (ceil_div(m, cfg.block_m) + ceil_div(n, cfg.block_n) if cfg.inline_evidence else 0)
    return counters * COUNTER_STRIDE.value


_WORKSPACES: dict[tuple, torch.Tensor] = {}
_VIEWS: dict[tuple, torch.Tensor] = {}


def _workspace(
    device: torch.device, name: str, shape: tuple[int, ...], dtype: torch.dtype, zeroed: bool = False
) -> torch.Tensor:
    """A scratch buffer reused by every launch: the partials are written and consumed by the
    launches of one call, in stream order, before any later call's GEMM can overwrite them (the
    checked GEMMs of a process run on one stream at a time, as a training step's do). Nothing reads
    them after the call: captures copy what they keep, and the by-product A·1 that a later wgrad reads
    goes to a tensor of the caller's (`byproduct`). One flat buffer per name, grown to the largest shape
    seen: variable sequence lengths do not pile up buffers. `zeroed`: made zero, for buffers that every
    launch leaves zero (the inline evidence's totals)."""
    view = _VIEWS.get((device, name, dtype, shape))
    if view is not None:  # the view of the current buffer at this shape (a lookup, no tensor op)
        return view
    numel = math.prod(shape)
    key = (device, name, dtype)
    buffer = _WORKSPACES.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _WORKSPACES[key] = (torch.zeros if zeroed else torch.empty)(numel, dtype=dtype, device=device)
        for stale in [k for k in _VIEWS if k[:3] == key]:  # views of the buffer it replaces
            del _VIEWS[stale]
        _LAYOUTS.clear()  # and the layouts holding them (rebuilt at their next call)
    view = _VIEWS[(device, name, dtype, shape)] = buffer[:numel].view(shape)
    return view


@dataclasses.dataclass(frozen=True)
class _Fillers:
    """What a launch passes where a variant takes no tensor (never read or written by it), per device."""

    f32: torch.Tensor  # fp32 [1]
    f64: torch.Tensor  # fp64 [1]
    i32: torch.Tensor  # int32 [1]
    stats: torch.Tensor  # int64 [STATS_LEN]
    stats_f64: torch.Tensor  # the same as fp64
    sides: dict  # dtype → zeros [64, 16]: the S of a launch without that side (its descriptor is never loaded)


_FILLERS: dict[torch.device, _Fillers] = {}


def _fillers(device: torch.device) -> _Fillers:
    fillers = _FILLERS.get(device)
    if fillers is None:
        stats = torch.zeros(STATS_LEN, dtype=torch.int64, device=device)
        fillers = _FILLERS[device] = _Fillers(
            torch.zeros(1, dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.float64, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
            stats,
            stats.view(torch.float64),
            {dt: torch.zeros(64, SIDE_COLUMNS, dtype=dt, device=device) for dt in (torch.bfloat16, torch.float16,
                                                                                    torch.float32)},
        )  # fmt: skip
    return fillers


def _fresh(
    device: torch.device, name: str, shape: tuple[int, ...], dtype: torch.dtype, zeroed: bool = False
) -> torch.Tensor:
    return (torch.zeros if zeroed else torch.empty)(shape, dtype=dtype, device=device)


class _DescriptorScratch:
    """Global memory for the TMA descriptors the kernels build on the device: Triton asks for it at
    every launch (programs × bytes per program). One buffer per device and stream, grown to the
    largest request and reused: launches on one stream run one after the other, so a launch's
    descriptors are no longer read when the next launch on that stream writes its own."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, size: int, alignment: int, stream: int | None) -> torch.Tensor:
        key = (torch._C._cuda_getDevice(), stream or 0)  # the current device, as Triton launches on it
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < size:
            # 256-byte aligned by the caching allocator (descriptors need 64 bytes)
            buffer = self._buffers[key] = torch.empty(max(size, 1 << 16), dtype=torch.uint8, device=key[0])
        return buffer


_SCRATCH = _DescriptorScratch()
# The allocator Triton calls is a context variable (autograd runs backward in threads of its own):
# set around each launch and restored, so a user's own allocator keeps serving the user's kernels.
_ALLOCATOR_VAR = getattr(getattr(triton.runtime, "_allocation", None), "_allocator", None)


class descriptor_scratch:  # a context manager, named like one
    """`with descriptor_scratch():` around a launch of a kernel that builds TMA descriptors on the
    device: Triton's allocator set to the scratch above for the launch, and the one it replaced
    restored after (Triton ≥ 3.5 keeps it in a context variable, per thread: autograd runs backward
    in threads of its own; earlier versions have one global allocator, set and left). A plain class,
    not a generator: it wraps every checked GEMM launch."""

    __slots__ = ("token",)

    def __enter__(self) -> None:
        self.token = None
        if _ALLOCATOR_VAR is not None:
            if _ALLOCATOR_VAR.get() is not _SCRATCH:
                self.token = _ALLOCATOR_VAR.set(_SCRATCH)
        elif not INTERPRET:
            triton.set_allocator(_SCRATCH)

    def __exit__(self, *exc: object) -> None:
        if self.token is not None:
            _ALLOCATOR_VAR.reset(self.token)


_COMPILED: dict[tuple, _Handle] = {}
_direct_launch = not INTERPRET
_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)


@dataclasses.dataclass(frozen=True)
class _Handle:
    """A compiled variant as its launcher takes it: what `CompiledKernel[grid](...)` looks up per call."""

    run: Callable
    function: int
    metadata: object

    @classmethod
    def of(cls, compiled) -> _Handle:
        return cls(compiled.run, compiled.function, compiled.packed_metadata)


def _installed(hook: object) -> bool:
    """Whether a launch hook is set: Triton ≥ 3.5 keeps a `HookChain` (set when it has calls), earlier
    versions the hook itself or None."""
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else hook is not None


def _hooked() -> bool:
    """Whether a launch hook is installed (a profiler such as proton): then launches take Triton's path."""
    return _KNOBS is not None and (_installed(_KNOBS.launch_enter_hook) or _installed(_KNOBS.launch_exit_hook))


class _Launcher:
    """Launches of one kernel variant: kernel[grid](*args, **constexprs, **options), with the compiled
    variant reused directly.

    Triton's own launch binds and specializes every argument in Python on every call (120–240 µs of
    host time for these kernels' ~45 arguments on the H200, more than a small GEMM's GPU time). The
    kernels specialize on nothing but their constexprs, the dtypes of their operands and whether an
    integer needs 64 bits (integers are `do_not_specialize`; every pointer is 16-byte aligned: TMA
    requires it, the allocator gives it), so the caller names the variant by those (`variant`, with
    the device) and it is launched through its compiled handle (`_Handle`), found once per launcher
    (a `_Layout` keeps its launchers: a checked call builds no key). Should a Triton version launch
    differently, the first failure turns this off (with a warning) and every launch takes Triton's
    own path; so does a launch while a launch hook (a profiler) is installed."""

    __slots__ = ("constants", "constexprs", "handle", "kernel", "key", "options")

    def __init__(self, kernel, constexprs: dict, options: dict, variant: tuple) -> None:
        self.kernel, self.constexprs, self.options = kernel, constexprs, options
        self.key = (kernel, variant, *constexprs.values(), *options.values())
        self.constants = tuple(constexprs.values())  # the handle takes every parameter, constexprs last
        self.handle: _Handle | None = None

    def __call__(self, grid: tuple[int, ...], args: tuple) -> None:
        global _direct_launch
        with descriptor_scratch():
            if not _direct_launch:
                self.kernel[grid](*args, **self.constexprs, **self.options)
                return
            handle = self.handle or _COMPILED.get(self.key)
            if handle is None or _hooked():
                compiled = self.kernel[grid](*args, **self.constexprs, **self.options)
                if handle is None:
                    handle = _COMPILED[self.key] = _Handle.of(compiled)
                self.handle = handle
                return
            self.handle = handle
            try:
                # What Triton's own launch does once the variant is known: the current device's
                # current stream, three grid sizes, no launch metadata (no hook), every parameter.
                driver = triton.runtime.driver.active
                stream = driver.get_current_stream(driver.get_current_device())
                grid3 = (*grid, 1, 1)
                handle.run(grid3[0], grid3[1], grid3[2], stream, handle.function, handle.metadata, None, None, None,
                           *args, *self.constants)  # fmt: skip
            except Exception as error:  # any failure: fall back for good, loudly
                _direct_launch = False
                warnings.warn(f"aegis-sdc: direct kernel launch failed ({error!r}); using Triton's launch path",
                              stacklevel=2)  # fmt: skip
                self.kernel[grid](*args, **self.constexprs, **self.options)


def _launch(kernel, grid: tuple[int, ...], args: tuple, constexprs: dict, options: dict, variant: tuple) -> None:
    """One launch of a variant named by the caller (`_Launcher`; callers that launch a variant often keep one)."""
    _Launcher(kernel, constexprs, options, variant)(grid, args)


def _wide(*ints: int) -> bool:
    """Whether any of these integer arguments needs 64 bits (Triton compiles such a variant apart)."""
    return max(ints) >= 2**31 or min(ints) < -(2**31)


_EVIDENCE_OPTIONS = {"num_warps": 4}


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What a launch of one shape, orientation and set of checks passes besides its operands: the
    grid, constexprs and variant, the partial-sum buffers and the integers that do not change from
    call to call. Made once per such key for the training step's launches (`scratch`: the buffers
    are the shared workspaces) and reused by every call: a checked call assembles only its
    operands' arguments."""

    grid: tuple[int]
    constexprs: dict
    options: dict
    variant: tuple
    parts: tuple  # row_part, rsq_part, out_part, col_part, csq_part, rowref, rowones, colref (fillers where absent)
    results: tuple  # the same, None where absent (GemmLaunch)
    strides: tuple[int, int, int, int, int]  # stride_a, stride_b, stride_c, data_len, f32_len
    shape_ints: tuple[int, ...]  # side_all, row_parts, col_parts, M, N, K
    checked: bool  # evidence is computed (it needs a stats slot and counters)
    inline: bool  # evidence and by-product finished inside the GEMM launch (it needs counters)
    totals: torch.Tensor  # fp64 [3·M + 2·N], zero (inline: the launch's sums; gemm_evidence)
    evidence: tuple[int, dict] | None  # the second launch's programs and constexprs (evidence, by-product)
    counters: int  # counters the evidence needs
    fill: _Fillers  # the device's fillers for absent tensors
    gemm_launcher: _Launcher
    evidence_launcher: _Launcher | None

    @classmethod
    def of(cls, key: tuple, buffer: Callable) -> _Layout:
        (dev, m, n, k, a_t, b_t, a_dtype, _, _, bias_dtype, row_check, row_side, col_check, capture, evidence,
         has_byproduct, has_side_out, model, side_all, row_parts, col_parts, cfg, pool, stride_a, stride_b,
         stride_c) = key  # fmt: skip
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        tiles_m, tiles_n = ceil_div(m, bm), ceil_div(n, bn)
        row_parts = row_parts or row_side_parts(tiles_n, cfg)
        col_parts = col_parts or side_parts(tiles_m, cfg)
        if has_side_out and a_dtype != torch.bfloat16:
            raise ValueError("the kernel writes S(A·1) for bf16 operands only (fp16 needs a scale: SideMatrix.of)")
        if (has_byproduct or has_side_out) and not row_side:
            raise ValueError("a by-product needs the row side")
        evidence = evidence and (row_check or col_check)
        if evidence and row_check and not row_side:
            raise ValueError("row evidence needs the row side")
        if side_all and (has_byproduct or evidence):
            raise ValueError("a replay of one tile (side_all) computes no evidence or by-product")
        if capture != CAPTURE_NONE and pool is None:
            raise ValueError("a capture needs a CapturePool")
        f32, f64 = torch.float32, torch.float64
        results = (
            buffer(dev, "row_part", (tiles_n, m), f32) if row_check else None,
            buffer(dev, "rsq_part", (tiles_n, m), f32) if row_check else None,
            buffer(dev, "out_part", (tiles_n, m), f32) if row_check else None,
            buffer(dev, "col_part", (tiles_m, n), f32) if col_check else None,
            buffer(dev, "csq_part", (tiles_m, n), f32) if col_check else None,
            buffer(dev, "rowref", (row_parts, m), f64) if row_side else None,
            buffer(dev, "rowones", (row_parts, m), f64) if row_side else None,
            buffer(dev, "colref", (col_parts, n), f64) if col_check else None,
        )
        fill = _fillers(dev)
        parts = tuple(t if t is not None else (fill.f32 if i < 5 else fill.f64) for i, t in enumerate(results))
        slots, data_len, f32_len = pool if pool is not None else (1, 0, 0)
        strides = (stride_a, stride_b, stride_c, data_len, f32_len)
        shape_ints = (int(side_all), row_parts, col_parts, m, n, k)
        # Inline: the blocks are finished inside the GEMM launch (evidence, by-product), else by a second launch
        finishing = evidence or has_byproduct or has_side_out
        inline = finishing and cfg.inline_evidence
        constexprs = dict(
            A_T=a_t,
            B_T=b_t,
            HAS_BIAS=bias_dtype is not None,
            ROW_CHECK=row_check,
            ROW_SIDE=row_side,
            SIDE_IN_LOOP=side_in_loop_mode(cfg) if row_side else 0,
            COL_IN_LOOP=col_check and cfg.col_side_on_cuda_cores,
            COL_CHECK=col_check,
            FAULT=model,
            EVIDENCE=inline,
            TOTALS=inline and cfg.inline_totals,
            BYPRODUCT=has_byproduct and inline,
            SIDE_OUT=has_side_out and inline,
            CAPTURE=capture,
            POOL=slots,
            DT=_TL_DTYPES[a_dtype],
            UPCAST=INTERPRET,
            BM=bm,
            BN=bn,
            BK=bk,
            GROUP_M=cfg.group_m,
        )  # fmt: skip (the kernel's constexpr parameters, in their order)
        second = None
        separate = evidence and not inline
        if finishing and not inline:
            checks = (row_check, col_check) if separate else (False, False)
            blocks = (tiles_m if checks[0] or has_byproduct or has_side_out else 0) + (tiles_n if checks[1] else 0)
            second = (blocks, dict(A_T=a_t, B_T=b_t, ROW_CHECK=checks[0], COL_CHECK=checks[1],
                                   CAPTURE=capture if separate else CAPTURE_NONE, POOL=slots,
                                   BYPRODUCT=has_byproduct, SIDE_OUT=has_side_out, DT=_TL_DTYPES[a_dtype], BM=bm,
                                   BN=bn))  # fmt: skip
        # fault row/column/mask are in the i32 range by construction (indices, a 32-bit mask)
        variant = (dev, *key[6:10], _wide(*strides, *shape_ints))
        options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        totals = buffer(dev, "totals", (3 * m + 2 * n,), f64, True) if inline and cfg.inline_totals else fill.f64
        return cls((min(num_sms(dev), tiles_m * tiles_n),), constexprs, options, variant, parts, results, strides,
                   shape_ints, evidence, inline, totals, second, counters_needed(m, n, cfg) if evidence or inline else 0,
                   fill, _Launcher(checked_gemm_kernel, constexprs, options, variant),
                   None if second is None else _Launcher(evidence_kernel, second[1], _EVIDENCE_OPTIONS, variant))  # fmt: skip


_LAYOUTS: dict[tuple, _Layout] = {}
MAX_LAYOUTS = 4096


@dataclasses.dataclass
class GemmLaunch:
    """What one launch produced besides C (partials are per tile, sides per K slice; see the module
    docstring). The totals below are torch sums for tests and tools; the evidence sums the parts in
    its own fixed order, and replays compare the parts."""

    row_part: torch.Tensor | None  # [tiles_n, M] Σ_j acc
    rsq_part: torch.Tensor | None  # [tiles_n, M] Σ_j acc²
    out_part: torch.Tensor | None  # [tiles_n, M] the rounded output's row checksums (_output_checksums)
    col_part: torch.Tensor | None  # [tiles_m, N] Σ_i acc
    csq_part: torch.Tensor | None  # [tiles_m, N] Σ_i acc²
    rowref_parts: torch.Tensor | None  # [row_parts, M] fp64: A·c per K slice
    rowones_parts: torch.Tensor | None  # [row_parts, M] fp64: A·1 per K slice
    colref_parts: torch.Tensor | None  # [col_parts, N] fp64: u1ᵀB per K slice
    byproduct: torch.Tensor | None  # [M] fp64: A·1 as the finishing launch summed it (when asked for)

    @property
    def rowref(self) -> torch.Tensor | None:
        return None if self.rowref_parts is None else self.rowref_parts.sum(dim=0)

    @property
    def rowones(self) -> torch.Tensor | None:
        if self.byproduct is not None:
            return self.byproduct
        return None if self.rowones_parts is None else self.rowones_parts.sum(dim=0)

    @property
    def colref(self) -> torch.Tensor | None:
        return None if self.colref_parts is None else self.colref_parts.sum(dim=0)


def launch_checked_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    *,
    a_t: bool,
    b_t: bool,
    bias: torch.Tensor | None = None,
    cvec: torch.Tensor | None = None,
    u1: torch.Tensor | None = None,
    c_side: SideMatrix | None = None,
    u_side: SideMatrix | None = None,
    row_check: bool = False,
    row_side: bool = False,
    col_check: bool = False,
    stats: torch.Tensor | None = None,
    stats_f64: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    pool: CapturePool | None = None,
    capture: int = CAPTURE_NONE,
    row_threshold: float = float("inf"),
    col_threshold: float = float("inf"),
    fault: tuple[int, int, int, float, int] | None = None,  # (model, row, col, delta, xor mask)
    byproduct: torch.Tensor | None = None,
    byproduct_side: torch.Tensor | None = None,
    side_all: bool = False,
    row_parts: int | None = None,
    col_parts: int | None = None,
    evidence: bool = True,
    cfg: TritonGemmConfig | None = None,
    scratch: bool = False,
) -> GemmLaunch:
    """C = A·B into `out` [M, N] (row-major) with the requested checks; see the module docstring.

    `a` is A [M, K] (or Aᵀ [K, M] when a_t); `b` is B [K, N] (or Bᵀ [N, K] when b_t). The row side
    needs c = B·1 (`cvec`, fp64 [K]) and a column check u1 = 1ᵀA (`u1`, fp64 [K]); their side matrices
    (`c_side`, `u_side`, gemm_side.SideMatrix) are built here when not given — callers that launch
    often keep them (once per weight and step). `stats` (int64 [STATS_LEN], zero; `stats_f64` its
    fp64 view, where the caller keeps one) and `counters` (int32 [counters_needed(M, N, cfg)], zero)
    are needed for evidence.

    `byproduct` (fp64 [M]) receives A·1 and `byproduct_side` ([M, 16], bf16 operands) its S, for a
    later wgrad check: both written where the evidence is finished (also for an unchecked call that
    asks for them). `side_all`: one tile computes every K slice of both sides — a replay of one tile,
    with `row_parts` / `col_parts` set to the original launch's tiles_n / tiles_m (default: this
    launch's). Nothing here synchronizes with the host. `scratch`:
    the partials live in buffers shared by all launches (`_workspace`), for callers that read nothing
    of the returned `GemmLaunch` (the training step); without it they are fresh tensors.
    """
    m, n = out.shape
    k = a.shape[0] if a_t else a.shape[1]
    cfg = cfg or config_for(m, n, k)
    dev = a.device
    if row_side and c_side is None:
        if cvec is None:
            raise ValueError("the row side needs c = B·1 (cvec or c_side)")
        c_side = SideMatrix.of(cvec, a.dtype)
    if col_check and u_side is None:
        if u1 is None:
            raise ValueError("a column check needs u1 = 1ᵀA (u1 or u_side)")
        u_side = SideMatrix.of(u1, a.dtype)
    model, frow, fcol, fdelta, fmask = fault if fault is not None else (FAULT_NONE, -1, -1, 0.0, 0)
    key = (dev, m, n, k, a_t, b_t, a.dtype, b.dtype, out.dtype, None if bias is None else bias.dtype, row_check,
           row_side, col_check, capture, evidence, byproduct is not None, byproduct_side is not None, model,
           bool(side_all), row_parts, col_parts, cfg, None if pool is None else (pool.slots, *pool.data.shape[1:],
           *pool.f32.shape[1:]), a.stride(0), b.stride(0), out.stride(0))  # fmt: skip
    layout = _LAYOUTS.get(key) if scratch else None
    if layout is None:
        layout = _Layout.of(key, _workspace if scratch else _fresh)
        if scratch:
            if len(_LAYOUTS) >= MAX_LAYOUTS:  # shapes that keep changing (variable lengths): start over
                _LAYOUTS.clear()
            _LAYOUTS[key] = layout
    if layout.checked and stats is None:
        raise ValueError("evidence needs a zeroed stats slot")
    if layout.counters:
        if counters is None:
            raise ValueError("evidence and by-products need zeroed counters")
        if counters.numel() < layout.counters:
            raise ValueError(f"evidence needs {layout.counters} counters, got {counters.numel()}")
    fill = layout.fill
    if stats is None:
        stats, stats_f64 = fill.stats, fill.stats_f64
    elif stats_f64 is None:
        stats_f64 = stats.view(torch.float64)
    no_side = fill.sides[a.dtype]
    pool_data, pool_f32, pool_counter = (pool.data, pool.f32, pool.counter) if pool is not None else (out, fill.f64,
                                                                                                      fill.i32)  # fmt: skip
    thresholds = (float(row_threshold), float(col_threshold))
    # the kernel's parameters, in their order (fault_delta sits between fault_col and fault_mask)
    args = (a, b, out, bias if bias is not None else fill.f32, c_side.matrix if c_side is not None else no_side,
            u_side.matrix if u_side is not None else no_side, c_side.scale if c_side is not None else fill.f32,
            u_side.scale if u_side is not None else fill.f32, *layout.parts,
            byproduct if byproduct is not None else fill.f64, byproduct_side if byproduct_side is not None else out,
            counters if counters is not None else fill.i32, layout.totals, stats, stats_f64, pool_data, pool_f32,
            pool_counter,
            *thresholds, *layout.strides, int(frow), int(fcol), float(fdelta), int(fmask),
            *layout.shape_ints)  # fmt: skip
    layout.gemm_launcher(layout.grid, args)
    if layout.evidence is not None:
        blocks, _ = layout.evidence
        args = (a, b, *layout.parts, byproduct if byproduct is not None else fill.f64,
                byproduct_side if byproduct_side is not None else out,
                counters if counters is not None else pool_counter, stats, stats_f64, pool_data, pool_f32,
                pool_counter, *thresholds, m, n, k, *layout.shape_ints[1:3], *layout.strides[:2],
                *layout.strides[3:])  # fmt: skip
        layout.evidence_launcher((blocks,), args)
    return GemmLaunch(*layout.results, byproduct)
