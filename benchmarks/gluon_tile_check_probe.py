"""Probe (GPU): a tile that checks itself on the CUDA cores while its own MMA runs — whether a
complete row check can cost what its epilogue costs on the H200, against cuBLAS in the same run.

The ping-pong GEMM of `gluon_pingpong_probe.py` (two consumer warp groups on alternate tiles, one
TMA load warp, one TMA store warp), with the row check of each output tile kept inside the tile:

    Σ_n C[i, n]  =  Σ_k A[i, k] · c_j[k]        (n over tile column block j; c_j = B[:, block j]·1)

The left side is the row sums of the fp32 accumulator after the K loop. The right side is formed on
the CUDA cores from the A stage the MMA is reading (fp32 FMAs, each thread summing its own 8 products
per step; across threads once per tile), either by the consumer between issuing its asynchronous
wgmma and waiting for it (`inline`), or by four checker warps that read every stage beside the
consumers (`checker`) — so the arithmetic runs under the tensor cores' time. c_j [tiles_n, K] fp32 (a
weight's per-block sums: one pass over the weight per step) comes with each stage by TMA. The
comparison `|Σ_n C − A·c_j| / ‖C[i, block j]‖` runs in the epilogue, under the other consumer's K
loop, and the launch keeps its largest value (one fp32 atomic max per program). No side MMA, no
slices across tiles, nothing to finish after the tile loop.

Checked against fp64 before timing (C, the accumulator's row sums, the CUDA-core side); a fault
added to one accumulator element of one tile is found (the largest normalized difference against the
clean run's). Modes timed beside cuBLAS: `pingpong` (the bare GEMM; its row sums formed and stored
with every lane masked off, as Triton 3.6 needs a use of the accumulator), `compare` (the epilogue's sums
and comparison with a zero side: what the check costs without the K-loop work), `inline` (the side
formed by the consumers in their K loop), `checker` (by four warps of their own, reading the same
stages: the consumers only issue MMAs).

    python benchmarks/gluon_tile_check_probe.py [--tokens 2048,8192,16384] [--stages 4] [--out FILE]
    python benchmarks/gluon_tile_check_probe.py --compile-only    # registers and spills, sm_90a, no GPU

Triton 3.6's Gluon (`triton.experimental.gluon`); Hopper only; no interpreter.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
from pathlib import Path

import torch
import triton
from gluon_pingpong_probe import (
    GROUP_M,
    SHAPES,
    Tile,
    _tile_coords,
    _tile_grid,
    epilogue_partition,
    pingpong_buffers,
)
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
def load_partition(descs, bufs, bars, MNK, GROUP_M: gl.constexpr, SIDE: gl.constexpr):
    """One warp: the A and B tiles of this program's tiles, K step by K step, into the stage ring, and
    with SIDE the tile's c_j for the step ([1, BK] of c_blk, fp32) beside them."""
    a_desc, b_desc, _, cb_desc = descs
    a_bufs, b_bufs, _, cb_bufs = bufs
    ready_bars, empty_bars = bars[0], bars[1]
    M, N, K = MNK
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.shape[0]
    SIDE_BYTES: gl.constexpr = cb_desc.block_type.nbytes if SIDE else 0
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes + SIDE_BYTES
    pid, nprog, num_pid_m, num_pid_n, num_tiles = _tile_grid(M, N, BM, BN)
    it = 0
    for t in range(pid, num_tiles, nprog):
        pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
        for kk in range(gl.cdiv(K, BK)):
            s = it % STAGES
            mbarrier.wait(empty_bars.index(s), ((it // STAGES) & 1) ^ 1)  # the first pass finds them free
            bar = ready_bars.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(a_desc, [pid_m * BM, kk * BK], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [kk * BK, pid_n * BN], bar, b_bufs.index(s))
            if SIDE:
                tma.async_copy_global_to_shared(cb_desc, [pid_n, kk * BK], bar, cb_bufs.index(s))
            it += 1


@gluon.jit
def _side_step(side, a_s, cb_s):
    """side [BM, BK // 8] += one K step of A·c_j: the A stage a_s [BM, BK] and c_j's chunk cb_s [1, BK]
    from shared memory, each thread 16 bytes of a row (8 threads a 128-byte row, 4 rows a warp), its
    8 products summed in its registers (the sum across the row's threads waits for the tile's end)."""
    BM: gl.constexpr = a_s.shape[0]
    BK: gl.constexpr = a_s.shape[1]
    a_regs: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    products = a_s.load(a_regs).to(gl.float32) * cb_s.load(a_regs)  # [BM, BK]·[1, BK]
    own = gl.sum(gl.reshape(products, [BM, BK // 8, 8]), axis=2)
    return side + gl.convert_layout(own, side.type.layout, assert_trivial=True)


@gluon.jit
def _k_loop(acc, side, K, it, a_bufs, b_bufs, cb_bufs, ready_bars, empty_bars, SIDE: gl.constexpr):
    """A tile's K loop: one asynchronous MMA per step into acc [BM, BN]; with SIDE, while it runs, the
    step's side (`_side_step`) on the CUDA cores. One MMA stays in flight; the stage before is
    released once it is done (the CUDA cores have read this stage by then)."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BK: gl.constexpr = a_bufs.shape[2]
    for kk in range(gl.cdiv(K, BK)):
        s = it % STAGES
        mbarrier.wait(ready_bars.index(s), (it // STAGES) & 1)
        a_s = a_bufs.index(s)
        b_s = b_bufs.index(s)
        acc = warpgroup_mma(a_s, b_s, acc, use_acc=kk > 0, is_async=True)
        if SIDE:
            side = _side_step(side, a_s, cb_bufs.index(s))
        acc, a_s, b_s = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_s, b_s))
        mbarrier.arrive(empty_bars.index((it + STAGES - 1) % STAGES), pred=kk > 0)
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return acc, side, it


@gluon.jit
def _check_tile(acc, ref, t, off_m, pid_n, ev_ptr, M, m_ev, num_pid_n, worst, COMPARE: gl.constexpr,
                FAULT: gl.constexpr):  # fmt: skip
    """The tile's row check: |Σ_n acc − ref| / ‖acc row‖ (ref [BM]: A·c_j), folded into `worst` [BM] (each
    row's largest).
    FAULT adds 1.0 to acc[0, 0] of tile 0 first (after the MMAs, as a corrupted accumulator). The two
    sides go to ev [2, tiles_n, M] for the fp64 comparison on rows below m_ev (0: every lane masked
    off — the store stays in the code because Triton 3.6 fails to lower this kernel when the
    accumulator's one other use is the comparison, or when it has none but the C tile)."""
    acc_layout: gl.constexpr = acc.type.layout
    rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    if FAULT:
        r = gl.arange(0, acc.shape[0], layout=rows_layout)[:, None]
        col = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, acc_layout))[None, :]
        acc = acc + gl.where((r == 0) & (col == 0) & (t == 0), 1.0, 0.0)
    row_sum = gl.sum(acc, axis=1)
    if COMPARE:
        row_sq = gl.sum(acc * acc, axis=1)
        diff = gl.abs(row_sum - ref) / gl.sqrt(gl.maximum(row_sq, 1e-30))
        worst = gl.maximum(worst, diff)  # per row: a reduction across warps fails to lower in a partition
    offs = off_m + gl.arange(0, acc.shape[0], layout=rows_layout)
    gl.store(ev_ptr + pid_n * M + offs, row_sum, mask=offs < m_ev)
    gl.store(ev_ptr + (num_pid_n + pid_n) * M + offs, ref, mask=offs < m_ev)
    return acc, worst


@gluon.jit
def consumer_partition(descs, bufs, bars, MNK, ev_ptr, m_ev, slot_ptr, CID: gl.constexpr,
                       GROUP_M: gl.constexpr, INLINE: gl.constexpr, CHECKER: gl.constexpr, COMPARE: gl.constexpr,
                       FAULT: gl.constexpr):  # fmt: skip
    """One warp group (CID 0 or 1): this program's tiles CID, CID + 2, …, each's K loop in its turn
    (with the side under the MMAs), then under the other group's K loop the tile's check and its C
    into shared memory; at the end, the program's largest normalized difference into the slot."""
    a_desc, b_desc, c_desc = descs[0], descs[1], descs[2]
    a_bufs, b_bufs, c_bufs, side_bufs = bufs[0], bufs[1], bufs[2], bufs[4]
    ready_bars, empty_bars, order_bars, c_ready_bars, c_empty_bars, side_ready_bars, side_empty_bars = bars
    M, N, K = MNK
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.shape[0]
    NW: gl.constexpr = gl.num_warps()
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                         instr_shape=[16, BN, 16])  # fmt: skip
    # the side's per-thread sums [BM, BK // 8]: the A tile in registers as 16 bytes of a row a thread,
    # 8 threads a 128-byte row, 4 rows a warp, each thread's 8 elements summed
    side_layout: gl.constexpr = gl.SliceLayout(2, gl.BlockedLayout([1, 1, 8], [4, 8, 1], [NW, 1, 1], [2, 1, 0]))
    pid, nprog, num_pid_m, num_pid_n, num_tiles = _tile_grid(M, N, BM, BN)
    k_iters = gl.cdiv(K, BK)
    worst = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, acc_layout))
    j = CID
    n_local = 0
    for t in range(pid + CID * nprog, num_tiles, 2 * nprog):
        pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        mbarrier.wait(order_bars.index(CID), (n_local & 1) ^ (1 - CID))  # our turn on the tensor cores
        acc = gl.zeros([BM, BN], gl.float32, layout=acc_layout)
        side = gl.zeros([BM, BK // 8], gl.float32, layout=side_layout)
        acc, side, it = _k_loop(acc, side, K, j * k_iters, a_bufs, b_bufs, bufs[3], ready_bars, empty_bars,
                                INLINE)  # fmt: skip
        mbarrier.arrive(empty_bars.index((it + STAGES - 1) % STAGES))
        mbarrier.arrive(order_bars.index(1 - CID))  # the tensor cores to the other group
        ref = gl.convert_layout(gl.sum(side, axis=1), gl.SliceLayout(1, acc_layout))  # the row's 8 threads' sums
        if CHECKER:  # the checker warps' side of this tile
            mbarrier.wait(side_ready_bars.index(CID), n_local & 1)
            ref = side_bufs.index(CID).load(gl.SliceLayout(1, acc_layout))
            mbarrier.arrive(side_empty_bars.index(CID))
        acc, worst = _check_tile(acc, ref, t, off_m, pid_n, ev_ptr, M, m_ev, num_pid_n, worst, COMPARE, FAULT)
        mbarrier.wait(c_empty_bars.index(CID), (n_local & 1) ^ 1)
        c_bufs.index(CID).store(acc.to(c_desc.dtype))
        fence_async_shared()
        mbarrier.arrive(c_ready_bars.index(CID))
        j += 2
        n_local += 1  # noqa: SIM113  (a kernel loop: no enumerate)
    # (always: Triton 3.6 fails to lower the bare mode without it; 128 atomics at the program's end)
    gl.atomic_max(slot_ptr + gl.zeros([BM], gl.int32, layout=gl.SliceLayout(1, acc_layout)), worst)


@gluon.jit
def consumer0_default(descs, bufs, bars, MNK, ev_ptr, m_ev, slot_ptr, GROUP_M: gl.constexpr,
                      INLINE: gl.constexpr, CHECKER: gl.constexpr, COMPARE: gl.constexpr,
                      FAULT: gl.constexpr):  # fmt: skip
    consumer_partition(descs, bufs, bars, MNK, ev_ptr, m_ev, slot_ptr, 0, GROUP_M, INLINE, CHECKER, COMPARE, FAULT)


@gluon.jit
def consumer1_worker(descs, bufs, bars, MNK, ev_ptr, m_ev, slot_ptr, GROUP_M: gl.constexpr,
                     INLINE: gl.constexpr, CHECKER: gl.constexpr, COMPARE: gl.constexpr,
                     FAULT: gl.constexpr):  # fmt: skip
    consumer_partition(descs, bufs, bars, MNK, ev_ptr, m_ev, slot_ptr, 1, GROUP_M, INLINE, CHECKER, COMPARE, FAULT)


@gluon.jit
def checker_partition(descs, bufs, bars, MNK, GROUP_M: gl.constexpr):
    """Warps of their own (CHECKER): every tile of the program in the load order, each K step's side
    (`_side_step`) from the stage; the stage released (the ring's empty barriers count this partition and the consumer);
    at the tile's end the side's rows [BM] into the consumer's side buffer (tile j: buffer j % 2)."""
    a_desc, b_desc = descs[0], descs[1]
    a_bufs, cb_bufs, side_bufs = bufs[0], bufs[3], bufs[4]
    ready_bars, empty_bars, side_ready_bars, side_empty_bars = bars[0], bars[1], bars[5], bars[6]
    M, N, K = MNK
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.shape[0]
    NW: gl.constexpr = gl.num_warps()
    side_layout: gl.constexpr = gl.SliceLayout(2, gl.BlockedLayout([1, 1, 8], [4, 8, 1], [NW, 1, 1], [2, 1, 0]))
    pid, nprog, _, _, num_tiles = _tile_grid(M, N, BM, BN)
    it = 0
    j = 0
    for _t in range(pid, num_tiles, nprog):
        side = gl.zeros([BM, BK // 8], gl.float32, layout=side_layout)
        for _kk in range(gl.cdiv(K, BK)):
            s = it % STAGES
            mbarrier.wait(ready_bars.index(s), (it // STAGES) & 1)
            side = _side_step(side, a_bufs.index(s), cb_bufs.index(s))
            mbarrier.arrive(empty_bars.index(s))
            it += 1
        cid = j % 2
        mbarrier.wait(side_empty_bars.index(cid), ((j // 2) & 1) ^ 1)  # the first pass finds them free
        side_bufs.index(cid).store(gl.sum(side, axis=1))
        mbarrier.arrive(side_ready_bars.index(cid))
        j += 1  # noqa: SIM113  (a kernel loop: no enumerate)


@gluon.jit
def tile_check_gemm_kernel(
    a_desc,
    b_desc,
    c_desc,
    cb_desc,  # c_blk fp32 [tiles_n, K], c_j = B[:, block j]·1, in [1, BK] boxes
    ev_ptr,  # fp32 [2, tiles_n, M] out: the accumulator's row sums, the side, for rows below m_ev
    m_ev,  # M, or 0 to store no evidence
    slot_ptr,  # fp32 [1] in/out (COMPARE): the launch's largest normalized difference
    M,
    N,
    K,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    CHECKER_REGS: gl.constexpr,
    INLINE: gl.constexpr,  # the side by the consumers, on the CUDA cores in their K loop
    CHECKER: gl.constexpr,  # the side by warps of their own
    LOAD_SIDE: gl.constexpr,  # INLINE or CHECKER: c_j's chunks loaded with the stages
    COMPARE: gl.constexpr,
    FAULT: gl.constexpr,
    num_warps: gl.constexpr,
):
    a_bufs, b_bufs, c_bufs, ring_bars = pingpong_buffers(a_desc, b_desc, c_desc, STAGES, 2 if CHECKER else 1)
    cb_bufs = gl.allocate_shared_memory(cb_desc.dtype, [STAGES] + cb_desc.block_type.shape, cb_desc.layout)  # noqa: RUF005
    # the checker warps' side of a tile [BM] for the consumer (two: one a consumer), and their barriers
    BM: gl.constexpr = a_desc.block_type.shape[0]
    side_bufs = gl.allocate_shared_memory(gl.float32, [2, BM], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    side_ready_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    side_empty_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(side_ready_bars.index(i), count=1)
        mbarrier.init(side_empty_bars.index(i), count=1)

    descs = (a_desc, b_desc, c_desc, cb_desc)
    bufs = (a_bufs, b_bufs, c_bufs, cb_bufs, side_bufs)
    bars = (ring_bars[0], ring_bars[1], ring_bars[2], ring_bars[3], ring_bars[4], side_ready_bars, side_empty_bars)
    MNK = (M, N, K)
    # (the partitions take the kernel's constexpr parameters as they are: one computed here, or a tuple
    # of them held in a name, reached them as tensors)
    consumer_args = (descs, bufs, bars, MNK, ev_ptr, m_ev, slot_ptr, GROUP_M, INLINE, CHECKER, COMPARE, FAULT)
    store_args = (descs, bufs, bars, MNK, GROUP_M)
    if CHECKER:
        gl.warp_specialize(
            [
                (consumer0_default, consumer_args),  # the default partition: num_warps warps
                (consumer1_worker, consumer_args),
                (load_partition, (descs, bufs, bars, MNK, GROUP_M, LOAD_SIDE)),
                (epilogue_partition, store_args),
                (checker_partition, store_args),
            ],
            [4, 1, 1, 4],
            [CONSUMER_REGS, 24, 24, CHECKER_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (consumer0_default, consumer_args),
                (consumer1_worker, consumer_args),
                (load_partition, (descs, bufs, bars, MNK, GROUP_M, LOAD_SIDE)),
                (epilogue_partition, store_args),
            ],
            [4, 1, 1],
            [CONSUMER_REGS, 24, 24],
        )


# (side, compare): the bare GEMM; the epilogue's sums and comparison against a zero side; the check
MODES = {"pingpong": (0, False), "compare": (0, True), "inline": (1, True), "checker": (2, True)}
# registers per thread of a consumer and a checker warp (the checker's 4 warps are paid for by the
# consumers: 65 536 registers hold 2·128·200 + 64·24 + 128·96)
REGS = {0: (232, 24), 1: (232, 24), 2: (200, 96)}
TILES = [Tile(128, 128, 64, 4)]  # 3 stages: 0.73–0.91 of cuBLAS bare (results/gluon_pingpong_probe.json)


def _layouts(tile: Tile) -> list[tuple[list[int], object, object]]:
    """(box, dtype, shared layout) of the descriptors of A, B, C (bf16) and c_blk (fp32)."""
    boxes = ([tile.bm, tile.bk], [tile.bk, tile.bn], [tile.bm, tile.bn], [1, tile.bk])
    dtypes = (gl.bfloat16,) * 3 + (gl.float32,)
    return [(box, dt, gl.NVMMASharedLayout.get_default_for(box, dt)) for box, dt in zip(boxes, dtypes, strict=True)]


def _signature(tile: Tile) -> dict[str, str]:
    """The descriptors' types as the compiler names them (for compiling without a GPU)."""
    from common import descriptor_type

    names = {gl.bfloat16: "bf16", gl.float32: "fp32"}
    descs = [descriptor_type(box, names[dt], layout) for box, dt, layout in _layouts(tile)]
    return dict(zip(("a_desc", "b_desc", "c_desc", "cb_desc"), descs, strict=True))


def launch(a, b, c, c_blk, ev, slot, tile: Tile, side: int, compare: bool, fault: bool = False,
           evidence: bool = False) -> None:  # fmt: skip
    """a [M, K], b [K, N] bf16 row-major → c [M, N] bf16; c_blk [tiles_n, K] fp32; the launch's largest
    normalized difference folded into slot [1] fp32 (set it to 0 first); with `evidence`, ev
    [2, tiles_n, M] fp32."""
    m, k = a.shape
    n = b.shape[1]
    operands = zip((a, b, c, c_blk), _layouts(tile), strict=True)
    descs = [TensorDescriptor.from_tensor(t, box, layout) for t, (box, _, layout) in operands]
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    grid = (min(sms, triton.cdiv(m, tile.bm) * triton.cdiv(n, tile.bn)),)
    tile_check_gemm_kernel[grid](*descs, ev, m if evidence else 0, slot, m, n, k, tile.stages, GROUP_M,
                                 *REGS[side], side == 1, side == 2, side > 0, compare, fault, num_warps=4)  # fmt: skip


def block_sums(b: torch.Tensor, bn: int) -> torch.Tensor:
    """c_blk [tiles_n, K] fp32: each column block's row sums of b [K, N] (fp64, then rounded)."""
    k, n = b.shape
    padded = torch.nn.functional.pad(b.double(), (0, triton.cdiv(n, bn) * bn - n))
    return padded.view(k, -1, bn).sum(2).t().contiguous().float()


def measure(name: str, m: int, k: int, n: int, tile: Tile) -> dict:
    """One shape and tile: C, the row sums and the side against fp64, the fault found, then each mode
    timed beside cuBLAS."""
    from common import device_ms

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    tiles_n = triton.cdiv(n, tile.bn)
    c_blk = block_sums(b, tile.bn)
    ev = torch.zeros(2, tiles_n, m, device="cuda", dtype=torch.float32)
    slot = torch.zeros(1, device="cuda", dtype=torch.float32)
    row = {"layer": name, "M": m, "K": k, "N": n, "tile": dataclasses.asdict(tile)}
    ref = a.double() @ b.double()
    tiles = ref.view(m, tiles_n, tile.bn).permute(1, 0, 2)  # [tiles_n, M, BN]
    side_exact = c_blk.double() @ a.double().t()  # [tiles_n, M]: A·c_j with the kernel's rounded c_j
    row["cublas_ms"] = device_ms(functools.partial(torch.matmul, a, b, out=c))
    # the library's checked forward (Triton, row check, evidence inside the launch) at the same size,
    # against its own cuBLAS call (X·Wᵀ)
    from gemm import Case

    case = Case("fwd", m, k, n)
    row["library_row_ratio"] = device_ms(case.cublas) / device_ms(case.ours("row"))
    del case
    # mode by mode, each checked before it is timed and printed as it ends (a mode that hangs leaves
    # the ones before it in the log)
    for mode, (side, compare) in MODES.items():
        if side:
            ev.zero_()
            slot.zero_()
            launch(a, b, c, c_blk, ev, slot, tile, side, compare=True, evidence=True)
            torch.cuda.synchronize()
            # C: bf16 rounding of an fp32 sum, within 2⁻⁸ of the row's largest |C| (a wrong tile: O(1))
            c_err = (c.double() - ref).abs() / ref.abs().amax(dim=1, keepdim=True)
            row[f"{mode}_c_rel_err"] = c_err.max().item()
            # both sides against the exact tile row sums, relative to Σ|C| over the tile row: fp32
            # accumulation (~√K·2⁻²⁴); a wrong row, tile or layout is off by O(1)
            err = (ev[0].double() - tiles.sum(2)).abs() / tiles.abs().sum(2)
            row[f"{mode}_row_sum_rel_err"] = err.max().item()
            scale = c_blk.double().abs() @ a.double().abs().t()
            row[f"{mode}_side_rel_err"] = ((ev[1].double() - side_exact).abs() / scale).max().item()
            row[f"{mode}_clean_worst"] = slot.item()
            slot.zero_()
            launch(a, b, c, c_blk, ev, slot, tile, side, compare=True, fault=True)
            torch.cuda.synchronize()
            row[f"{mode}_fault_worst"] = slot.item()  # 1.0 over a tile row's norm (~√(K·BN)): ≫ clean_worst
        row[f"{mode}_ms"] = device_ms(functools.partial(launch, a, b, c, c_blk, ev, slot, tile, side, compare))
        row[f"{mode}_ratio"] = row["cublas_ms"] / row[f"{mode}_ms"]
        print(f"  {name} M={m} {mode}: {row[f'{mode}_ratio']:.3f} of cuBLAS", flush=True)
    return row


def compile_only() -> None:
    """Every mode and tile compiled for sm_90a (no GPU): registers and spills from ptxas."""
    from common import compile_for_sm90a

    for tile in TILES:
        signature = _signature(tile)
        signature.update(ev_ptr="*fp32", m_ev="i32", slot_ptr="*fp32", M="i32", N="i32", K="i32")
        for mode, (side, compare) in MODES.items():
            constexprs = dict(STAGES=tile.stages, GROUP_M=GROUP_M, CONSUMER_REGS=REGS[side][0],
                              CHECKER_REGS=REGS[side][1], INLINE=side == 1, CHECKER=side == 2, LOAD_SIDE=side > 0,
                              COMPARE=compare,
                              FAULT=False, num_warps=4)  # fmt: skip
            _, report, regs, spills, _ = compile_for_sm90a(tile_check_gemm_kernel, signature, constexprs, gluon=True,
                                                           num_warps=4)  # fmt: skip
            serialized = "C7515" in report or "C7510" in report
            print(f"{tile} {mode}: {regs} registers, {spills} bytes spilled, wgmma serialized: {serialized}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gluon_tile_check_probe.json")
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90a and report registers")
    parser.add_argument("--tokens", default="8192", help="comma-separated M values for every shape")
    parser.add_argument("--stages", type=int, default=TILES[0].stages, help="depth of the load ring")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.compile_only:
        compile_only()
        return
    from common import gpu_environment, write_result

    rows, summary = [], {}
    for tile in [dataclasses.replace(TILES[0], stages=args.stages)]:
        label = f"{tile.bm}x{tile.bn}x{tile.bk}s{tile.stages}"
        for (name, _, k, n), m in itertools.product(SHAPES, tokens):
            try:
                row = measure(name, m, k, n, tile)
            except Exception as error:  # a tile this Triton cannot compile or fit: recorded, not fatal
                row = {"layer": name, "tile": dataclasses.asdict(tile), "error": str(error).splitlines()[0][:200]}
            print(label, row, flush=True)
            rows.append(row)
            write_result(args.out, gpu_environment(), rows)  # so far: a later hang or timeout keeps these
        done = [r for r in rows if r["tile"] == dataclasses.asdict(tile) and "error" not in r]
        for mode in [*MODES, "library_row"]:
            ratios = sorted(r[f"{mode}_ratio"] for r in done)
            if ratios:
                summary[f"{label}_{mode}_median_ratio"] = ratios[len(ratios) // 2]
                summary[f"{label}_{mode}_min_ratio"] = ratios[0]
    write_result(args.out, gpu_environment(), rows, summary)


if __name__ == "__main__":
    main()
