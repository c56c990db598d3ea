"""Fused checked GEMM for CUDA tensors: C = A·B with checksums of the fp32 accumulator, in Triton.

One persistent kernel computes the GEMM tile by tile (TMA descriptors, fp32 accumulation, no
split-K: every tile is reduced by one program in a fixed K order, so a tile replays bit for bit).
The K loop is the plain GEMM loop; everything the checks add happens around it, in the same launch:

- epilogue: per tile, the row sums (and column sums) of the fp32 accumulator before rounding, and
  the row sums of the rounded output — `row_part`, `out_part` [tiles_n, M], `col_part` [tiles_m, N];
- reference side, rows: A·c and A²·β (c = B·1, β_k = ‖B_k,:‖², given: cached once per step for a
  weight) and, as by-products for a later wgrad, A·1 and A²·1. The work is split over the tiles of a
  row block by K sub-range: after its own K loop, tile (m, j) re-reads A's tiles for K sub-range j of
  tiles_n (still in L2) and reduces them — `rowvec` [4, tiles_n, M] partials. Concentrating the work
  in one column of tiles instead makes those tiles stragglers of the persistent schedule.
- reference side, columns (wgrad): u1ᵀB and u2ᵀB² with u1 = 1ᵀA, u2_k = ‖A_:,k‖² given, split the
  same way over the tiles of a column block — `colvec` [2, tiles_m, N] partials;
- evidence: the last program to finish a row block (an atomic counter per block) sums that block's
  partials in fp64, normalizes the differences by u·s and folds the block maximum into a packed
  (value, index) atomic max; the same per column block. The last evidence program of the launch
  compares the maxima with the site's thresholds and, on an alarm, copies the replay context into
  a capture-pool slot. Counters reset themselves: nothing is launched besides the GEMM.

Operand orientation (logical C[M, N] = A[M, K]·B[K, N]):
    A_T = False: `a` is A [M, K] row-major;   A_T = True: `a` is Aᵀ stored [K, M] row-major (wgrad's dYᵀ)
    B_T = True:  `b` is Bᵀ stored [N, K] (a Linear weight in forward);  B_T = False: `b` is B [K, N]

Under TRITON_INTERPRET=1 bf16 arithmetic is wrong in Triton's interpreter (bit patterns are
multiplied), so operands are upcast to fp32 after loading there (UPCAST); loads/stores stay exact.
"""

from __future__ import annotations

import math
import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Kernels may read module globals only when they are tl.constexpr.
U32 = tl.constexpr(2.0**-24)
TINY = tl.constexpr(1.1754943508222875e-38)
NAN_VALUE = tl.constexpr(3.0e38)  # a non-finite difference is folded into the maximum as this (and flagged)

# Layout of the per-call evidence slot (int64[8]); decoded by sensors.gemm.decode_triton_stats.
ST_ROW, ST_COL, ST_NONFINITE, ST_ALARM, ST_SLOT, ST_EVIDENCE_DONE, ST_ROW_L2SQ, ST_COL_L2SQ = range(8)
STATS_LEN = 8
_ST_ROW, _ST_COL, _ST_NONFINITE, _ST_ALARM, _ST_SLOT, _ST_EVIDENCE_DONE, _ST_ROW_L2SQ, _ST_COL_L2SQ = (
    tl.constexpr(i) for i in range(8)
)
# Fault models (constexpr): 0 none, 1 perturb (add delta), 2 bitflip (xor bits)
FAULT_NONE, FAULT_PERTURB, FAULT_BITFLIP = 0, 1, 2
# Capture kinds (constexpr): what the final evidence program copies on an alarm
CAPTURE_NONE, CAPTURE_ROWS, CAPTURE_TILE = 0, 1, 2


