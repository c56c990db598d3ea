"""Probe (GPU): a checked attention forward in Gluon, where the reference side's MMA rides in the P·V
MMA's group — whether the forward invariant can cost ~nothing on Hopper, against cuDNN (SDPA's
default) and our Triton kernels in the same run.

Triton 3.6 waits for every MMA group as soon as it is issued (`attention_registers.py`'s
`mma_sequence`: `…WWWWcw0` after the scores, after P·V and after the side), so in the Triton kernel
the side `p·W_V` is a round trip of its own per key block and nothing overlaps an MMA. Gluon places
the waits by hand. This forward (one program per 128 query rows of one head, 8 warps, K and V
brought by TMA into a ring of stages) issues per key block

    S = Q·Kᵀ (async)  · wait for it (and for the block before's P·V and side) ·  softmax on S
    O = α·O + P·V (async, P from registers)  ·  R = α·R + P·W_V (async, same operand)  · no wait

so the side is issued behind P·V and waited for with the next block's scores: one wait per key
block where the Triton kernel has three (P·V and the side run while the next block's scores are
issued). Variants (`VARIANTS`): bare or checked; the side 16 wide (W_V's columns) or 8 (the
narrowest wgmma, m64n8k16: the first eight columns, all that carry values); and `PIPELINE`, which
issues block j + 1's scores before block j's softmax — the tensor cores compute them, and block
j − 1's P·V and side, while the CUDA cores compute softmax j (K has a ring of its own two blocks
ahead, V one block ahead; the last block issues its own scores again, so the number of MMA groups in
flight, and with it every wait's count, is a constant). The invariant and its
operand W_V = [hi, mid, lo of V·1, ‖V‖², 0…] are the library's (`kernels/triton_attention.py`): the
check |O_acc·1 − p·(V·1)| / max(u·sqrt(p·‖V‖²), u·Σ|O_acc|).

Checked before timing: O against SDPA (bf16 rounding), the row sums of O_acc and the side against
each other (the clean normalized difference), and a fault (1.0 added to one element of one head's
O accumulator) seen. Timed (`do_bench` medians): SDPA default, our Triton forward unchecked and
checked, and each variant of this forward; cases as `benchmarks/attention.py` (32/8 heads, D 128,
bf16, 8192 tokens per call, causal and full).

    python benchmarks/gluon_attention_probe.py [--pipeline off|on|both] [--out FILE]
        (FILE: benchmarks/results/gluon_attention_probe.json unless given)
    python benchmarks/gluon_attention_probe.py --compile-only   # registers, spills, MMA order; sm_90a, no GPU

Triton 3.6's Gluon; Hopper only; no interpreter.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch
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

LOG2E = 1.4426950408889634
U32 = 2.0**-24
BM, BN, D, STAGES, NUM_WARPS = 128, 128, 128, 2, 8


@dataclasses.dataclass(frozen=True)
class Variant:
    """One form of the forward: checked or bare, the side MMA's N (W_V's 16 columns, or its first 8:
    the narrowest wgmma), and whether the next block's scores are issued before the softmax."""

    check: bool
    side_n: int = 16
    pipeline: bool = False

    @property
    def name(self) -> str:
        form = f"_checked_n{self.side_n}" if self.check else "_bare"
        return ("gluon_pipelined" if self.pipeline else "gluon") + form


VARIANTS = [Variant(c, n, p) for p in (False, True) for c, n in ((False, 16), (True, 16), (True, 8))]


@gluon.jit
def _load_kv(k_desc, v_desc, w_desc, k_bufs, v_bufs, w_bufs, ready, kv_row, block, CHECK: gl.constexpr):
    """Key block `block` (rows kv_row + block·BN …) of K, V (and W_V) into stage block % STAGES."""
    BN_: gl.constexpr = k_desc.block_type.shape[0]
    NS: gl.constexpr = k_bufs.shape[0]
    s = block % NS
    nbytes: gl.constexpr = k_desc.block_type.nbytes + v_desc.block_type.nbytes + CHECK * w_desc.block_type.nbytes
    mbarrier.expect(ready.index(s), nbytes)
    tma.async_copy_global_to_shared(k_desc, [kv_row + block * BN_, 0], ready.index(s), k_bufs.index(s))
    tma.async_copy_global_to_shared(v_desc, [kv_row + block * BN_, 0], ready.index(s), v_bufs.index(s))
    if CHECK:
        tma.async_copy_global_to_shared(w_desc, [kv_row + block * BN_, 0], ready.index(s), w_bufs.index(s))


