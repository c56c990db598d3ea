"""Probe (GPU): a persistent warp-specialized ping-pong bf16 GEMM in Gluon, with and without the row
check's per-tile partials (Σ acc, Σ acc², Σ of the rounded output) stored from the consumers'
registers while the other consumer runs its K loop — whether an epilogue that does checking work
can hide behind the tensor cores on the H200, against cuBLAS in the same run. Two consumer warp
groups take alternate tiles (their K loops in turn, the one's epilogue under the other's loop), one
warp loads by TMA, one warp stores C by TMA. Gluon's own rules (Starred lists, tuples of
descriptors) shape a few lines. Results are checked against fp64 before they are timed.

    python benchmarks/gluon_pingpong_probe.py [--out benchmarks/results/gluon_pingpong_probe.json]

Triton ≥ 3.6 (triton.experimental.gluon); Hopper only; no interpreter.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _tile_coords(t, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    # grouped (L2-friendly) ordering
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = t // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = gl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (t % group_size_m)
    pid_n = (t % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@gluon.jit
def _tile_grid(M, N, BM: gl.constexpr, BN: gl.constexpr):
    """(program, programs, row tiles, column tiles, tiles) of the persistent launch."""
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    return gl.program_id(0), gl.num_programs(0), num_pid_m, num_pid_n, num_pid_m * num_pid_n


@gluon.jit
def producer_partition(descs, bufs, bars, MNK, GROUP_M: gl.constexpr, SIDE: gl.constexpr):
    """One warp: the A and B tiles of this program's tiles (and S's [BK, 16] rows, for the side), K
    step by K step, into the stage ring."""
    a_desc, b_desc, _, s_desc = descs
    a_bufs, b_bufs, _, s_bufs = bufs
    ready_bars, empty_bars, _, _, _ = bars
    M, N, K = MNK
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.shape[0]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes + SIDE * s_desc.block_type.nbytes

    pid, nprog, num_pid_m, num_pid_n, num_tiles = _tile_grid(M, N, BM, BN)
    k_iters = gl.cdiv(K, BK)
    it = 0
    for t in range(pid, num_tiles, nprog):
        pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        for kk in range(k_iters):
            s = it % STAGES
            ph = (it // STAGES) & 1
            # empty barriers start "phase 1 complete" -> first wait with ph^1 passes
            mbarrier.wait(empty_bars.index(s), ph ^ 1)
            bar = ready_bars.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, kk * BK], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [kk * BK, off_n], bar, b_bufs.index(s))
            if SIDE:
                tma.async_copy_global_to_shared(s_desc, [kk * BK, 0], bar, s_bufs.index(s))
            it += 1


@gluon.jit
def _k_steps(k_lo, k_hi, it, acc, side, a_bufs, b_bufs, s_bufs, ready_bars, empty_bars, WITH_SIDE: gl.constexpr):
    """K steps [k_lo, k_hi) of a tile from the stage ring: one MMA each into acc [BM, BN] and, WITH_SIDE,
    a narrow one into side [BM, 16] (A·S: the reference side of the tile's K slice). One step's MMAs
    stay in flight; the stage before is released once they are done. No drain between calls: the ring
    and the MMAs run on across them, only the number in flight changes."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    for kk in range(k_lo, k_hi):
        s = it % STAGES
        mbarrier.wait(ready_bars.index(s), (it // STAGES) & 1)
        a_s = a_bufs.index(s)
        b_s = b_bufs.index(s)
        acc = warpgroup_mma(a_s, b_s, acc, use_acc=kk > 0, is_async=True)
        if WITH_SIDE:
            s_s = s_bufs.index(s)
            side = warpgroup_mma(a_s, s_s, side, use_acc=kk > k_lo, is_async=True)
            acc, side, a_s, b_s, s_s = warpgroup_mma_wait(num_outstanding=2, deps=(acc, side, a_s, b_s, s_s))
        else:
            acc, a_s, b_s = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_s, b_s))
        mbarrier.arrive(empty_bars.index((it + STAGES - 1) % STAGES), pred=kk > 0)
        it += 1
    return acc, side, it


@gluon.jit
def _tile_side(side, k_lo, k_hi, acc, it, a_bufs, b_bufs, s_bufs, ready_bars, empty_bars, k_iters):
    """A tile's K loop with the side's narrow MMA on the steps of its K slice [k_lo, k_hi)."""
    acc, side, it = _k_steps(0, k_lo, it, acc, side, a_bufs, b_bufs, s_bufs, ready_bars, empty_bars, False)
    acc, side, it = _k_steps(k_lo, k_hi, it, acc, side, a_bufs, b_bufs, s_bufs, ready_bars, empty_bars, True)
    acc, side, it = _k_steps(k_hi, k_iters, it, acc, side, a_bufs, b_bufs, s_bufs, ready_bars, empty_bars, False)
    acc, side = warpgroup_mma_wait(num_outstanding=0, deps=(acc, side))
    return acc, side, it


@gluon.jit
def _store_side(side, ref_ptr, off_m, pid_n, num_pid_n, M, BM: gl.constexpr):
    """The side's K slice of one tile into ref [2, tiles_n, M] fp64: A·c (S's three parts summed in
    fp64) and A·1 (its ones column)."""
    side_layout: gl.constexpr = side.type.layout
    col = gl.arange(0, 16, layout=gl.SliceLayout(0, side_layout))[None, :]
    wide = side.to(gl.float64)
    offs = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, side_layout))
    mask = offs < M
    gl.store(ref_ptr + pid_n * M + offs, gl.sum(gl.where(col < 3, wide, 0.0), axis=1), mask=mask)
    gl.store(ref_ptr + (num_pid_n + pid_n) * M + offs, gl.sum(gl.where(col == 3, wide, 0.0), axis=1), mask=mask)


