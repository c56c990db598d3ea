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
def producer_partition(descs, bufs, bars, MNK, GROUP_M: gl.constexpr):
    """One warp: the A and B tiles of this program's tiles, K step by K step, into the stage ring."""
    a_desc, b_desc, _ = descs
    a_bufs, b_bufs, _ = bufs
    ready_bars, empty_bars, _, _, _ = bars
    M, N, K = MNK
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.shape[0]

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
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, kk * BK], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [kk * BK, off_n], bar, b_bufs.index(s))
            it += 1


@gluon.jit
def consumer_partition(
    descs, bufs, bars, MNK, part_ptr, CID: gl.constexpr, GROUP_M: gl.constexpr, PARTIALS: gl.constexpr
):
    """One warp group (CID 0 or 1): this program's tiles CID, CID + 2, … — its K loop when the other
    group hands it the tensor cores, then its epilogue (partials, C into shared memory) while the other
    group runs its K loop."""
    a_desc, b_desc, c_desc = descs
    a_bufs, b_bufs, c_bufs = bufs
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
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    c_smem = c_bufs.index(CID)

    pid, nprog, num_pid_m, num_pid_n, num_tiles = _tile_grid(M, N, BM, BN)
    k_iters = gl.cdiv(K, BK)

    j = CID  # local tile index handled by this consumer: CID, CID+2, ...
    n_local = 0
    for t in range(pid + CID * nprog, num_tiles, 2 * nprog):
        pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        # ping-pong ordering: wait for our turn to issue MMAs
        mbarrier.wait(order_bars.index(CID), (n_local & 1) ^ (1 - CID))

        it = j * k_iters
        acc = gl.zeros([BM, BN], gl.float32, layout=acc_layout)
        for kk in range(k_iters):
            s = it % STAGES
            ph = (it // STAGES) & 1
            mbarrier.wait(ready_bars.index(s), ph)
            a_s = a_bufs.index(s)
            b_s = b_bufs.index(s)
            acc = warpgroup_mma(a_s, b_s, acc, use_acc=kk > 0, is_async=True)
            # keep 1 wgmma in flight; the previous stage is then free.
            # With >1 deps, warpgroup_mma_wait returns a tuple (one value per dep).
            acc, a_s, b_s = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_s, b_s))
            prev = (it + STAGES - 1) % STAGES
            mbarrier.arrive(empty_bars.index(prev), pred=kk > 0)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty_bars.index((it + STAGES - 1) % STAGES))
        # hand the tensor cores to the other consumer
        mbarrier.arrive(order_bars.index(1 - CID))

        # epilogue part 1 (in consumer registers, under the other consumer's K loop): the row check's
        # per-tile partials [3, tiles_n, M] — Σ acc, Σ acc², Σ of the rounded output
        if PARTIALS:
            offs_m = off_m + gl.arange(0, BM, layout=row_layout)
            mask_m = offs_m < M
            base = part_ptr + pid_n * M + offs_m
            gl.store(base, gl.sum(acc, axis=1), mask=mask_m)
            gl.store(base + num_pid_n * M, gl.sum(acc * acc, axis=1), mask=mask_m)
            gl.store(base + 2 * num_pid_n * M, gl.sum(acc.to(c_desc.dtype).to(gl.float32), axis=1), mask=mask_m)

        # epilogue part 2: bf16 C tile -> smem, epilogue warp TMA-stores it
        mbarrier.wait(c_empty_bars.index(CID), (n_local & 1) ^ 1)
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        mbarrier.arrive(c_ready_bars.index(CID))
        j += 2
        n_local += 1  # noqa: SIM113  (a kernel loop: no enumerate)


@gluon.jit
def epilogue_partition(descs, bufs, bars, MNK, GROUP_M: gl.constexpr):
    """One warp: each C tile the consumers leave in shared memory, stored by TMA in tile order."""
    _, _, c_desc = descs
    _, _, c_bufs = bufs
    _, _, _, c_ready_bars, c_empty_bars = bars
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
def consumer0_default(descs, bufs, bars, MNK, part_ptr, GROUP_M: gl.constexpr, PARTIALS: gl.constexpr):
    consumer_partition(descs, bufs, bars, MNK, part_ptr, 0, GROUP_M, PARTIALS)


@gluon.jit
def consumer1_worker(descs, bufs, bars, MNK, part_ptr, GROUP_M: gl.constexpr, PARTIALS: gl.constexpr):
    consumer_partition(descs, bufs, bars, MNK, part_ptr, 1, GROUP_M, PARTIALS)


