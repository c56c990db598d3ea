"""Per-chunk sums and sums of magnitudes of a flat gradient buffer in one pass (CUDA; CPU under
TRITON_INTERPRET=1), for the collective checks of `distributed.comm_check`.

The plain-torch version of the same reduction takes about a dozen launches per buffer (views, an
fp32 group sum, fp64 casts, an L1 norm, index writes); a DDP model with 26 buckets checks each bucket
twice per step, so the launches alone would add milliseconds of host time to every step. Here one
launch reads the buffer once and writes both sums of every chunk, and a second folds the splits.

Numerics (the contract of `comm_check.rounding_bound`): each group of SUB consecutive elements is
summed in fp32, the groups in fp64; the same for magnitudes. Deterministic: every chunk split is
reduced by one program in a fixed order and the splits are folded by a fixed-order torch sum, so a
rescan of unchanged data gives the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from aegis_sdc.kernels.grid import ceil_div

GROUPS = 64  # SUB-groups per loop iteration: 64 × 64 elements = 8 KB of bf16 per load
TARGET_PROGRAMS = 528  # 4 per SM of an H200: enough loads in flight to stream at HBM bandwidth


@triton.jit
def _chunk_sums_kernel(
    x_ptr, out_ptr,  # x: flat [n] (any float dtype); out: fp64 [2, chunks, splits]
    n, chunk_size, split_size, chunks, splits,
    SUB: tl.constexpr, GROUPS: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    split = tl.program_id(1)
    chunk_end = tl.minimum((chunk + 1) * chunk_size, n)
    start = chunk * chunk_size + split * split_size
    end = tl.minimum(start + split_size, chunk_end)
    sums = tl.zeros([GROUPS], dtype=tl.float64)
    mags = tl.zeros([GROUPS], dtype=tl.float64)
    for offset in range(start, end, GROUPS * SUB):
        index = offset + tl.arange(0, GROUPS * SUB)
        values = tl.load(x_ptr + index, mask=index < end, other=0.0).to(tl.float32)
        groups = tl.reshape(values, [GROUPS, SUB])  # SUB-groups stay aligned: split_size % SUB == 0
        sums += tl.sum(groups, axis=1).to(tl.float64)
        mags += tl.sum(tl.abs(groups), axis=1).to(tl.float64)
    slot = chunk * splits + split
    tl.store(out_ptr + slot, tl.sum(sums, axis=0))
    tl.store(out_ptr + chunks * splits + slot, tl.sum(mags, axis=0))


def triton_chunk_sums(flat, chunks: int, chunk_size: int, sub: int):
    """[2, chunks] fp64 for a contiguous flat tensor cut into chunks of `chunk_size` (a multiple of
    `sub`); chunks past the end of the data are zero."""
    import torch

    block = GROUPS * sub
    splits = max(1, min(ceil_div(TARGET_PROGRAMS, chunks), ceil_div(chunk_size, block)))
    split_size = ceil_div(ceil_div(chunk_size, splits), block) * block
    splits = ceil_div(chunk_size, split_size)
    partial = torch.empty(2, chunks, splits, dtype=torch.float64, device=flat.device)
    _chunk_sums_kernel[(chunks, splits)](
        flat, partial, flat.numel(), chunk_size, split_size, chunks, splits, SUB=sub, GROUPS=GROUPS
    )
    return partial.sum(dim=2)