@gluon.jit
def _hand_over(empty_bars, order_bars, it, STAGES: gl.constexpr, CID: gl.constexpr):
    """After a tile's last MMAs: its last stage back to the producer, the tensor cores to the other
    consumer."""
    mbarrier.arrive(empty_bars.index((it + STAGES - 1) % STAGES))
    mbarrier.arrive(order_bars.index(1 - CID))


@gluon.jit
def _consume_tile(descs, bufs, bars, MNK, part_ptr, ref_ptr, t, j, n_local, CID: gl.constexpr,
                  GROUP_M: gl.constexpr, PARTIALS: gl.constexpr, SIDE: gl.constexpr):  # fmt: skip
    """One tile of consumer CID (its j-th of the program's tiles, its n_local-th own): the K loop in
    its turn, then the epilogue."""
    a_desc, b_desc, c_desc, _ = descs
    a_bufs, b_bufs, c_bufs, s_bufs = bufs
    ready_bars, empty_bars, order_bars, c_ready_bars, c_empty_bars = bars
    M, N, K = MNK
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.shape[0]
    NW: gl.constexpr = gl.num_warps()  # warps of *this* partition (4)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BN, 16]
    )
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_iters = gl.cdiv(K, BK)
    pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
    off_m = pid_m * BM
    # ping-pong ordering: wait for our turn to issue MMAs
    mbarrier.wait(order_bars.index(CID), (n_local & 1) ^ (1 - CID))
    it = j * k_iters
    acc = gl.zeros([BM, BN], gl.float32, layout=acc_layout)
    side_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, 16, 16]
    )
    side = gl.zeros([BM, 16], gl.float32, layout=side_layout)
    # the tile's K slice of the side; without SIDE an empty one and a store with every lane masked off
    # (the same code: Triton 3.6 fails to lower this kernel with the side's accumulator left out or
    # left unused)
    k_lo = k_iters
    k_hi = k_iters
    if SIDE:
        k_lo = pid_n * k_iters // num_pid_n
        k_hi = (pid_n + 1) * k_iters // num_pid_n
    acc, side, it = _tile_side(side, k_lo, k_hi, acc, it, a_bufs, b_bufs, s_bufs, ready_bars, empty_bars, k_iters)
    _hand_over(empty_bars, order_bars, it, STAGES, CID)
    _store_side(side, ref_ptr, off_m, pid_n, num_pid_n, M * SIDE, BM)  # (M · 0: every lane masked off)

    # epilogue (in consumer registers, under the other consumer's K loop): the row check's per-tile
    # partials [3, tiles_n, M] — Σ acc, Σ acc², Σ of the rounded output
    # (without PARTIALS: formed, every lane's store masked off — Triton 3.6 fails to lower the kernel
    # with no use of the accumulator but its C store)
    offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
    mask_m = offs_m < M * PARTIALS
    base = part_ptr + pid_n * M + offs_m
    gl.store(base, gl.sum(acc, axis=1), mask=mask_m)
    gl.store(base + num_pid_n * M, gl.sum(acc * acc, axis=1), mask=mask_m)
    gl.store(base + 2 * num_pid_n * M, gl.sum(acc.to(c_desc.dtype).to(gl.float32), axis=1), mask=mask_m)
    # bf16 C tile -> smem, the epilogue warp TMA-stores it
    mbarrier.wait(c_empty_bars.index(CID), (n_local & 1) ^ 1)
    c_bufs.index(CID).store(acc.to(c_desc.dtype))
    fence_async_shared()
    mbarrier.arrive(c_ready_bars.index(CID))