@gluon.jit
def _load_k(k_desc, k_bufs, k_ready, kv_row, block):
    """PIPELINE: key block `block` of K alone into its ring's slot block % 2."""
    BN_: gl.constexpr = k_desc.block_type.shape[0]
    s = block % k_bufs.shape[0]
    mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [kv_row + block * BN_, 0], k_ready.index(s), k_bufs.index(s))


@gluon.jit
def _load_vw(v_desc, w_desc, v_bufs, w_bufs, v_ready, kv_row, block, CHECK: gl.constexpr):
    """PIPELINE: key block `block` of V (and W_V) into their ring's slot block % 2."""
    BN_: gl.constexpr = v_desc.block_type.shape[0]
    s = block % v_bufs.shape[0]
    nbytes: gl.constexpr = v_desc.block_type.nbytes + CHECK * w_desc.block_type.nbytes
    mbarrier.expect(v_ready.index(s), nbytes)
    tma.async_copy_global_to_shared(v_desc, [kv_row + block * BN_, 0], v_ready.index(s), v_bufs.index(s))
    if CHECK:
        tma.async_copy_global_to_shared(w_desc, [kv_row + block * BN_, 0], v_ready.index(s), w_bufs.index(s))


@gluon.jit
def _softmax_step(s_acc, m_i, l_i, offs_m, block, q_shift, scale2, MASKED: gl.constexpr):
    """Scores [BM, BN] of key block `block` → (p, α, m, ℓ) in base 2; MASKED applies the causal mask
    (key n visible to query m when n ≤ m + q_shift)."""
    BN_: gl.constexpr = s_acc.shape[1]
    s = s_acc * scale2
    if MASKED:
        offs_n = block * BN_ + gl.arange(0, BN_, layout=gl.SliceLayout(0, s_acc.type.layout))
        s = gl.where(offs_n[None, :] <= offs_m[:, None] + q_shift, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _blocks(lo, hi, o_acc, r_acc, m_i, l_i, q_smem, k_bufs, v_bufs, w_bufs, ready, k_desc, v_desc, w_desc,
            kv_row, n_blocks, offs_m, q_shift, scale2, MASKED: gl.constexpr, CHECK: gl.constexpr):  # fmt: skip
    """Key blocks [lo, hi) (see the module docstring); the ring runs ahead over all n_blocks."""
    NS: gl.constexpr = k_bufs.shape[0]
    BM_: gl.constexpr = q_smem.shape[0]
    BN_: gl.constexpr = k_bufs.shape[1]
    NW: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, BN_, 16])  # fmt: skip
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_acc.type.layout, k_width=2)
    ps_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=r_acc.type.layout, k_width=2)
    zeros = gl.zeros([BM_, BN_], gl.float32, layout=s_layout)
    for block in range(lo, hi):
        s = block % NS
        mbarrier.wait(ready.index(s), (block // NS) & 1)
        s_acc = warpgroup_mma(q_smem, k_bufs.index(s).permute((1, 0)), zeros, use_acc=False, is_async=True)
        # the scores, and (in order) the block before's P·V and side: its stage is free again
        s_acc, o_acc, r_acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc, o_acc, r_acc))
        if block + NS - 1 < n_blocks:
            _load_kv(k_desc, v_desc, w_desc, k_bufs, v_bufs, w_bufs, ready, kv_row, block + NS - 1, CHECK)
        p, alpha, m_i, l_i = _softmax_step(s_acc, m_i, l_i, offs_m, block, q_shift, scale2, MASKED)
        p_bf = p.to(gl.bfloat16)
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_acc.type.layout))
        o_acc = warpgroup_mma(gl.convert_layout(p_bf, p_layout), v_bufs.index(s), o_acc * alpha_o[:, None],
                              is_async=True)  # fmt: skip
        if CHECK:  # the same rounded operand against W_V, in the group behind P·V
            alpha_r = gl.convert_layout(alpha, gl.SliceLayout(1, r_acc.type.layout))
            r_acc = warpgroup_mma(gl.convert_layout(p_bf, ps_layout), w_bufs.index(s), r_acc * alpha_r[:, None],
                                  is_async=True)  # fmt: skip
        # (a wait that waits for nothing — P·V and the side stay in flight — so that the loop carries
        # the accumulators as tensors, as it took them in)
        o_acc, r_acc = warpgroup_mma_wait(num_outstanding=1 + CHECK, deps=(o_acc, r_acc))
    return o_acc, r_acc, m_i, l_i


