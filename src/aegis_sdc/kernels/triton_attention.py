"""Checked FlashAttention in Triton: forward and backward with their invariants from the fp32 accumulators.

Heads are flattened as on the reference path (kernels/attention_reference.py): q [N, Sq, D], k and v
[N, Sk, D] (N = batch · query heads, GQA expanded by the op), scale c, optional causal mask with the
queries aligned to the end of the keys (SDPA's convention). Every program owns one block of rows of
one head and reduces its K dimension in one fixed order: no atomics, so a call replays bit for bit.

    forward   one program per (query block, head): the online softmax over key blocks, p rounded to
              the operand dtype for the P·V MMA (as FlashAttention does). Check: O_acc·1 against
              p·(V·1), both rescaled by the same factors as the running maximum moves — the reference
              side is taken from the rounded p the MMA multiplied, so it checks the MMA and the
              rescaling, scaled by u·sqrt(Σ_k p²‖V_k‖²) (the GEMM check's scale).
    backward  D = rowsum(dO ⊙ O) first (a torch reduction), then two kernels:
      dk/dv   one program per (key block, head), looping over query blocks: dV = Pᵀ·dO and
              dK = c·dSᵀ·q. Checks: dv — dV's column sums over the block's keys against
              (1ᵀPᵀ)·dO = Σ_q (Σ_k p_qk) dO_q, the GEMM column check of the P·dO MMA, scaled by
              u·Σ_q (Σ_k p_qk) |dO_qd|; dk — dK's row sums against dSᵀ·(Q·1), scaled by u·‖dK_k‖.
      dq      one program per (query block, head), looping over key blocks: dP = dO·Vᵀ,
              dS = P ⊙ (dP − D), dQ = c·dS·k. Checks: dp — dP's row sums against dO·(Vᵀ·1), scaled by
              u·‖dP_q‖; ds — the softmax-backward identity Σ_k dS_qk = 0, scaled by
              u·Σ_k|dS_qk| + u_O·Σ_d|dO_qd O_qd| (D is taken from the rounded O); dq — dQ's row
              sums against dS·(K·1), scaled by u·‖dQ_q‖; and the rows of the recomputed P, which sum
              to 1 within (Sk + 3)·u when the scores and the saved lse agree (a wrong score, exponent
              or saved lse breaks them).
    The backward values keep the reference path's five checks (`BACKWARD_CHECKS`): `dv` is the
    larger of dV's column check and P's row sums (the two things the reference path's `dv` covers).

Each program writes the largest normalized difference of its block per check and the Σ of its squared
raw differences (their root over a head is the AEGIS unit of fault size); the launcher reduces blocks to one
value per head with torch on the device — nothing reads the host. Under TRITON_INTERPRET=1 operands
are upcast after loading (bf16 arithmetic is wrong in the interpreter), as in kernels/triton_gemm.py.

Fault stages (constexpr STAGE, as `attention_reference.STAGES`): qk, softmax, pv (O's accumulator in
forward, dV's in backward), dp, ds, dq, dk — one element (head, row, col) perturbed or bit-flipped.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from aegis_sdc.kernels.attention_reference import BACKWARD_CHECKS, STAGES, Backward, Forward, HeadFault

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
U32 = tl.constexpr(2.0**-24)
TINY = tl.constexpr(1e-30)
NO_STAGE = -1
# check columns of the per-block outputs
FWD_CHECKS = 2  # normalized max, Σ raw²
KV_CHECKS = 4  # dv, dk normalized maxima; dv, dk Σ raw²
Q_CHECKS = 7  # dp, ds, dq, P's row sums normalized maxima; dp, ds, dq Σ raw²


@triton.jit
def _fault(x, rows, cols, head, fault_head, fault_row, fault_col, fault_delta, fault_mask, MODEL: tl.constexpr):
    """x [R, C] with element (fault_row, fault_col) of head `fault_head` corrupted (MODEL 1: + delta,
    2: bits XOR mask); `rows`, `cols` are the tile's global indices."""
    hit = (rows == fault_row)[:, None] & (cols == fault_col)[None, :] & (head == fault_head)
    if MODEL == 1:
        return tl.where(hit, x + fault_delta, x)
    flipped = (x.to(tl.int32, bitcast=True) ^ fault_mask).to(tl.float32, bitcast=True)
    return tl.where(hit, flipped, x)