@triton.jit
def _tile_coords(tile_id, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Grouped (L2-friendly) order: GROUP_M row tiles sweep all column tiles together."""
    in_group = GROUP_M * tiles_n
    group = tile_id // in_group
    first_m = group * GROUP_M
    size_m = min(tiles_m - first_m, GROUP_M)
    return first_m + (tile_id % size_m), (tile_id % in_group) // size_m


@triton.jit
def _k_range(index, parts, k_tiles):
    """The K-tile sub-range [lo, hi) that part `index` of `parts` owns."""
    return (index * k_tiles) // parts, ((index + 1) * k_tiles) // parts


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
def _row_side(a_ptr, stride_a, cvec_ptr, beta_ptr, acol_ptr, pid_m, off_m, k_lo, k_hi, M, K,
              A_T: tl.constexpr, A_COLSUMS: tl.constexpr, BYPRODUCTS: tl.constexpr, BM: tl.constexpr,
              BK: tl.constexpr, SK: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """A·c, A²·β, A·1, A²·1 of one row block over K tiles [k_lo, k_hi) (and 1ᵀA, ‖A_:,k‖² there).

    Reads A in chunks through plain pipelined loads (small register tiles: this runs after the tile's
    own K loop). A·c and A·1 accumulate in fp64 (c is fp64): they are compared with sums of the fp32
    accumulator, and an fp32 running sum of K products would add noise that grows with the weights'
    row means. The squares only scale the comparison and stay fp32. When A is stored transposed the
    sums run across the loaded chunk's rows, i.e. across threads: they are accumulated elementwise
    and reduced once after the loop instead of once per chunk."""
    rows = off_m + tl.arange(0, BM)
    rmask = rows < M
    if A_T:  # Aᵀ stored [K, M]: chunks [SK, BM], contiguous along the rows of A
        ref_e = tl.zeros((SK, BM), dtype=tl.float64)
        s1_e = tl.zeros((SK, BM), dtype=tl.float64)
        sq_e = tl.zeros((SK, BM), dtype=tl.float32)
        s2_e = tl.zeros((SK, BM), dtype=tl.float32)
        for kc in tl.range(k_lo * (BK // SK), k_hi * (BK // SK), num_stages=STAGES):
            offs_k = kc * SK + tl.arange(0, SK)
            kmask = offs_k < K
            c = tl.load(cvec_ptr + offs_k, mask=kmask, other=0.0)
            beta = tl.load(beta_ptr + offs_k, mask=kmask, other=0.0)
            af = tl.load(a_ptr + offs_k[:, None] * stride_a + rows[None, :],
                         mask=kmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)  # fmt: skip
            ad = af.to(tl.float64)
            ref_e += ad * c[:, None]
            sq_e += af * af * beta[:, None]
            if BYPRODUCTS:
                s1_e += ad
                s2_e += af * af
        return (tl.sum(ref_e, axis=0), tl.sum(sq_e, axis=0).to(tl.float64), tl.sum(s1_e, axis=0),
                tl.sum(s2_e, axis=0).to(tl.float64))  # fmt: skip
    ref = tl.zeros((BM,), dtype=tl.float64)
    s1 = tl.zeros((BM,), dtype=tl.float64)
    sq = tl.zeros((BM,), dtype=tl.float32)
    s2 = tl.zeros((BM,), dtype=tl.float32)
    for kc in tl.range(k_lo * (BK // SK), k_hi * (BK // SK), num_stages=STAGES):
        offs_k = kc * SK + tl.arange(0, SK)
        kmask = offs_k < K
        c = tl.load(cvec_ptr + offs_k, mask=kmask, other=0.0)
        beta = tl.load(beta_ptr + offs_k, mask=kmask, other=0.0)
        af = tl.load(a_ptr + rows[:, None] * stride_a + offs_k[None, :],
                     mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        ad = af.to(tl.float64)
        ref += tl.sum(ad * c[None, :], axis=1)
        sq += tl.sum(af * af * beta[None, :], axis=1)
        if BYPRODUCTS:  # A·1 and ‖A_i‖², for a later wgrad check
            s1 += tl.sum(ad, axis=1)
            s2 += tl.sum(af * af, axis=1)
        if A_COLSUMS:  # 1ᵀA and ‖A_:,k‖² of this row block, for a forward/dgrad column check
            tl.store(acol_ptr + pid_m * 2 * K + offs_k, tl.sum(ad, axis=0), mask=kmask)
            tl.store(acol_ptr + pid_m * 2 * K + K + offs_k, tl.sum(af * af, axis=0).to(tl.float64), mask=kmask)
    return ref, sq.to(tl.float64), s1, s2.to(tl.float64)


@triton.jit
def _col_side(b_ptr, stride_b, u1_ptr, u2_ptr, off_n, k_lo, k_hi, N, K,
              B_T: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SK: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """u1ᵀB (fp64, u1 fp64) and u2ᵀB² (fp32) of one column block over K tiles [k_lo, k_hi).

    B [K, N] is read in [SK, BN] chunks; the sums run across the chunk's rows, so they are
    accumulated elementwise and reduced once after the loop (see `_row_side`)."""
    cols = off_n + tl.arange(0, BN)
    cmask = cols < N
    if B_T:  # Bᵀ stored [N, K]: chunks [BN, SK], sums along the contiguous dimension
        cref = tl.zeros((BN,), dtype=tl.float64)
        csq = tl.zeros((BN,), dtype=tl.float32)
        for kc in tl.range(k_lo * (BK // SK), k_hi * (BK // SK), num_stages=STAGES):
            offs_k = kc * SK + tl.arange(0, SK)
            kmask = offs_k < K
            u1 = tl.load(u1_ptr + offs_k, mask=kmask, other=0.0)
            u2 = tl.load(u2_ptr + offs_k, mask=kmask, other=0.0)
            bf = tl.load(b_ptr + cols[:, None] * stride_b + offs_k[None, :],
                         mask=cmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)  # fmt: skip
            cref += tl.sum(bf.to(tl.float64) * u1[None, :], axis=1)
            csq += tl.sum(bf * bf * u2[None, :], axis=1)
        return cref, csq.to(tl.float64)
    cref_e = tl.zeros((SK, BN), dtype=tl.float64)
    csq_e = tl.zeros((SK, BN), dtype=tl.float32)
    for kc in tl.range(k_lo * (BK // SK), k_hi * (BK // SK), num_stages=STAGES):
        offs_k = kc * SK + tl.arange(0, SK)
        kmask = offs_k < K
        u1 = tl.load(u1_ptr + offs_k, mask=kmask, other=0.0)
        u2 = tl.load(u2_ptr + offs_k, mask=kmask, other=0.0)
        bf = tl.load(b_ptr + offs_k[:, None] * stride_b + cols[None, :],
                     mask=kmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        cref_e += bf.to(tl.float64) * u1[:, None]
        csq_e += bf * bf * u2[:, None]
    return tl.sum(cref_e, axis=0), tl.sum(csq_e, axis=0).to(tl.float64)


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
def _block_evidence(part_ptr, vec_ptr, parts, vec_parts, size, start, stats_ptr, stats_f64_ptr,
                    SLOT: tl.constexpr, L2_SLOT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Finish one row (or column) block: fp64 sums of its partials, normalized difference, packed max.

    `part_ptr` [parts, size]: checksum partials; `vec_ptr` [2, vec_parts, size]: reference and
    squared-scale partials."""
    offs = start + tl.arange(0, BLOCK)
    mask = offs < size
    total = _sum_parts(part_ptr, parts, size, offs, mask, 16)
    ref = _sum_parts(vec_ptr, vec_parts, size, offs, mask, 16)
    sq = _sum_parts(vec_ptr + vec_parts * size, vec_parts, size, offs, mask, 16)
    raw = tl.where(mask, tl.abs(total - ref), 0.0)
    tl.atomic_add(stats_f64_ptr + L2_SLOT, tl.sum(raw * raw, axis=0))  # a statistic: order-free is fine
    diff = raw / tl.maximum(U32 * tl.sqrt(sq), TINY)
    nonfinite = (diff != diff) | (diff == float("inf"))
    diff = tl.where(nonfinite, NAN_VALUE, diff)
    diff = tl.where(mask, diff, 0.0).to(tl.float32)
    tl.atomic_max(stats_ptr + SLOT, _pack(tl.max(diff, axis=0), start + tl.argmax(diff, axis=0)))
    any_nonfinite = tl.max((nonfinite & mask).to(tl.int32), axis=0)
    if any_nonfinite > 0:
        tl.atomic_max(stats_ptr + _ST_NONFINITE, any_nonfinite.to(tl.int64))


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
def _capture(a_ptr, b_ptr, row_part_ptr, out_part_ptr, col_part_ptr, rowvec_ptr, colvec_ptr,
             pool_data_ptr, pool_f32_ptr, pool_counter_ptr, stats_ptr, row0, col0, M, N, K, tiles_m, tiles_n,
             stride_a, stride_b, data_len, f32_len, POOL: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr,
             CAPTURE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """Copy the replay context of an alarm into a free slot of the capture pool.

    Slot, data part (operand dtype): A's row block [BM, K] ([K, BM] when A_T); for a tile capture
    also B's column block [BN, K] when B_T else [K, BN].
    Slot, fp32 part — rows capture (all tiles j of the row block): row_part [tiles_n, BM],
    out_part [tiles_n, BM], rowvec [4, tiles_n, BM]; tile capture (tile i, j): row_part [BM],
    out_part [BM], rowvec [4, BM] (part j), col_part [BN], colvec [2, BN] (part i).
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
            for v in range(4):
                _copy_parts(rowvec_ptr + (v * tiles_n + j) * M, 1, M, row0, f32 + (2 + v) * BM, BM)
            f32 += 6 * BM
            _copy_parts(col_part_ptr + i * N, 1, N, col0, f32, BN)
            for v in range(2):
                _copy_parts(colvec_ptr + (v * tiles_m + i) * N, 1, N, col0, f32 + (1 + v) * BN, BN)
        else:
            _copy_parts(row_part_ptr, tiles_n, M, row0, f32, BM)
            _copy_parts(out_part_ptr, tiles_n, M, row0, f32 + tiles_n * BM, BM)
            _copy_parts(rowvec_ptr, 4 * tiles_n, M, row0, f32 + 2 * tiles_n * BM, BM)
        tl.store(stats_ptr + _ST_SLOT, (slot + 1).to(tl.int64))


@triton.jit
def checked_gemm_kernel(
    a_desc,
    b_desc,
    c_desc,  # C [M, N] (TMA store)
    a_ptr,  # the storage behind a_desc, for the capture copy
    b_ptr,  # the storage behind b_desc
    bias_ptr,
    cvec_ptr,  # [K] fp64: B·1
    beta_ptr,  # [K] fp32: ‖B_k,:‖²
    u1_ptr,  # [K] fp64: 1ᵀA (column side)
    u2_ptr,  # [K] fp32: ‖A_:,k‖²
    row_part_ptr,  # [tiles_n, M] fp32 out: Σ_j acc per tile
    out_part_ptr,  # [tiles_n, M] fp32 out: Σ_j of the rounded output per tile
    col_part_ptr,  # [tiles_m, N] fp32 out: Σ_i acc per tile
    rowvec_ptr,  # [4, tiles_n, M] fp64 out: A·c, A²·β, A·1, A²·1 over each tile's K sub-range
    colvec_ptr,  # [2, tiles_m, N] fp64 out: u1ᵀB, u2ᵀB² over each tile's K sub-range
    acol_ptr,  # [tiles_m, 2, K] fp64 out: 1ᵀA and ‖A_:,k‖² per row block (forward/dgrad column checks)
    fault_row,
    fault_col,
    fault_delta,
    fault_mask,
    M,
    N,
    K,
    stride_a,  # row stride of a's storage
    stride_b,  # row stride of b's storage
    pid_m_base,  # replays: the original tile coordinates and tile counts, so that every
    pid_n_base,  # K sub-range is the one the training step's tile owned
    range_m,
    range_n,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROW_CHECK: tl.constexpr,  # row partials (and row evidence)
    ROW_SIDE: tl.constexpr,  # rowvec partials
    COL_PARTIALS: tl.constexpr,
    COL_SIDE: tl.constexpr,  # colvec partials (wgrad) and column evidence
    A_COLSUMS: tl.constexpr,  # forward/dgrad column check: by-products for `col_side_kernel`
    BYPRODUCTS: tl.constexpr,  # A·1 and ‖A_i‖² (for a later wgrad check)
    FAULT: tl.constexpr,
    UPCAST: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,
    SIDE_K: tl.constexpr,  # K chunk of the reference-side loops
    SIDE_K_T: tl.constexpr,  # the same, where the sums run across the chunk's rows
    SIDE_STAGES: tl.constexpr,
):
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile_id in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = _load_a(a_desc, off_m, ki * BK, A_T, UPCAST)
            b = _load_b(b_desc, off_n, ki * BK, B_T, UPCAST)
            acc = tl.dot(a, b, acc)

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
        out = out.to(c_desc.dtype)
        if ROW_CHECK:
            tl.store(row_part_ptr + pid_n * M + offs_m, tl.sum(acc, axis=1), mask=mask_m)
            tl.store(out_part_ptr + pid_n * M + offs_m, tl.sum(out.to(tl.float32), axis=1), mask=mask_m)
        if COL_PARTIALS:
            tl.store(col_part_ptr + pid_m * N + offs_n, tl.sum(acc, axis=0), mask=mask_n)
        c_desc.store([off_m, off_n], out)

        if ROW_SIDE:  # this tile's share of the row block's reference side
            part = pid_n + pid_n_base
            k_lo, k_hi = _k_range(part, range_n, k_tiles)
            ref, sq, s1, s2 = _row_side(a_ptr, stride_a, cvec_ptr, beta_ptr, acol_ptr, pid_m, off_m, k_lo, k_hi,
                                        M, K, A_T, A_COLSUMS, BYPRODUCTS, BM, BK, SIDE_K_T if A_T else SIDE_K,
                                        SIDE_STAGES)  # fmt: skip
            base = rowvec_ptr + pid_n * M + offs_m
            stride = tiles_n * M
            tl.store(base, ref, mask=mask_m)
            tl.store(base + stride, sq, mask=mask_m)
            tl.store(base + 2 * stride, s1, mask=mask_m)
            tl.store(base + 3 * stride, s2, mask=mask_m)
        if COL_SIDE:  # this tile's share of the column block's reference side
            part = pid_m + pid_m_base
            k_lo, k_hi = _k_range(part, range_m, k_tiles)
            cref, csq = _col_side(b_ptr, stride_b, u1_ptr, u2_ptr, off_n, k_lo, k_hi, N, K, B_T, BN, BK,
                                  SIDE_K_T, SIDE_STAGES)  # fmt: skip
            base = colvec_ptr + pid_m * N + offs_n
            tl.store(base, cref, mask=mask_n)
            tl.store(base + tiles_m * N, csq, mask=mask_n)


@triton.jit
def evidence_kernel(
    a_ptr,
    b_ptr,
    row_part_ptr,
    out_part_ptr,
    col_part_ptr,
    rowvec_ptr,
    colvec_ptr,
    counter_ptr,  # int32 [1]: zero before, left zero after
    stats_ptr,
    stats_f64_ptr,
    pool_data_ptr,
    pool_f32_ptr,
    pool_counter_ptr,
    row_threshold,
    col_threshold,
    M,
    N,
    K,
    stride_a,
    stride_b,
    data_len,
    f32_len,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    ROW_CHECK: tl.constexpr,
    COL_SIDE: tl.constexpr,
    CAPTURE: tl.constexpr,
    POOL: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """The GEMM's evidence, right after it on the same stream: one program per row block (and per
    column block) sums the block's partials in fp64, normalizes the differences by u·s and folds the
    block maximum into a packed (value, index) atomic max. The last program compares the maxima with
    the site's thresholds and, on an alarm, copies the replay context into a capture-pool slot.

    A separate launch rather than the GEMM's own last tiles: counting arrivals inside the GEMM needs
    an acquire-release atomic per tile, and its fence stalled every tile (15–20% of the GEMM)."""
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    pid = tl.program_id(0)
    row_blocks = tiles_m if ROW_CHECK else 0
    if pid < row_blocks:
        _block_evidence(row_part_ptr, rowvec_ptr, tiles_n, tiles_n, M, pid * BM, stats_ptr, stats_f64_ptr,
                        _ST_ROW, _ST_ROW_L2SQ, BM)  # fmt: skip
    else:
        _block_evidence(col_part_ptr, colvec_ptr, tiles_m, tiles_m, N, (pid - row_blocks) * BN, stats_ptr,
                        stats_f64_ptr, _ST_COL, _ST_COL_L2SQ, BN)  # fmt: skip
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.store(counter_ptr, 0)
        row_packed = tl.load(stats_ptr + _ST_ROW, cache_modifier=".cg")
        col_packed = tl.load(stats_ptr + _ST_COL, cache_modifier=".cg")
        nonfinite = tl.load(stats_ptr + _ST_NONFINITE, cache_modifier=".cg")
        row_alarm = ((_unpack_value(row_packed) > row_threshold) | (nonfinite > 0)) & ROW_CHECK
        col_alarm = (_unpack_value(col_packed) > col_threshold) & COL_SIDE
        alarm = row_alarm.to(tl.int64) + 2 * col_alarm.to(tl.int64)
        tl.store(stats_ptr + _ST_ALARM, alarm)
        tl.store(stats_ptr + _ST_EVIDENCE_DONE, 1)
        if CAPTURE != 0:
            if alarm != 0:
                _capture(a_ptr, b_ptr, row_part_ptr, out_part_ptr, col_part_ptr, rowvec_ptr, colvec_ptr,
                         pool_data_ptr, pool_f32_ptr, pool_counter_ptr, stats_ptr,
                         ((row_packed & 0xFFFFFFFF) // BM) * BM, ((col_packed & 0xFFFFFFFF) // BN) * BN,
                         M, N, K, tiles_m, tiles_n, stride_a, stride_b, data_len, f32_len,
                         POOL, A_T, B_T, CAPTURE, BM, BN)  # fmt: skip


@triton.jit
def col_side_kernel(
    b_ptr,
    stride_b,
    u_ptr,  # [2, K] fp64: 1ᵀA, ‖A_:,k‖²
    col_part_ptr,  # [tiles_m, N] fp32
    stats_ptr,
    stats_f64_ptr,
    col_threshold,
    tiles_m,
    N,
    K,
    B_T: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """Column check of a forward/dgrad GEMM, after it: (1ᵀA)·B and ‖A_:,k‖²·B² need all of A's rows,
    so they cannot ride along in the GEMM's own tiles. One pass over B (the weight), BN columns per
    program; then the column evidence, folded into the same slot as the GEMM's row evidence."""
    off_n = tl.program_id(0) * BN
    offs_n = off_n + tl.arange(0, BN)
    nmask = offs_n < N
    cref = tl.zeros((BN,), dtype=tl.float64)
    csq = tl.zeros((BN,), dtype=tl.float64)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        kmask = offs_k < K
        u1 = tl.load(u_ptr + offs_k, mask=kmask, other=0.0)
        u2 = tl.load(u_ptr + K + offs_k, mask=kmask, other=0.0)
        m = kmask[:, None] & nmask[None, :]
        if B_T:
            b = tl.load(b_ptr + offs_n[None, :] * stride_b + offs_k[:, None], mask=m, other=0.0)
        else:
            b = tl.load(b_ptr + offs_k[:, None] * stride_b + offs_n[None, :], mask=m, other=0.0)
        bf = b.to(tl.float64)
        cref += tl.sum(bf * u1[:, None], axis=0)
        csq += tl.sum(bf * bf * u2[:, None], axis=0)
    total = _sum_parts(col_part_ptr, tiles_m, N, offs_n, nmask, 16)
    raw = tl.where(nmask, tl.abs(total - cref), 0.0)
    tl.atomic_add(stats_f64_ptr + _ST_COL_L2SQ, tl.sum(raw * raw, axis=0))
    diff = raw / tl.maximum(U32 * tl.sqrt(csq), TINY)
    nonfinite = (diff != diff) | (diff == float("inf"))
    diff = tl.where(nonfinite, NAN_VALUE, diff)
    diff = tl.where(nmask, diff, 0.0).to(tl.float32)
    value = tl.max(diff, axis=0)
    tl.atomic_max(stats_ptr + _ST_COL, _pack(value, off_n + tl.argmax(diff, axis=0)))
    if value > col_threshold:
        tl.atomic_or(stats_ptr + _ST_ALARM, 2)


# -- host side --------------------------------------------------------------------------------------
import dataclasses  # noqa: E402

import torch  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402


@dataclasses.dataclass(frozen=True)
class TritonGemmConfig:
    """Tile and pipeline of the checked GEMM. The tile is also the unit of capture and replay."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    flatten: bool = False
    side_k: int = 64  # K chunk of the reference-side loops (a divisor of block_k)
    side_k_t: int = 16  # the same where the sums run across a chunk's rows (elementwise accumulators)
    side_stages: int = 1


# Hopper: 128×256×64 tiles, 8 warps, 3 stages run bf16 GEMMs at cuBLAS speed on the H200.
# The interpreter runs one program at a time on the CPU: small tiles keep tests fast.
HOPPER_CONFIG = TritonGemmConfig()
INTERPRETER_CONFIG = TritonGemmConfig(
    block_m=32, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1, side_k=16, side_k_t=8, side_stages=1
)
_config_override: TritonGemmConfig | None = None


def default_config() -> TritonGemmConfig:
    if _config_override is not None:
        return _config_override
    return INTERPRETER_CONFIG if INTERPRET else HOPPER_CONFIG


def set_config(cfg: TritonGemmConfig | None) -> None:
    """Use `cfg` for every launch from now on (benchmarks); None restores the default."""
    global _config_override
    _config_override = cfg


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


@dataclasses.dataclass(eq=False)
class CapturePool:
    """Slots the kernel copies replay contexts into on an alarm; claimed with an atomic counter."""

    data: torch.Tensor  # [slots, data_len] operand dtype
    f32: torch.Tensor  # [slots, f32_len] fp64: partial sums (fp32 values, upcast exactly) and fp64 partials
    counter: torch.Tensor  # int32 [1]: slots claimed this step

    @property
    def slots(self) -> int:
        return self.data.shape[0]

    @staticmethod
    def layout(m: int, n: int, k: int, capture: int, cfg: TritonGemmConfig) -> tuple[int, int]:
        """(data_len, f32_len) one capture of this GEMM needs (see `_capture`)."""
        bm, bn = cfg.block_m, cfg.block_n
        tiles_n = -(-n // bn)
        if capture == CAPTURE_TILE:
            return bm * k + bn * k, 6 * bm + 3 * bn
        return bm * k, 6 * tiles_n * bm

    @classmethod
    def allocate(cls, slots: int, data_len: int, f32_len: int, dtype: torch.dtype, device) -> CapturePool:
        return cls(
            torch.empty(slots, data_len, dtype=dtype, device=device),
            torch.empty(slots, f32_len, dtype=torch.float64, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
        )


_WORKSPACES: dict[tuple, torch.Tensor] = {}


def _workspace(device: torch.device, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A scratch buffer reused by every launch: the partials are written and consumed by the
    launches of one call, in stream order, before any later call's GEMM can overwrite them (the
    checked GEMMs of a process run on one stream at a time, as a training step's do). Nothing reads
    them after the call: captures copy what they keep, and by-products are reduced into new tensors
    right after the launch (`GemmLaunch.byproducts`). One flat buffer per name, grown to the largest
    shape seen: variable sequence lengths do not pile up buffers."""
    numel = math.prod(shape)
    key = (device, name, dtype)
    buffer = _WORKSPACES.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _WORKSPACES[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel].view(shape)


def _fresh(device: torch.device, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


@dataclasses.dataclass
class GemmLaunch:
    """What one launch produced besides C (partials are per tile; see the module docstring)."""

    row_part: torch.Tensor | None  # [tiles_n, M]
    out_part: torch.Tensor | None  # [tiles_n, M]
    col_part: torch.Tensor | None  # [tiles_m, N]
    rowvec: torch.Tensor | None  # [4, tiles_n, M]
    colvec: torch.Tensor | None  # [2, tiles_m, N]

    def byproducts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A·1 in fp64, ‖A_i‖² in fp32) [M]: what a later wgrad check needs from this GEMM's A."""
        assert self.rowvec is not None, "launched without the row side"
        return self.rowvec[2].sum(dim=0), self.rowvec[3].sum(dim=0).float()


def launch_checked_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    *,
    a_t: bool,
    b_t: bool,
    bias: torch.Tensor | None = None,
    cvec: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    u1: torch.Tensor | None = None,
    u2: torch.Tensor | None = None,
    row_check: bool = False,
    row_side: bool = False,
    col_check: bool = False,
    stats: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    pool: CapturePool | None = None,
    capture: int = CAPTURE_NONE,
    row_threshold: float = float("inf"),
    col_threshold: float = float("inf"),
    fault: tuple[int, int, int, float, int] | None = None,  # (model, row, col, delta, xor mask)
    pid_base: tuple[int, int] = (0, 0),
    ranges: tuple[int, int] | None = None,
    evidence: bool = True,
    byproducts: bool = True,
    cfg: TritonGemmConfig | None = None,
    scratch: bool = False,
) -> GemmLaunch:
    """C = A·B into `out` [M, N] (row-major) with the requested checks; see the module docstring.

    `a` is A [M, K] (or Aᵀ [K, M] when a_t); `b` is B [K, N] (or Bᵀ [N, K] when b_t). A column check
    takes its reference side inside the kernel when u1 = 1ᵀA is given (wgrad), else after it from
    A's column sums (`col_side_kernel`). `stats` (int64 [STATS_LEN], zero) and `counters` (int32,
    at least one, zero) are needed for evidence. `pid_base` and `ranges` (the original
    tile counts) let a replay recompute a tile exactly. Nothing here synchronizes with the host.
    `scratch`: the partials live in buffers shared by all launches (`_workspace`), for callers that
    read nothing of the returned `GemmLaunch` but `byproducts()` right away (the training step);
    without it they are fresh tensors the caller may keep.
    """
    cfg = cfg or default_config()
    m, n = out.shape
    k = a.shape[0] if a_t else a.shape[1]
    dev = a.device
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    tiles_m, tiles_n = triton.cdiv(m, bm), triton.cdiv(n, bn)
    range_m, range_n = ranges if ranges is not None else (tiles_m, tiles_n)
    f32 = torch.float32
    col_post = col_check and u1 is None
    col_side = col_check and not col_post
    f64 = torch.float64
    buffer = _workspace if scratch else _fresh
    row_part = buffer(dev, "row_part", (tiles_n, m), f32) if row_check else None
    out_part = buffer(dev, "out_part", (tiles_n, m), f32) if row_check else None
    col_part = buffer(dev, "col_part", (tiles_m, n), f32) if col_check else None
    rowvec = buffer(dev, "rowvec", (4, tiles_n, m), f64) if row_side else None
    colvec = buffer(dev, "colvec", (2, tiles_m, n), f64) if col_side else None
    acol = buffer(dev, "acol", (tiles_m, 2, k), f64) if col_post else None
    evidence = evidence and (row_check or col_side)
    if evidence and (stats is None or counters is None):
        raise ValueError("evidence needs a zeroed stats slot and counters")
    if capture != CAPTURE_NONE and pool is None:
        raise ValueError("a capture needs a CapturePool")
    dummy = _workspace(dev, "dummy", (1,), f32)
    stats_slot = stats if stats is not None else _workspace(dev, "stats", (STATS_LEN,), torch.int64)
    a_desc = TensorDescriptor.from_tensor(a, [bk, bm] if a_t else [bm, bk])
    b_desc = TensorDescriptor.from_tensor(b, [bn, bk] if b_t else [bk, bn])
    c_desc = TensorDescriptor.from_tensor(out, [bm, bn])
    model, frow, fcol, fdelta, fmask = fault if fault is not None else (FAULT_NONE, -1, -1, 0.0, 0)
    grid = (min(num_sms(dev), tiles_m * tiles_n),)
    data_len, f32_len = (pool.data.shape[1], pool.f32.shape[1]) if pool is not None else (0, 0)
    checked_gemm_kernel[grid](
        a_desc, b_desc, c_desc, a, b,
        bias if bias is not None else dummy,
        cvec if cvec is not None else dummy,
        beta if beta is not None else dummy,
        u1 if u1 is not None else dummy,
        u2 if u2 is not None else dummy,
        row_part if row_part is not None else dummy,
        out_part if out_part is not None else dummy,
        col_part if col_part is not None else dummy,
        rowvec if rowvec is not None else dummy,
        colvec if colvec is not None else dummy,
        acol if acol is not None else dummy,
        int(frow), int(fcol), float(fdelta), int(fmask),
        m, n, k, a.stride(0), b.stride(0),
        int(pid_base[0]), int(pid_base[1]), int(range_m), int(range_n),
        A_T=a_t, B_T=b_t, HAS_BIAS=bias is not None,
        ROW_CHECK=row_check, ROW_SIDE=row_side, COL_PARTIALS=col_check, COL_SIDE=col_side,
        A_COLSUMS=col_post and row_side, BYPRODUCTS=byproducts, FAULT=model, UPCAST=INTERPRET,
        BM=bm, BN=bn, BK=bk, GROUP_M=cfg.group_m, FLATTEN=cfg.flatten,
        SIDE_K=cfg.side_k, SIDE_K_T=cfg.side_k_t, SIDE_STAGES=cfg.side_stages, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if evidence:
        blocks = (tiles_m if row_check else 0) + (tiles_n if col_side else 0)
        evidence_kernel[(blocks,)](
            a, b, row_part if row_part is not None else dummy, out_part if out_part is not None else dummy,
            col_part if col_part is not None else dummy, rowvec if rowvec is not None else dummy,
            colvec if colvec is not None else dummy, counters, stats_slot, stats_slot.view(torch.float64),
            pool.data if pool is not None else out,
            pool.f32 if pool is not None else dummy,
            pool.counter if pool is not None else torch.empty(1, dtype=torch.int32, device=dev),
            float(row_threshold), float(col_threshold), m, n, k, a.stride(0), b.stride(0), data_len, f32_len,
            A_T=a_t, B_T=b_t, ROW_CHECK=row_check, COL_SIDE=col_side, CAPTURE=capture,
            POOL=pool.slots if pool is not None else 1, BM=bm, BN=bn, num_warps=4,
        )  # fmt: skip
    if col_post and evidence:
        col_side_kernel[(tiles_n,)](
            b, b.stride(0), acol.sum(dim=0), col_part, stats_slot, stats_slot.view(torch.float64),
            float(col_threshold), tiles_m, n, k,
            B_T=b_t, BN=bn, BK=16 if INTERPRET else 64, num_warps=4 if INTERPRET else 8,
        )  # fmt: skip
    return GemmLaunch(row_part, out_part, col_part, rowvec, colvec)