@gluon.jit
def _pipelined_blocks(lo, hi, s_cur, o_acc, r_acc, m_i, l_i, q_smem, k_bufs, v_bufs, w_bufs, k_ready, v_ready,
                      k_desc, v_desc, w_desc, kv_row, n_blocks, offs_m, q_shift, scale2, MASKED: gl.constexpr,
                      CHECK: gl.constexpr):  # fmt: skip
    """PIPELINE: key blocks [lo, hi) with block j + 1's scores issued before block j's softmax, so the
    tensor cores compute them (and block j − 1's P·V and side) while the CUDA cores compute the softmax;
    s_cur holds block lo's scores on entry (and the next's on return). K and V have rings of their
    own: K runs two blocks ahead, V one. The last block issues its own scores again (a constant
    number of MMA groups in flight, so the waits' counts are constants)."""
    NS: gl.constexpr = k_bufs.shape[0]
    BM_: gl.constexpr = q_smem.shape[0]
    BN_: gl.constexpr = k_bufs.shape[1]
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_acc.type.layout, k_width=2)
    ps_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=r_acc.type.layout, k_width=2)
    s_layout: gl.constexpr = s_cur.type.layout
    zeros = gl.zeros([BM_, BN_], gl.float32, layout=s_layout)
    for block in range(lo, hi):
        nxt = gl.minimum(block + 1, n_blocks - 1)
        mbarrier.wait(k_ready.index(nxt % NS), (nxt // NS) & 1)
        s_next = warpgroup_mma(q_smem, k_bufs.index(nxt % NS).permute((1, 0)), zeros, use_acc=False, is_async=True)
        p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, offs_m, block, q_shift, scale2, MASKED)
        p_bf = p.to(gl.bfloat16)
        # the block before's P·V and side (issued before these scores) are done: its V slot is free
        o_acc, r_acc = warpgroup_mma_wait(num_outstanding=1, deps=(o_acc, r_acc))
        if block + 1 < n_blocks:
            _load_vw(v_desc, w_desc, v_bufs, w_bufs, v_ready, kv_row, block + 1, CHECK)
        mbarrier.wait(v_ready.index(block % NS), (block // NS) & 1)
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_acc.type.layout))
        o_acc = warpgroup_mma(gl.convert_layout(p_bf, p_layout), v_bufs.index(block % NS),
                              o_acc * alpha_o[:, None], is_async=True)  # fmt: skip
        if CHECK:
            alpha_r = gl.convert_layout(alpha, gl.SliceLayout(1, r_acc.type.layout))
            r_acc = warpgroup_mma(gl.convert_layout(p_bf, ps_layout), w_bufs.index(block % NS),
                                  r_acc * alpha_r[:, None], is_async=True)  # fmt: skip
        # the next block's scores (issued first, so done first); P·V and the side stay in flight
        s_cur, o_acc, r_acc = warpgroup_mma_wait(num_outstanding=1 + CHECK, deps=(s_next, o_acc, r_acc))
        if block + 2 < n_blocks:  # into this block's K slot: its scores are long done
            _load_k(k_desc, k_bufs, k_ready, kv_row, block + 2)
    return s_cur, o_acc, r_acc, m_i, l_i


@gluon.jit
def gluon_attention_fwd_kernel(q_desc, k_desc, v_desc, w_desc, o_desc, ev_ptr, Sq, Sk, heads, group, scale2,
                               fault_head, CAUSAL: gl.constexpr, CHECK: gl.constexpr, FAULT: gl.constexpr,
                               STAGES_: gl.constexpr, PIPELINE: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """One program: query rows [pid_m·BM, +BM) of flattened head `head` (q, o [N·Sq, D]; k, v, W_V
    [Nkv·Sk, ·]); ev [N·Sq, 3] fp32 (CHECK): O_acc·1, the side, the check's scale, per row."""
    BM_: gl.constexpr = q_desc.block_type.shape[0]
    BN_: gl.constexpr = k_desc.block_type.shape[0]
    D_: gl.constexpr = q_desc.block_type.shape[1]
    pid_m = gl.program_id(0)
    head = gl.program_id(1)
    kv_head = (head // heads) * (heads // group) + (head % heads) // group
    q_row = head * Sq + pid_m * BM_
    kv_row = kv_head * Sk

    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D_, 16])  # fmt: skip
    SW: gl.constexpr = w_desc.block_type.shape[1]  # the side's width: W_V's first 8 or 16 columns
    r_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, SW, 16])  # fmt: skip
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BN_, 16])  # fmt: skip
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES_] + k_desc.block_type.shape, k_desc.layout)  # noqa: RUF005
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES_] + v_desc.block_type.shape, v_desc.layout)  # noqa: RUF005
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES_] + w_desc.block_type.shape, w_desc.layout)  # noqa: RUF005
    ready = gl.allocate_shared_memory(gl.int64, [STAGES_, 1], mbarrier.MBarrierLayout())  # (PIPELINE: K's)
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES_, 1], mbarrier.MBarrierLayout())  # PIPELINE: V's
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES_):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
    mbarrier.init(q_bar, count=1)

    # causal (queries aligned to the end of the keys): the blocks below `free` need no mask
    q_shift = Sk - Sq
    hi = gl.cdiv(Sk, BN_)
    free = hi
    if CAUSAL:
        hi = gl.minimum(hi, gl.cdiv((pid_m + 1) * BM_ + q_shift, BN_))
        free = gl.minimum(gl.maximum(pid_m * BM_ + q_shift + 1, 0) // BN_, hi)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    offs_m = pid_m * BM_ + gl.arange(0, BM_, layout=s_rows)
    m_i = gl.full([BM_], float("-inf"), gl.float32, layout=s_rows)
    l_i = gl.zeros([BM_], gl.float32, layout=s_rows)
    o_acc = gl.zeros([BM_, D_], gl.float32, layout=o_layout)
    r_acc = gl.zeros([BM_, SW], gl.float32, layout=r_layout)
    if PIPELINE:  # K two blocks ahead, V one; block 0's scores before the loop
        _load_k(k_desc, k_bufs, ready, kv_row, 0)
        if hi > 1:
            _load_k(k_desc, k_bufs, ready, kv_row, 1)
        _load_vw(v_desc, w_desc, v_bufs, w_bufs, v_ready, kv_row, 0, CHECK)
        mbarrier.wait(q_bar, 0)
        mbarrier.wait(ready.index(0), 0)
        s_zeros = gl.zeros([BM_, BN_], gl.float32, layout=s_layout)
        s_cur = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s_zeros, use_acc=False, is_async=True)
        s_cur = warpgroup_mma_wait(num_outstanding=0, deps=(s_cur,))
        s_cur, o_acc, r_acc, m_i, l_i = _pipelined_blocks(
            0, free, s_cur, o_acc, r_acc, m_i, l_i, q_smem, k_bufs, v_bufs, w_bufs, ready, v_ready, k_desc, v_desc,
            w_desc, kv_row, hi, offs_m, q_shift, scale2, False, CHECK)  # fmt: skip
        s_cur, o_acc, r_acc, m_i, l_i = _pipelined_blocks(
            free, hi, s_cur, o_acc, r_acc, m_i, l_i, q_smem, k_bufs, v_bufs, w_bufs, ready, v_ready, k_desc, v_desc,
            w_desc, kv_row, hi, offs_m, q_shift, scale2, True, CHECK)  # fmt: skip
    else:
        for b in gl.static_range(STAGES_ - 1):
            if b < hi:
                _load_kv(k_desc, v_desc, w_desc, k_bufs, v_bufs, w_bufs, ready, kv_row, b, CHECK)
        mbarrier.wait(q_bar, 0)
        o_acc, r_acc, m_i, l_i = _blocks(0, free, o_acc, r_acc, m_i, l_i, q_smem, k_bufs, v_bufs, w_bufs, ready,
                                         k_desc, v_desc, w_desc, kv_row, hi, offs_m, q_shift, scale2, False,
                                         CHECK)  # fmt: skip
        o_acc, r_acc, m_i, l_i = _blocks(free, hi, o_acc, r_acc, m_i, l_i, q_smem, k_bufs, v_bufs, w_bufs, ready,
                                         k_desc, v_desc, w_desc, kv_row, hi, offs_m, q_shift, scale2, True,
                                         CHECK)  # fmt: skip
    o_acc, r_acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_acc, r_acc))

    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    if FAULT:  # 1.0 in row 0, column 0 of the accumulator of head `fault_head`'s first query block
        r = gl.arange(0, BM_, layout=o_rows)[:, None]
        c = gl.arange(0, D_, layout=gl.SliceLayout(0, o_layout))[None, :]
        o_acc = o_acc + gl.where((r == 0) & (c == 0) & (head == fault_head) & (pid_m == 0), 1.0, 0.0)
    if CHECK:
        cols = gl.arange(0, SW, layout=gl.SliceLayout(0, r_layout))[None, :]
        side = gl.convert_layout(gl.sum(gl.where(cols < 3, r_acc, 0.0), axis=1), o_rows)
        ssq = gl.convert_layout(gl.sum(gl.where(cols == 3, r_acc, 0.0), axis=1), o_rows)
        rows = q_row + gl.arange(0, BM_, layout=o_rows)
        gl.store(ev_ptr + rows * 3, gl.sum(o_acc, axis=1))
        gl.store(ev_ptr + rows * 3 + 1, side)
        gl.store(ev_ptr + rows * 3 + 2, gl.maximum(gl.sqrt(ssq), gl.sum(gl.abs(o_acc), axis=1)))
    l_o = gl.convert_layout(gl.where(l_i == 0.0, 1.0, l_i), o_rows)
    o_smem = gl.allocate_shared_memory(o_desc.dtype, o_desc.block_type.shape, o_desc.layout)
    o_smem.store((o_acc / l_o[:, None]).to(o_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, 0], o_smem)
    tma.store_wait(pendings=0)