@gluon.jit
def ws_pingpong_gemm_kernel(
    a_desc,
    b_desc,
    c_desc,
    part_ptr,
    M,
    N,
    K,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PARTIALS: gl.constexpr,
    num_warps: gl.constexpr,
):
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
        mbarrier.init(empty_bars.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(order_bars.index(i), count=1)
        mbarrier.init(c_ready_bars.index(i), count=1)
        mbarrier.init(c_empty_bars.index(i), count=1)

    descs = (a_desc, b_desc, c_desc)
    bufs = (a_bufs, b_bufs, c_bufs)
    bars = (ready_bars, empty_bars, order_bars, c_ready_bars, c_empty_bars)
    MNK = (M, N, K)
    gl.warp_specialize(
        [
            (consumer0_default, (descs, bufs, bars, MNK, part_ptr, GROUP_M, PARTIALS)),  # default: num_warps warps
            (consumer1_worker, (descs, bufs, bars, MNK, part_ptr, GROUP_M, PARTIALS)),
            (producer_partition, (descs, bufs, bars, MNK, GROUP_M)),
            (epilogue_partition, (descs, bufs, bars, MNK, GROUP_M)),
        ],
        [4, 1, 1],
        [CONSUMER_REGS, 24, 24],
    )


BM, BN, BK, STAGES, GROUP_M = 128, 128, 64, 4, 8


def make_layouts():
    a_l = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    b_l = gl.NVMMASharedLayout.get_default_for([BK, BN], gl.bfloat16)
    c_l = gl.NVMMASharedLayout.get_default_for([BM, BN], gl.bfloat16)
    return a_l, b_l, c_l


def launch(A, B, C, parts, partials=True, consumer_regs=232, maxnreg=None):
    """A [M, K], B [K, N] bf16 row-major → C [M, N] bf16; with `partials`, parts [3, tiles_n, M] fp32."""
    import torch

    M, K = A.shape
    N = B.shape[1]
    a_l, b_l, c_l = make_layouts()
    a_desc = TensorDescriptor.from_tensor(A, [BM, BK], a_l)
    b_desc = TensorDescriptor.from_tensor(B, [BK, BN], b_l)
    c_desc = TensorDescriptor.from_tensor(C, [BM, BN], c_l)
    num_sms = torch.cuda.get_device_properties(A.device).multi_processor_count
    grid = (min(num_sms, triton.cdiv(M, BM) * triton.cdiv(N, BN)),)
    kw = dict(num_warps=4)
    if maxnreg is not None:
        kw["maxnreg"] = maxnreg
    ws_pingpong_gemm_kernel[grid](
        a_desc, b_desc, c_desc, parts, M, N, K, STAGES, GROUP_M, consumer_regs, partials, **kw
    )


SHAPES = [("gate_up", 8192, 2048, 5632), ("q_o", 8192, 2048, 2048), ("8b.o", 8192, 4096, 4096),
          ("down", 8192, 5632, 2048), ("kv", 8192, 2048, 256)]  # fmt: skip


def main() -> None:
    from common import device_ms, gpu_environment, write_result

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gluon_pingpong_probe.json")
    args = parser.parse_args()
    rows = []
    for name, m, k, n in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        tiles_n = triton.cdiv(n, BN)
        parts = torch.zeros(3, tiles_n, m, device="cuda", dtype=torch.float32)
        launch(a, b, c, parts)
        torch.cuda.synchronize()
        ref = a.double() @ b.double()
        # C: the bf16 rounding of an fp32 sum (|error| ≤ half a bf16 ulp plus fp32 accumulation error):
        # within 2⁻⁸ of the row's largest |C| (a wrong tile or layout is off by O(1))
        scale = ref.abs().amax(dim=1, keepdim=True)
        c_err = ((c.double() - ref).abs() / scale).max().item()
        # per-tile row sums of the fp32 accumulator against the exact ones: fp32 accumulation error
        # (~√K·2⁻²⁴ of Σ|C| over the tile's row) — a wrong tile, row or layout is off by O(1)
        tiles = ref.view(m, tiles_n, BN).permute(1, 0, 2)  # [tiles_n, M, BN] (N a multiple of BN here)
        sum_err = ((parts[0].double() - tiles.sum(2)).abs() / tiles.abs().sum(2)).max().item()
        sq_err = ((parts[1].double() - (tiles**2).sum(2)).abs() / (tiles**2).sum(2)).max().item()
        out_tiles = c.double().view(m, tiles_n, BN).permute(1, 0, 2)
        out_err = ((parts[2].double() - out_tiles.sum(2)).abs() / out_tiles.abs().sum(2)).max().item()
        row = {"layer": name, "M": m, "K": k, "N": n, "c_rel_err": c_err, "part_sum_rel_err": sum_err,
               "part_sq_rel_err": sq_err, "part_out_rel_err": out_err}  # fmt: skip
        row["cublas_ms"] = device_ms(functools.partial(torch.matmul, a, b, out=c))
        row["pingpong_ms"] = device_ms(functools.partial(launch, a, b, c, parts, partials=False))
        row["pingpong_partials_ms"] = device_ms(functools.partial(launch, a, b, c, parts))
        row["ratio"] = row["cublas_ms"] / row["pingpong_ms"]
        row["ratio_partials"] = row["cublas_ms"] / row["pingpong_partials_ms"]
        print(row, flush=True)
        rows.append(row)
    summary = {}
    for key in ("ratio", "ratio_partials"):
        ratios = sorted(r[key] for r in rows)
        summary |= {f"median_{key}": ratios[len(ratios) // 2], f"min_{key}": ratios[0]}
    write_result(args.out, gpu_environment(tile=[BM, BN, BK], stages=STAGES), rows, summary)


if __name__ == "__main__":
    main()