@triton.jit
def _tile(ptr, rows, n_rows, stride, D: tl.constexpr, UPCAST: tl.constexpr):
    """Rows `rows` [R] of a [rows, D] matrix (rows past n_rows are zero)."""
    cols = tl.arange(0, D)
    t = tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=(rows < n_rows)[:, None], other=0.0)
    return t.to(tl.float32) if UPCAST else t


@triton.jit
def _kv_head(head, heads, group):
    """The key/value head of flattened query head `head` (batch-major, `heads` per batch, `group`
    query heads per key/value head): GQA read in place, no expanded copy of K and V."""
    return (head // heads) * (heads // group) + (head % heads) // group


@triton.jit
def _normalized(raw, sum_sq):
    """|raw| / (u·sqrt(sum_sq)), a GEMM check's difference; a sum of squares that overflowed fp32
    (|values| ≳ 10¹⁹) counts as non-finite (an infinite difference), as in kernels/gemm_evidence.py."""
    diff = tl.abs(raw) / tl.maximum(U32 * tl.sqrt(sum_sq), TINY)
    return tl.where(sum_sq == float("inf"), float("inf"), diff)


@triton.jit
def _operand(x, DT: tl.constexpr, UPCAST: tl.constexpr):
    """x [R, C] fp32 rounded to the operand dtype for an MMA (upcast again under the interpreter)."""
    rounded = x.to(DT)
    return rounded.to(tl.float32) if UPCAST else rounded


@triton.jit
def _mask_tile(mask_ptr, offs_m, offs_n, sm_q, Sq, Sk):
    """[BM, BN] of an additive mask (SDPA's attn_mask, fp32, unit key stride); 0 outside the scores."""
    inside = (offs_m < Sq)[:, None] & (offs_n < Sk)[None, :]
    return tl.load(mask_ptr + offs_m[:, None] * sm_q + offs_n[None, :], mask=inside, other=0.0)


@triton.jit
def _visible(offs_m, offs_n, Sq, Sk, CAUSAL: tl.constexpr):
    """[BM, BN]: key n exists and query m may see it (causal: n ≤ m + Sk − Sq)."""
    keep = (offs_n < Sk)[None, :] & (offs_m < Sq)[:, None]
    if CAUSAL:
        keep = keep & (offs_n[None, :] <= offs_m[:, None] + (Sk - Sq))
    return keep


@triton.jit
def _block_max(diff, valid):
    """The largest difference of the block's valid rows; NaN (a non-finite checksum) counts as infinite."""
    return tl.max(tl.where(valid, tl.where(diff != diff, float("inf"), diff), 0.0), axis=0)


@triton.jit
def _scores(q, k, offs_m, offs_n, head, mask_ptr, sm_n, sm_q, Sq, Sk, scale,
            fault_head, fault_row, fault_col, fault_delta, fault_mask,
            HAS_MASK: tl.constexpr, MODEL: tl.constexpr, STAGE: tl.constexpr):  # fmt: skip
    """The scaled scores q·kᵀ of one tile [BM, BN] with the additive mask (and a `qk` fault)."""
    s = tl.dot(q, tl.trans(k)) * scale
    if HAS_MASK:
        s += _mask_tile(mask_ptr + head * sm_n, offs_m, offs_n, sm_q, Sq, Sk)
    if STAGE == 0:
        s = _fault(s, offs_m, offs_n, head, fault_head, fault_row, fault_col, fault_delta, fault_mask, MODEL)
    return s


@triton.jit
def _backward_tile(q, k, v, do, lse, delta, offs_m, offs_n, head, mask_ptr, sm_n, sm_q, Sq, Sk, scale,
                   fault_head, fault_row, fault_col, fault_delta, fault_mask, CAUSAL: tl.constexpr,
                   HAS_MASK: tl.constexpr, MODEL: tl.constexpr, STAGE: tl.constexpr):  # fmt: skip
    """What both backward kernels recompute for one tile: P from the scores and the saved lse,
    dP = dO·Vᵀ and dS = P ∘ (dP − D), each with its stage's fault where asked."""
    s = _scores(q, k, offs_m, offs_n, head, mask_ptr, sm_n, sm_q, Sq, Sk, scale,
                fault_head, fault_row, fault_col, fault_delta, fault_mask, HAS_MASK, MODEL, STAGE)  # fmt: skip
    p = tl.where(_visible(offs_m, offs_n, Sq, Sk, CAUSAL), tl.exp(s - lse[:, None]), 0.0)
    if STAGE == 1:
        p = _fault(p, offs_m, offs_n, head, fault_head, fault_row, fault_col, fault_delta, fault_mask, MODEL)
    dp = tl.dot(do, tl.trans(v))
    if STAGE == 3:
        dp = _fault(dp, offs_m, offs_n, head, fault_head, fault_row, fault_col, fault_delta, fault_mask, MODEL)
    ds = p * (dp - delta[:, None])
    if STAGE == 4:
        ds = _fault(ds, offs_m, offs_n, head, fault_head, fault_row, fault_col, fault_delta, fault_mask, MODEL)
    return p, dp, ds


@triton.jit
def attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, check_ptr,  # check [N, q_blocks, FWD_CHECKS] fp32
    mask_ptr, sm_n, sm_q,  # additive fp32 mask [N or 1, Sq, Sk] (HAS_MASK), its head and row strides
    sq_n, sq_s, sk_n, sk_s, sv_n, sv_s, so_n, so_s,
    Sq, Sk, scale, heads, group,
    fault_head, fault_row, fault_col, fault_delta, fault_mask,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, CHECK: tl.constexpr, MODEL: tl.constexpr, STAGE: tl.constexpr,
    DT: tl.constexpr, UPCAST: tl.constexpr,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = _kv_head(head, heads, group)
    offs_m = pid_m * BM + tl.arange(0, BM)
    q = _tile(q_ptr + head * sq_n, offs_m, Sq, sq_s, D, UPCAST)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    ref = tl.zeros((BM,), tl.float32)  # Σ_k p_qk (V·1)_k, rescaled with acc
    ssq = tl.zeros((BM,), tl.float32)  # Σ_k p_qk² ‖V_k‖², rescaled by the square
    hi = Sk
    if CAUSAL:
        hi = tl.minimum(Sk, (pid_m + 1) * BM + Sk - Sq)
    for start_n in range(0, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        k = _tile(k_ptr + kv_head * sk_n, offs_n, Sk, sk_s, D, UPCAST)
        v = _tile(v_ptr + kv_head * sv_n, offs_n, Sk, sv_s, D, UPCAST)
        s = _scores(q, k, offs_m, offs_n, head, mask_ptr, sm_n, sm_q, Sq, Sk, scale,
                    fault_head, fault_row, fault_col, fault_delta, fault_mask, HAS_MASK, MODEL, STAGE)  # fmt: skip
        s = tl.where(_visible(offs_m, offs_n, Sq, Sk, CAUSAL), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key seen yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        if STAGE == 1:
            p = _fault(p, offs_m, offs_n, head, fault_head, fault_row, fault_col, fault_delta, fault_mask, MODEL)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p_op = _operand(p, DT, UPCAST)  # the MMA's operand; the reference side takes the same rounded values
        pf = p_op.to(tl.float32)
        vf = v.to(tl.float32)
        if CHECK:
            ref = ref * alpha + tl.sum(pf * tl.sum(vf, axis=1)[None, :], axis=1)
            ssq = ssq * alpha * alpha + tl.sum(pf * pf * tl.sum(vf * vf, axis=1)[None, :], axis=1)
        acc = acc * alpha[:, None] + tl.dot(p_op, v)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    if STAGE == 2:  # an error of `delta` in the normalized output is delta·ℓ in the accumulator
        acc = _fault(acc, offs_m, tl.arange(0, D), head, fault_head, fault_row, fault_col,
                     fault_delta * l_safe[:, None], fault_mask, MODEL)  # fmt: skip
    valid = offs_m < Sq
    if CHECK:
        raw = tl.sum(acc, axis=1) - ref
        diff = _normalized(raw, ssq)
        raw = raw / l_safe  # in units of the normalized output, as the reference path reports it
        slot = check_ptr + (head * tl.num_programs(0) + pid_m) * 2
        tl.store(slot, _block_max(diff, valid))
        tl.store(slot + 1, tl.sum(tl.where(valid, raw * raw, 0.0), axis=0))
    out = acc / l_safe[:, None]
    cols = tl.arange(0, D)
    tl.store(o_ptr + head * so_n + offs_m[:, None] * so_s + cols[None, :], out.to(o_ptr.dtype.element_ty),
             mask=valid[:, None])  # fmt: skip
    tl.store(lse_ptr + head * Sq + offs_m, m_i + tl.log(l_safe), mask=valid)


@triton.jit
def attention_bwd_kv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, check_ptr,  # check [N, k_blocks, KV_CHECKS]
    mask_ptr, sm_n, sm_q,
    sq_n, sq_s, sk_n, sk_s, sv_n, sv_s, sdo_n, sdo_s,
    Sq, Sk, scale, heads, group,
    fault_head, fault_row, fault_col, fault_delta, fault_mask,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, CHECK: tl.constexpr, MODEL: tl.constexpr, STAGE: tl.constexpr,
    DT: tl.constexpr, UPCAST: tl.constexpr,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """dK and dV of one key block (dK unscaled until stored), with the dv and dk checks."""
    pid_n = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = _kv_head(head, heads, group)
    offs_n = pid_n * BN + tl.arange(0, BN)
    cols = tl.arange(0, D)
    k = _tile(k_ptr + kv_head * sk_n, offs_n, Sk, sk_s, D, UPCAST)
    v = _tile(v_ptr + kv_head * sv_n, offs_n, Sk, sv_s, D, UPCAST)
    dk = tl.zeros((BN, D), tl.float32)
    dv = tl.zeros((BN, D), tl.float32)
    dv_ref = tl.zeros((D,), tl.float32)  # Σ_q (Σ_k p_qk) dO_q
    dv_abs = tl.zeros((D,), tl.float32)  # Σ_q (Σ_k p_qk) |dO_q|
    dk_ref = tl.zeros((BN,), tl.float32)  # Σ_q dS_qk (Q·1)_q
    lo = 0
    if CAUSAL:
        lo = tl.maximum(0, pid_n * BN - (Sk - Sq)) // BM * BM
    for start_m in range(lo, Sq, BM):
        offs_m = start_m + tl.arange(0, BM)
        q = _tile(q_ptr + head * sq_n, offs_m, Sq, sq_s, D, UPCAST)
        do = _tile(do_ptr + head * sdo_n, offs_m, Sq, sdo_s, D, UPCAST)
        lse = tl.load(lse_ptr + head * Sq + offs_m, mask=offs_m < Sq, other=0.0)
        delta = tl.load(delta_ptr + head * Sq + offs_m, mask=offs_m < Sq, other=0.0)
        p, _, ds = _backward_tile(q, k, v, do, lse, delta, offs_m, offs_n, head, mask_ptr, sm_n, sm_q, Sq, Sk,
                                   scale, fault_head, fault_row, fault_col, fault_delta, fault_mask, CAUSAL,
                                   HAS_MASK, MODEL, STAGE)  # fmt: skip
        p_op = _operand(p, DT, UPCAST)
        dv += tl.dot(tl.trans(p_op), do)
        if CHECK:
            p_rows = tl.sum(p_op.to(tl.float32), axis=1)
            dof = do.to(tl.float32)
            dv_ref += tl.sum(p_rows[:, None] * dof, axis=0)
            dv_abs += tl.sum(p_rows[:, None] * tl.abs(dof), axis=0)
        ds_op = _operand(ds, DT, UPCAST)
        dk += tl.dot(tl.trans(ds_op), q)
        if CHECK:
            dk_ref += tl.sum(ds_op.to(tl.float32) * tl.sum(q.to(tl.float32), axis=1)[:, None], axis=0)
    if STAGE == 2:
        dv = _fault(dv, offs_n, cols, head, fault_head, fault_row, fault_col, fault_delta, fault_mask, MODEL)
    if STAGE == 6:
        dk = _fault(dk, offs_n, cols, head, fault_head, fault_row, fault_col, fault_delta, fault_mask, MODEL)
    valid = offs_n < Sk
    if CHECK:
        dv_raw = tl.sum(dv, axis=0) - dv_ref
        dv_diff = tl.abs(dv_raw) / tl.maximum(U32 * dv_abs, TINY)
        dv_diff = tl.where(dv_abs == float("inf"), float("inf"), dv_diff)
        dk_raw = tl.where(valid, tl.sum(dk, axis=1) - dk_ref, 0.0)
        dk_diff = _normalized(dk_raw, tl.sum(dk * dk, axis=1))
        slot = check_ptr + (head * tl.num_programs(0) + pid_n) * 4
        tl.store(slot, _block_max(dv_diff, cols < D))
        tl.store(slot + 1, _block_max(dk_diff, valid))
        tl.store(slot + 2, tl.sum(dv_raw * dv_raw, axis=0))
        tl.store(slot + 3, tl.sum(dk_raw * dk_raw, axis=0))
    out = head * Sk * D + offs_n[:, None] * D + cols[None, :]
    tl.store(dv_ptr + out, dv, mask=valid[:, None])
    tl.store(dk_ptr + out, dk * scale, mask=valid[:, None])


@triton.jit
def attention_bwd_q_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dmag_ptr, dq_ptr, check_ptr,  # check [N, q_blocks, Q_CHECKS]
    mask_ptr, sm_n, sm_q,
    sq_n, sq_s, sk_n, sk_s, sv_n, sv_s, sdo_n, sdo_s,
    Sq, Sk, scale, u_out, heads, group,
    fault_head, fault_row, fault_col, fault_delta, fault_mask,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, CHECK: tl.constexpr, MODEL: tl.constexpr, STAGE: tl.constexpr,
    DT: tl.constexpr, UPCAST: tl.constexpr,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """dQ of one query block, with the dp, ds and dq checks and the row sums of the recomputed P."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = _kv_head(head, heads, group)
    offs_m = pid_m * BM + tl.arange(0, BM)
    cols = tl.arange(0, D)
    q = _tile(q_ptr + head * sq_n, offs_m, Sq, sq_s, D, UPCAST)
    do = _tile(do_ptr + head * sdo_n, offs_m, Sq, sdo_s, D, UPCAST)
    valid = offs_m < Sq
    lse = tl.load(lse_ptr + head * Sq + offs_m, mask=valid, other=0.0)
    delta = tl.load(delta_ptr + head * Sq + offs_m, mask=valid, other=0.0)
    dmag = tl.load(dmag_ptr + head * Sq + offs_m, mask=valid, other=0.0)
    dof = do.to(tl.float32)
    dq = tl.zeros((BM, D), tl.float32)
    dq_ref = tl.zeros((BM,), tl.float32)  # Σ_k dS_qk (K·1)_k
    dp_sum = tl.zeros((BM,), tl.float32)
    dp_ref = tl.zeros((BM,), tl.float32)  # dO_q·Σ_k V_k over the keys visited
    dp_sq = tl.zeros((BM,), tl.float32)
    ds_sum = tl.zeros((BM,), tl.float32)
    ds_abs = tl.zeros((BM,), tl.float32)
    p_sum = tl.zeros((BM,), tl.float32)
    hi = Sk
    if CAUSAL:
        hi = tl.minimum(Sk, (pid_m + 1) * BM + Sk - Sq)
    for start_n in range(0, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        k = _tile(k_ptr + kv_head * sk_n, offs_n, Sk, sk_s, D, UPCAST)
        v = _tile(v_ptr + kv_head * sv_n, offs_n, Sk, sv_s, D, UPCAST)
        p, dp, ds = _backward_tile(q, k, v, do, lse, delta, offs_m, offs_n, head, mask_ptr, sm_n, sm_q, Sq, Sk,
                                   scale, fault_head, fault_row, fault_col, fault_delta, fault_mask, CAUSAL,
                                   HAS_MASK, MODEL, STAGE)  # fmt: skip
        if CHECK:
            p_sum += tl.sum(p, axis=1)
            dp_sum += tl.sum(dp, axis=1)
            dp_sq += tl.sum(dp * dp, axis=1)
            dp_ref += tl.sum(dof * tl.sum(v.to(tl.float32), axis=0)[None, :], axis=1)
        ds_op = _operand(ds, DT, UPCAST)
        dq += tl.dot(ds_op, k)
        if CHECK:
            ds_sum += tl.sum(ds, axis=1)
            ds_abs += tl.sum(tl.abs(ds), axis=1)
            dq_ref += tl.sum(ds_op.to(tl.float32) * tl.sum(k.to(tl.float32), axis=1)[None, :], axis=1)
    if STAGE == 5:
        dq = _fault(dq, offs_m, cols, head, fault_head, fault_row, fault_col, fault_delta, fault_mask, MODEL)
    if CHECK:
        dp_raw = tl.where(valid, dp_sum - dp_ref, 0.0)
        ds_raw = tl.where(valid, ds_sum, 0.0)
        dq_raw = tl.where(valid, tl.sum(dq, axis=1) - dq_ref, 0.0)
        dp_diff = _normalized(dp_raw, dp_sq)
        ds_diff = tl.abs(ds_raw) / tl.maximum(U32 * ds_abs + u_out * dmag, TINY)
        ds_diff = tl.where(ds_abs == float("inf"), float("inf"), ds_diff)
        dq_diff = _normalized(dq_raw, tl.sum(dq * dq, axis=1))
        p_diff = tl.abs(p_sum - 1.0) / U32
        slot = check_ptr + (head * tl.num_programs(0) + pid_m) * 7
        tl.store(slot, _block_max(dp_diff, valid))
        tl.store(slot + 1, _block_max(ds_diff, valid))
        tl.store(slot + 2, _block_max(dq_diff, valid))
        tl.store(slot + 3, _block_max(p_diff, valid))
        tl.store(slot + 4, tl.sum(dp_raw * dp_raw, axis=0))
        tl.store(slot + 5, tl.sum(ds_raw * ds_raw, axis=0))
        tl.store(slot + 6, tl.sum(dq_raw * dq_raw, axis=0))
    tl.store(dq_ptr + head * Sq * D + offs_m[:, None] * D + cols[None, :], dq * scale, mask=valid[:, None])


# -- host side --------------------------------------------------------------------------------------
import dataclasses  # noqa: E402

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_STAGE_IDS = {stage: i for i, stage in enumerate(("qk", "softmax", "pv", "dp", "ds", "dq", "dk"))}
assert set(_STAGE_IDS) == set(STAGES)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Blocks and pipeline of the attention kernels (a block is also the unit a row's sums run over,
    so a replay must use the same: fixed per head dimension, never autotuned)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


# Not yet tuned on the GPU (benchmarks/attention.py will choose); the interpreter runs one program at
# a time on the CPU, so its blocks are small.
GPU_CONFIG = AttentionConfig()
INTERPRETER_CONFIG = AttentionConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def config_for(head_dim: int) -> AttentionConfig:
    return INTERPRETER_CONFIG if INTERPRET else GPU_CONFIG


def supported(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why these flattened operands ([N, S, D]) cannot run here (None: they can)."""
    d = q.shape[-1]
    if q.dtype not in _TL_DTYPES or (q.is_cuda and q.dtype == torch.float32):
        return f"{q.dtype} operands (the GPU kernels take bf16/fp16)"
    if d < 16 or d > 256 or d & (d - 1):
        return f"head dimension {d} (a power of two from 16 to 256)"
    return None


def _fault_args(fault: HeadFault | None, backward: bool, sq: int, sk: int, d: int) -> tuple[int, int, tuple]:
    """(MODEL, STAGE, runtime args) of a fault for one pass (a stage the pass does not run: none).
    The element is chosen in the stage's matrix as on the reference path: scores, probabilities,
    dP and dS [Sq, Sk]; O's accumulator and dQ [Sq, D]; dV's and dK's [Sk, D]."""
    none = (0, NO_STAGE, (-1, -1, -1, 0.0, 0))
    if fault is None or (not backward and fault.stage in ("dp", "ds", "dq", "dk")):
        return none
    shape = {"qk": (sq, sk), "softmax": (sq, sk), "dp": (sq, sk), "ds": (sq, sk), "dq": (sq, d), "dk": (sk, d),
             "pv": (sk, d) if backward else (sq, d)}[fault.stage]  # fmt: skip
    corruption = fault.fault
    model = 1 if corruption.model == "perturb" else 2
    mask = 0 if model == 1 else (-(2**31) if corruption.bit == 31 else 1 << corruption.bit)
    delta = float(corruption.delta) if model == 1 else 0.0  # a device scalar: fault-injection runs only
    return model, _STAGE_IDS[fault.stage], (fault.head, *corruption.element(*shape), delta, mask)


def _reference_only(drop: torch.Tensor | None) -> None:
    if drop is not None:
        raise ValueError("the Triton attention kernels take no dropout yet (the reference kernels do)")


def _mask_args(mask: torch.Tensor | None, q: torch.Tensor) -> tuple:
    """(pointer, head stride, row stride) of an additive mask [N or 1, Sq, Sk] (a stand-in when none)."""
    if mask is None:
        return (q, 0, 0)
    if mask.dtype != torch.float32 or mask.dim() != 3 or mask.stride(-1) != 1:
        raise ValueError("the Triton attention kernels take an fp32 mask [N or 1, Sq, Sk] with unit key stride")
    return (mask, mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(1))


def _grouping(n: int, kv_heads_total: int, heads: int | None) -> tuple[int, int]:
    """(query heads per batch, query heads per key/value head) for N flattened query heads."""
    if heads is None:
        if kv_heads_total != n:
            raise ValueError(f"k and v hold {kv_heads_total} heads for {n} query heads: pass `heads` (per batch)")
        return n, 1
    batches, rest = divmod(n, heads)
    kv_heads, uneven = divmod(kv_heads_total, max(batches, 1))
    if rest or uneven or kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{n} query heads in batches of {heads} do not group over {kv_heads_total} key/value heads")
    return heads, heads // kv_heads


def _strides(t: torch.Tensor) -> tuple[int, int]:
    if t.stride(-1) != 1:
        raise ValueError("attention operands need a unit stride in the head dimension")
    return t.stride(0), t.stride(1)


def forward(q, k, v, scale: float, causal: bool, fault: HeadFault | None = None, mask: torch.Tensor | None = None,
            drop: torch.Tensor | None = None, *, heads: int | None = None, check: bool = True) -> Forward:  # fmt: skip
    """The checked forward of flattened heads (see the module docstring): out [N, Sq, D] (q's dtype),
    lse [N, Sq] fp32, values [N] fp64 and raw_l2 [N] fp64 on the device.

    k and v hold N or fewer heads: with `heads` query heads per batch and k [N·Hkv/heads, Sk, D], query
    head h of a batch reads key/value head h // (heads / Hkv) in place (GQA without an expanded copy).
    `check=False` runs the same kernel without its checks (values empty: benchmarks). `mask`: an
    additive fp32 mask [N or 1, Sq, Sk] (not with `causal`); no `drop` yet (the op runs such calls on
    the reference kernels)."""
    _reference_only(drop)
    n, sq, d = q.shape
    heads, group = _grouping(n, k.shape[0], heads)
    sk = k.shape[1]
    cfg = config_for(d)
    q_blocks = triton.cdiv(sq, cfg.block_m)
    out = torch.empty_like(q)
    lse = torch.empty(n, sq, dtype=torch.float32, device=q.device)
    checks = torch.empty(n, q_blocks, FWD_CHECKS, dtype=torch.float32, device=q.device)
    model, stage, fargs = _fault_args(fault, False, sq, sk, d)
    attention_fwd_kernel[(q_blocks, n)](
        q, k, v, out, lse, checks, *_mask_args(mask, q), *_strides(q), *_strides(k), *_strides(v), *_strides(out),
        sq, sk, float(scale), heads, group, *fargs,
        CAUSAL=causal, HAS_MASK=mask is not None, CHECK=check, MODEL=model, STAGE=stage, DT=_TL_DTYPES[q.dtype],
        UPCAST=INTERPRET,
        D=d, BM=cfg.block_m, BN=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if not check:
        return Forward(out, lse, torch.empty(0), torch.empty(0))
    return Forward(out, lse, checks[..., 0].double().amax(dim=1), checks[..., 1].double().sum(dim=1).sqrt())


def backward(q, k, v, out, lse, dout, scale: float, causal: bool, fault: HeadFault | None = None,
             mask: torch.Tensor | None = None, drop: torch.Tensor | None = None, *, heads: int | None = None,
             check: bool = True) -> Backward:  # fmt: skip
    """The checked backward of flattened heads: dq, dk, dv fp32 (per query head: a GQA group's sum
    is the caller's), values [len(BACKWARD_CHECKS), N] fp64 and raw_l2 [N] (‖1ᵀdV − (1ᵀPᵀ)·dO‖₂) on
    the device. `heads`, `mask` and `check` as for `forward`."""
    _reference_only(drop)
    n, sq, d = q.shape
    heads, group = _grouping(n, k.shape[0], heads)
    sk = k.shape[1]
    cfg = config_for(d)
    do = dout if dout.stride(-1) == 1 else dout.contiguous()
    prod = do.float() * out.float()
    delta = prod.sum(dim=-1).contiguous()  # D = rowsum(dO ⊙ O) [N, Sq]
    dmag = prod.abs().sum(dim=-1).contiguous()
    dq = torch.empty(n, sq, d, dtype=torch.float32, device=q.device)
    dk = torch.empty(n, sk, d, dtype=torch.float32, device=q.device)
    dv = torch.empty(n, sk, d, dtype=torch.float32, device=q.device)  # per query head
    q_blocks, k_blocks = triton.cdiv(sq, cfg.block_m), triton.cdiv(sk, cfg.block_n)
    kv_check = torch.empty(n, k_blocks, KV_CHECKS, dtype=torch.float32, device=q.device)
    q_check = torch.empty(n, q_blocks, Q_CHECKS, dtype=torch.float32, device=q.device)
    model, stage, fargs = _fault_args(fault, True, sq, sk, d)
    common = dict(CAUSAL=causal, HAS_MASK=mask is not None, CHECK=check, MODEL=model, STAGE=stage,
                  DT=_TL_DTYPES[q.dtype], UPCAST=INTERPRET, D=d, BM=cfg.block_m, BN=cfg.block_n,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)  # fmt: skip
    operands = (*_mask_args(mask, q), *_strides(q), *_strides(k), *_strides(v), *_strides(do))
    attention_bwd_kv_kernel[(k_blocks, n)](
        q, k, v, do, lse, delta, dk, dv, kv_check, *operands, sq, sk, float(scale), heads, group, *fargs, **common
    )  # fmt: skip
    u_out = torch.finfo(out.dtype).eps / 2
    attention_bwd_q_kernel[(q_blocks, n)](
        q, k, v, do, lse, delta, dmag, dq, q_check, *operands, sq, sk, float(scale), u_out, heads, group, *fargs,
        **common,
    )  # fmt: skip
    if not check:
        return Backward(dq, dk, dv, torch.empty(0), torch.empty(0))
    kv, qc = kv_check.double(), q_check.double()
    values = torch.stack([
        torch.maximum(kv[..., 0].amax(dim=1), qc[..., 3].amax(dim=1)),  # dv: dV's columns and P's rows
        qc[..., 0].amax(dim=1),
        qc[..., 1].amax(dim=1),
        qc[..., 2].amax(dim=1),
        kv[..., 1].amax(dim=1),
    ])  # fmt: skip
    assert values.shape[0] == len(BACKWARD_CHECKS)
    l2 = torch.stack([kv[..., 2].sum(dim=1), *(qc[..., i].sum(dim=1) for i in (4, 5, 6)), kv[..., 3].sum(dim=1)]).sqrt()
    return Backward(dq, dk, dv, values, l2[0], check_l2=l2)


def softmax_row_bound(keys: int) -> float:
    """The largest normalized deviation of a correct P row sum from 1: (Sk + 3)·u, in units of u."""
    return keys + 3.0