def _boxes(side_n: int) -> list[tuple[list[int], object]]:
    """(box, shared layout) of the descriptors of q, k, v, W_V, o (bf16; W_V [rows, 16] read `side_n`
    wide: its columns hi, mid, lo, ‖V‖² and zeros — 8 is the narrowest wgmma)."""
    boxes = ([BM, D], [BN, D], [BN, D], [BN, side_n], [BM, D])
    return [(box, gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)) for box in boxes]


def _descs(q, k, v, w, o, side_n: int = 16):
    """TMA descriptors of the flattened operands ([rows, D]; W_V [rows, 16])."""
    return [TensorDescriptor.from_tensor(t, box, layout)
            for t, (box, layout) in zip((q, k, v, w, o), _boxes(side_n), strict=True)]  # fmt: skip


def measure(b: int, s: int, causal: bool, variants: list[Variant], heads: int = 32, kv_heads: int = 8) -> dict:
    from triton.testing import do_bench

    from aegis_sdc.kernels import triton_attention as ta

    torch.manual_seed(0)
    q4 = torch.randn(b, heads, s, D, device="cuda", dtype=torch.bfloat16)
    k4, v4 = (torch.randn(b, kv_heads, s, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q, k, v = (t.reshape(-1, D) for t in (q4, k4, v4))
    n, group = b * heads, heads // kv_heads
    w = ta._sums(v4, kv_heads)[0].reshape(-1, 16)  # W_V [Nkv·S, 16]: the library's side operand
    o = torch.empty_like(q)
    ev = torch.zeros(n * s, 3, device="cuda", dtype=torch.float32)

    def run(variant: Variant, fault_head: int = -1):
        gluon_attention_fwd_kernel[(s // BM, n)](*_descs(q, k, v, w, o, variant.side_n), ev, s, s, heads, group,
                                                 D**-0.5 * LOG2E, fault_head, causal, variant.check, fault_head >= 0,
                                                 STAGES, variant.pipeline, num_warps=NUM_WARPS)  # fmt: skip

    row = {"batch": b, "seq": s, "causal": causal, "heads": heads, "kv_heads": kv_heads, "dim": D,
           "blocks": {"bm": BM, "bn": BN, "stages": STAGES, "warps": NUM_WARPS},
           "fault_row_expected": 3 * s}  # fmt: skip
    ref = torch.nn.functional.scaled_dot_product_attention(q4.float(), k4.float(), v4.float(), is_causal=causal,
                                                           enable_gqa=True)  # fmt: skip
    for variant in variants:
        # values: O against SDPA in fp32 (P and O rounded to bf16: ~2⁻⁸ of the row's largest |O|)
        o.zero_()
        run(variant)
        torch.cuda.synchronize()
        err = (o.view(b, heads, s, D).float() - ref).abs() / ref.abs().amax(dim=-1, keepdim=True)
        row[f"{variant.name}_o_rel_err"] = err.max().item()
        if variant.check:
            # the check: clean normalized differences in units of u (a wrong side or layout: ≫ 10³)
            diff = (ev[:, 0] - ev[:, 1]).abs() / (U32 * ev[:, 2]).clamp_min(1e-30)
            row[f"{variant.name}_clean_worst_u"] = diff.max().item()
            run(variant, fault_head=3)
            torch.cuda.synchronize()
            diff = (ev[:, 0] - ev[:, 1]).abs() / (U32 * ev[:, 2]).clamp_min(1e-30)
            row[f"{variant.name}_fault_worst_u"] = diff.max().item()
            row[f"{variant.name}_fault_row"] = int(diff.argmax().item())
    del ref
    # times
    qf, kf, vf = (t.reshape(-1, s, D) for t in (q4, k4, v4))
    row["sdpa_ms"] = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=causal,
                                                                                        enable_gqa=True))  # fmt: skip
    row["triton_unchecked_ms"] = do_bench(lambda: ta.forward(qf, kf, vf, D**-0.5, causal, heads=heads, check=False))
    row["triton_checked_ms"] = do_bench(lambda: ta.forward(qf, kf, vf, D**-0.5, causal, heads=heads, check=True))
    for variant in variants:
        row[f"{variant.name}_ms"] = do_bench(lambda variant=variant: run(variant))
    for key in ("triton_unchecked", "triton_checked", *(v.name for v in variants)):
        row[f"{key}_ratio"] = row["sdpa_ms"] / row[f"{key}_ms"]
    for variant in variants:
        if variant.check:
            bare = "gluon_pipelined_bare" if variant.pipeline else "gluon_bare"
            row[f"{variant.name}_invariant_cost"] = row[f"{variant.name}_ms"] / row[f"{bare}_ms"] - 1
    print({k: (round(x, 4) if isinstance(x, float) else x) for k, x in row.items()}, flush=True)
    return row


def compile_only() -> None:
    """Every variant compiled for sm_90a (no GPU): registers, spills and the order of MMA issues and waits."""
    from attention_registers import mma_sequence
    from common import compile_for_sm90a, descriptor_type

    for causal in (False, True):
        for variant in VARIANTS:
            descs = [descriptor_type(box, "bf16", layout) for box, layout in _boxes(variant.side_n)]
            signature = dict(zip(("q_desc", "k_desc", "v_desc", "w_desc", "o_desc"), descs, strict=True))
            signature.update(ev_ptr="*fp32", Sq="i32", Sk="i32", heads="i32", group="i32", scale2="fp32",
                             fault_head="i32")  # fmt: skip
            constexprs = dict(CAUSAL=causal, CHECK=variant.check, FAULT=False, STAGES_=STAGES,
                              PIPELINE=variant.pipeline, num_warps=NUM_WARPS)  # fmt: skip
            compiled, _, regs, spills, _ = compile_for_sm90a(gluon_attention_fwd_kernel, signature, constexprs,
                                                             gluon=True, num_warps=NUM_WARPS)  # fmt: skip
            print(f"causal={causal} {variant.name}: {regs} registers, {spills} bytes spilled, "
                  f"smem {compiled.metadata.shared} B, MMA order {mma_sequence(compiled.asm['ptx'])}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gluon_attention_probe.json",
                        help="the record (JSON), written after every case")  # fmt: skip
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90a and report (no GPU)")
    parser.add_argument("--pipeline", choices=["off", "on", "both"], default="both",
                        help="which variants: without PIPELINE, with it, or both (a kernel that hangs takes the "
                        "call with it: run the two in separate processes to keep what the first measured)")  # fmt: skip
    args = parser.parse_args()
    variants = [v for v in VARIANTS if args.pipeline == "both" or v.pipeline == (args.pipeline == "on")]
    if args.compile_only:
        compile_only()
        return
    import statistics

    from common import gpu_environment, write_result

    started = time.time()
    rows = []
    for b, s in ((4, 2048), (2, 4096), (1, 8192)):
        for causal in (True, False):
            rows.append(measure(b, s, causal, variants))
            write_result(args.out, gpu_environment(seconds=round(time.time() - started, 1)), rows)
    names = ("triton_unchecked", "triton_checked", *(v.name for v in variants))
    summary = {f"median_{key}_ratio": statistics.median(r[f"{key}_ratio"] for r in rows) for key in names}
    for variant in variants:
        if variant.check:
            key = f"{variant.name}_invariant_cost"
            summary[f"median_{key}"] = statistics.median(r[key] for r in rows)
    summary["ratio"] = "SDPA default backend time / ours (1 = parity)"
    write_result(args.out, gpu_environment(seconds=round(time.time() - started, 1)), rows, summary)


if __name__ == "__main__":
    main()