@gluon.jit
def consumer_partition(descs, bufs, bars, MNK, part_ptr, ref_ptr, CID: gl.constexpr, GROUP_M: gl.constexpr,
                       PARTIALS: gl.constexpr, SIDE: gl.constexpr):  # fmt: skip
    """One warp group (CID 0 or 1): this program's tiles CID, CID + 2, … — its K loop when the other
    group hands it the tensor cores (with the side's narrow MMA on the steps of the tile's K slice:
    slice pid_n of tiles_n, as the Triton kernel spreads it), then its epilogue (partials, the side's
    slice, C into shared memory) while the other group runs its K loop."""
    M, N, _ = MNK
    BM: gl.constexpr = descs[0].block_type.shape[0]
    BN: gl.constexpr = descs[1].block_type.shape[1]
    pid, nprog, _, _, num_tiles = _tile_grid(M, N, BM, BN)
    j = CID  # the program's local tile index: CID, CID + 2, …
    n_local = 0
    for t in range(pid + CID * nprog, num_tiles, 2 * nprog):
        _consume_tile(descs, bufs, bars, MNK, part_ptr, ref_ptr, t, j, n_local, CID, GROUP_M, PARTIALS, SIDE)
        j += 2
        n_local += 1  # noqa: SIM113  (a kernel loop: no enumerate)


@gluon.jit
def epilogue_partition(descs, bufs, bars, MNK, GROUP_M: gl.constexpr):
    """One warp: each C tile the consumers leave in shared memory, stored by TMA in tile order."""
    c_desc = descs[2]
    c_bufs = bufs[2]
    c_ready_bars = bars[3]
    c_empty_bars = bars[4]
    M, N, _ = MNK
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    pid, nprog, num_pid_m, num_pid_n, num_tiles = _tile_grid(M, N, BM, BN)
    j = 0
    for t in range(pid, num_tiles, nprog):
        pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
        cid = j % 2
        mbarrier.wait(c_ready_bars.index(cid), (j // 2) & 1)
        tma.async_copy_shared_to_global(c_desc, [pid_m * BM, pid_n * BN], c_bufs.index(cid))
        tma.store_wait(0)
        mbarrier.arrive(c_empty_bars.index(cid))
        j += 1  # noqa: SIM113  (a kernel loop: no enumerate)


@gluon.jit
def consumer0_default(descs, bufs, bars, MNK, part_ptr, ref_ptr, GROUP_M: gl.constexpr, PARTIALS: gl.constexpr,
                      SIDE: gl.constexpr):  # fmt: skip
    consumer_partition(descs, bufs, bars, MNK, part_ptr, ref_ptr, 0, GROUP_M, PARTIALS, SIDE)


@gluon.jit
def consumer1_worker(descs, bufs, bars, MNK, part_ptr, ref_ptr, GROUP_M: gl.constexpr, PARTIALS: gl.constexpr,
                     SIDE: gl.constexpr):  # fmt: skip
    consumer_partition(descs, bufs, bars, MNK, part_ptr, ref_ptr, 1, GROUP_M, PARTIALS, SIDE)


@gluon.jit
def pingpong_buffers(a_desc, b_desc, c_desc, STAGES: gl.constexpr, EMPTY_ARRIVALS: gl.constexpr):
    """Shared memory of the ping-pong GEMM: the A and B stage rings, two C tiles, and its barriers
    (ready, empty — each stage freed by EMPTY_ARRIVALS arrivals —, order, C ready, C empty)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)  # noqa: RUF005
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)  # noqa: RUF005
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)  # noqa: RUF005
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    order_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    c_ready_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    c_empty_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=EMPTY_ARRIVALS)
    for i in gl.static_range(2):
        mbarrier.init(order_bars.index(i), count=1)
        mbarrier.init(c_ready_bars.index(i), count=1)
        mbarrier.init(c_empty_bars.index(i), count=1)
    return a_bufs, b_bufs, c_bufs, (ready_bars, empty_bars, order_bars, c_ready_bars, c_empty_bars)


@gluon.jit
def ws_pingpong_gemm_kernel(
    a_desc,
    b_desc,
    c_desc,
    s_desc,  # S [K, 16] bf16: c = B·1 in three bf16 parts and a ones column (read with SIDE)
    part_ptr,  # fp32 [3, tiles_n, M] out (PARTIALS)
    ref_ptr,  # fp64 [2, tiles_n, M] out (SIDE): A·c and A·1 per K slice
    M,
    N,
    K,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PARTIALS: gl.constexpr,
    SIDE: gl.constexpr,
    num_warps: gl.constexpr,
):
    a_bufs, b_bufs, c_bufs, bars = pingpong_buffers(a_desc, b_desc, c_desc, STAGES, 1)
    s_bufs = gl.allocate_shared_memory(s_desc.dtype, [STAGES] + s_desc.block_type.shape, s_desc.layout)  # noqa: RUF005
    descs = (a_desc, b_desc, c_desc, s_desc)
    bufs = (a_bufs, b_bufs, c_bufs, s_bufs)
    MNK = (M, N, K)
    consumer_args = (descs, bufs, bars, MNK, part_ptr, ref_ptr, GROUP_M, PARTIALS, SIDE)
    gl.warp_specialize(
        [
            (consumer0_default, consumer_args),  # the default partition: num_warps warps
            (consumer1_worker, consumer_args),
            (producer_partition, (descs, bufs, bars, MNK, GROUP_M, SIDE)),
            (epilogue_partition, (descs, bufs, bars, MNK, GROUP_M)),
        ],
        [4, 1, 1],
        [CONSUMER_REGS, 24, 24],
    )


GROUP_M = 8


@dataclasses.dataclass(frozen=True)
class Tile:
    """A consumer warp group's tile and the depth of the load ring. Shared memory: STAGES·(BM·BK + BK·BN)
    + 2·BM·BN bf16 (two C buffers) must fit the H200's 227 KB."""

    bm: int
    bn: int
    bk: int = 64
    stages: int = 4


# 128×128 is CUTLASS's ping-pong tile on Hopper; 64×256 is the same accumulator (128 fp32 registers
# per thread) in one m64n256 wgmma per K step
TILES = [Tile(128, 128, 64, 4), Tile(128, 128, 64, 3), Tile(64, 256, 64, 3)]  # 64×256×4: 237 KB with S


def launch(a, b, c, s_matrix, parts, refs, tile: Tile, partials: bool, side: bool, consumer_regs: int = 232) -> None:
    """a [M, K], b [K, N] bf16 row-major → c [M, N] bf16; with `partials`, parts [3, tiles_n, M] fp32;
    with `side`, refs [2, tiles_n, M] fp64 from s_matrix [K, 16] bf16 (`side_matrix`)."""
    m, k = a.shape
    n = b.shape[1]
    shapes = ([tile.bm, tile.bk], [tile.bk, tile.bn], [tile.bm, tile.bn], [tile.bk, 16])
    descs = [TensorDescriptor.from_tensor(t, shape, gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16))
             for t, shape in zip((a, b, c, s_matrix), shapes, strict=True)]  # fmt: skip
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    grid = (min(sms, triton.cdiv(m, tile.bm) * triton.cdiv(n, tile.bn)),)
    ws_pingpong_gemm_kernel[grid](*descs, parts, refs, m, n, k, tile.stages, GROUP_M, consumer_regs, partials, side,
                                  num_warps=4)  # fmt: skip


def side_matrix(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S [K, 16] bf16, c = B·1 [K] fp64): c in three bf16 parts (hi, lo, lo2: fp32-level precision) and
    a ones column, as the Triton kernel's reference side (kernels/gemm_side.py; bf16 needs no scaling)."""
    c_vec = b.double().sum(1)
    s_matrix = torch.zeros(b.shape[0], 16, dtype=torch.bfloat16, device=b.device)
    rest = c_vec
    for j in range(3):
        s_matrix[:, j] = rest.to(torch.bfloat16)
        rest = rest - s_matrix[:, j].double()
    s_matrix[:, 3] = 1.0
    return s_matrix, c_vec


SHAPES = [("gate_up", 8192, 2048, 5632), ("q_o", 8192, 2048, 2048), ("8b.o", 8192, 4096, 4096),
          ("down", 8192, 5632, 2048), ("kv", 8192, 2048, 256)]  # fmt: skip
# (partials, side): "pingpong" forms the partials and stores none (see `_consume_tile`), so it bounds
# the GEMM from above rather than timing it bare (results/gluon_pingpong_probe_partials.json, of the
# kernel before the side, has it bare)
MODES = {"pingpong": (False, False), "partials": (True, False), "partials_side": (True, True)}


def measure(name: str, m: int, k: int, n: int, tile: Tile) -> dict:
    """One shape and tile: the output, the partials and the side checked against fp64, then each mode
    timed beside cuBLAS."""
    from common import device_ms

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    s_matrix, c_vec = side_matrix(b)
    tiles_n = triton.cdiv(n, tile.bn)
    parts = torch.zeros(3, tiles_n, m, device="cuda", dtype=torch.float32)
    refs = torch.zeros(2, tiles_n, m, device="cuda", dtype=torch.float64)
    launch(a, b, c, s_matrix, parts, refs, tile, partials=True, side=True)
    torch.cuda.synchronize()
    ref = a.double() @ b.double()
    # C: the bf16 rounding of an fp32 sum (|error| ≤ half a bf16 ulp plus fp32 accumulation error):
    # within 2⁻⁸ of the row's largest |C| (a wrong tile or layout is off by O(1))
    scale = ref.abs().amax(dim=1, keepdim=True)
    row = {"layer": name, "M": m, "K": k, "N": n, "tile": dataclasses.asdict(tile)}
    row["c_rel_err"] = ((c.double() - ref).abs() / scale).max().item()
    # per-tile row sums of the fp32 accumulator against the exact ones: fp32 accumulation error
    # (~√K·2⁻²⁴ of Σ|C| over the tile's row) — a wrong tile, row or layout is off by O(1)
    tiles = ref.view(m, tiles_n, tile.bn).permute(1, 0, 2)  # [tiles_n, M, BN] (N a multiple of BN here)
    row["part_sum_rel_err"] = ((parts[0].double() - tiles.sum(2)).abs() / tiles.abs().sum(2)).max().item()
    row["part_sq_rel_err"] = ((parts[1].double() - (tiles**2).sum(2)).abs() / (tiles**2).sum(2)).max().item()
    out_tiles = c.double().view(m, tiles_n, tile.bn).permute(1, 0, 2)
    row["part_out_rel_err"] = ((parts[2].double() - out_tiles.sum(2)).abs() / out_tiles.abs().sum(2)).max().item()
    # the side over all slices: A·c and A·1 against fp64, relative to Σ|a|·|c| (fp32 accumulation)
    exact = a.double() @ c_vec
    row["side_rel_err"] = ((refs[0].sum(0) - exact).abs() / (a.double().abs() @ c_vec.abs())).max().item()
    row["ones_rel_err"] = ((refs[1].sum(0) - a.double().sum(1)).abs() / a.double().abs().sum(1)).max().item()
    # the row check itself: |Σ_j C_ij − (A·c)_i| / (2⁻²⁴·‖C_i‖), what the kernel's evidence compares
    diff = (parts[0].double().sum(0) - refs[0].sum(0)).abs() / (2.0**-24 * parts[1].double().sum(0).sqrt())
    row["row_check_max_normalized"] = diff.max().item()
    row["cublas_ms"] = device_ms(functools.partial(torch.matmul, a, b, out=c))
    for mode, (partials, side) in MODES.items():
        fn = functools.partial(launch, a, b, c, s_matrix, parts, refs, tile, partials=partials, side=side)
        row[f"{mode}_ms"] = device_ms(fn)
        row[f"{mode}_ratio"] = row["cublas_ms"] / row[f"{mode}_ms"]
    return row


def main() -> None:
    from common import gpu_environment, write_result

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gluon_pingpong_probe.json")
    args = parser.parse_args()
    rows, summary = [], {}
    for tile in TILES:
        label = f"{tile.bm}x{tile.bn}x{tile.bk}s{tile.stages}"
        for name, m, k, n in SHAPES:
            try:
                row = measure(name, m, k, n, tile)
            except Exception as error:  # a tile this Triton cannot compile or fit: recorded, not fatal
                row = {"layer": name, "tile": dataclasses.asdict(tile), "error": str(error).splitlines()[0][:200]}
            print(label, row, flush=True)
            rows.append(row)
        for mode in MODES:
            ratios = sorted(
                r[f"{mode}_ratio"] for r in rows if r["tile"] == dataclasses.asdict(tile) and "error" not in r
            )
            if ratios:
                summary[f"{label}_{mode}_median_ratio"] = ratios[len(ratios) // 2]
                summary[f"{label}_{mode}_min_ratio"] = ratios[0]
    write_result(args.out, gpu_environment(), rows, summary)


if __name__ == "__main__":
    main()
