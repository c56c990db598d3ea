"""Checked FlashAttention in Triton: forward and backward with their invariants from the fp32 accumulators.

Heads are flattened as on the reference path (kernels/attention_reference.py): q [N, Sq, D], k and v
[N or fewer, Sk, D] (GQA read in place), scale c, optional causal mask with the queries aligned to
the end of the keys (SDPA's convention) or an additive mask. Every program owns one block of rows of
one head and reduces its K dimension in one fixed order: no atomics, so a call replays bit for bit.

Speed. Scores are kept in base 2 (c·log₂e folded into one multiply, `exp2`); a causal program runs its
key (or query) blocks in two loops, the blocks every row sees without any mask and the diagonal band
with it; operands whose lengths are block multiples (`EVEN`) load without bounds masks; the dK/dV
kernel works on transposed tiles (Sᵀ = K·Qᵀ) so that no register tile is transposed. A second forward,
`attention_fwd_ws_kernel` (`Blocks.warp_specialize`), takes K and V by TMA from a producer warp group
and splits each block's rows over two consumer warp groups (Hopper; docs/attention.md).

Checks. Each reference side is a narrow MMA on the tensor cores against a side operand W [rows, 16]
made once per call by `attention_sums_kernel`: columns 0–2 the hi/mid/lo parts of x·1 (three parts in
the operand dtype carry fp32's 24 bits), column 3 ‖x‖² (times 2⁻⁸ for fp16, whose range is short).
The MMA multiplies the same rounded operand the main MMA multiplies and accumulates in fp32, so the
row sum of an accumulator and its reference side differ by rounding only. No per-tile reduction
across threads; what is left per tile is a row sum or two in the dQ kernel.

    forward   O_acc·1 against p·(V·1) (W of V), rescaled with the accumulator as the running maximum
              moves; scale u·sqrt(Σ_k p_qk ‖V_k‖²) (≥ the GEMM check's sqrt(Σ p² ‖V‖²), p ≤ 1).
    backward  D = rowsum(dO ⊙ O) in the side pass of dO, then two kernels, dQ's first (it also writes W
              of Q, from the block of Q it loads anyway, for the dK/dV kernel):
      dk/dv   one program per (key block, head), looping over query blocks: dV = Pᵀ·dO and
              dK = c·dSᵀ·q. Checks: dv — dV's row sums against Pᵀ·(dO·1), scale
              u·sqrt(Σ_q P_qk ‖dO_q‖²); dk — dK's row sums against dSᵀ·(Q·1), scale u·‖dK_k‖.
      dq      one program per (query block, head), looping over key blocks: dP = dO·Vᵀ,
              dS = P ⊙ (dP − D), dQ = c·dS·k. Checks: dp — dP's row sums against dO_q·Σ_k V_k
              (column sums of V per key block, summed over the blocks visited), scale
              u·‖dO_q‖·sqrt(Σ_k ‖V_k‖²) (Cauchy–Schwarz bound of sqrt(Σ_k dP²)); ds — the
              softmax-backward identity Σ_k dS_qk = 0, scale u·(‖dO_q‖·max_k ‖V_k‖ + |D_q|) +
              u_O·Σ_d |dO_qd O_qd| (a bound of u·Σ_k |dS_qk| plus the rounding of O, from which D is
              taken); dq — dQ's row sums against dS·(K·1), scale u·‖dQ_q‖; and the rows of the
              recomputed P, which sum to 1 within (Sk + 3)·u when the scores and the saved lse agree
              (reported in units of that bound, so that in `dv` they never hide dV's row check).
    Every scale has the floor u·Σ_d |acc_qd| (the rounding of the check's own sum over the row), so
    an underflowed fp16 ‖x‖² never makes a clean row look wrong.
    The backward values keep the reference path's five checks (`BACKWARD_CHECKS`): `dv` is the
    larger of dV's row check and P's row sums. A fault in dP moves Σ_k dS_qk by P_qk times itself —
    exactly the part of it that reaches dQ and dK — so `ds` sees every dP fault that changes a gradient.

Each program writes the largest normalized difference of its block per check and the Σ of its squared
raw differences (their root over a head is the AEGIS unit of fault size); a finish kernel reduces the
blocks to one value per head in fp64, in block order — nothing reads the host. Under TRITON_INTERPRET=1 operands
are upcast after loading (bf16 arithmetic is wrong in the interpreter), as in kernels/triton_gemm.py.

Dropout (`DropoutDraw`): each kernel draws the keep mask of its tile from Philox, keyed by the call's
seed plus the head's index and offset by the element's (query, key) position, so the mask is never
stored and every kernel and replay draws the same. With P_d = P ⊙ keep/(1 − p): forward O = P_d·V
(its check against P_d·(V·1)), ℓ and the lse sum every p; dV = P_dᵀ·dO (its row check against
P_dᵀ·(dO·1)); dS = P ⊙ (dP ⊙ keep/(1 − p) − D), whose rows still sum to zero
(Σ_k P_d,qk dP_qk = dO_q·O_q = D_q); dP's check is taken before the mask; P's row sums are undropped.

Fault stages (constexpr STAGE, as `attention_reference.STAGES`): qk, softmax, pv (O's accumulator in
forward, dV's in backward), dp, ds, dq, dk — one element (head, row, col) perturbed or bit-flipped.
A score (`qk`) is faulted in base-2 units: a perturbation δ of the natural score is δ·log₂e.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from aegis_sdc.kernels.attention_reference import BACKWARD_CHECKS, STAGES, Backward, Forward, HeadFault
from aegis_sdc.kernels.grid import ceil_div
from aegis_sdc.kernels.triton_gemm import descriptor_scratch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
U32 = tl.constexpr(2.0**-24)
TINY = tl.constexpr(1e-30)
LOG2E = 1.4426950408889634
NO_STAGE = -1
FINISH_BLOCK = 64  # blocks a finish kernel reads at a time
SIDE = 16  # columns of a side operand W: hi, mid, lo of x·1, ‖x‖², zeros (an MMA needs 16)
# check columns of the per-block outputs
FWD_CHECKS = 2  # normalized max, Σ raw²
KV_CHECKS = 4  # dv, dk normalized maxima; dv, dk Σ raw²
Q_CHECKS = 7  # dp, ds, dq, P's row sums normalized maxima; dp, ds, dq Σ raw²


@triton.jit
def _fault(x, rows, cols, head, fault_head, fault_row, fault_col, fault_delta, fault_mask, MODEL: tl.constexpr):
    """x [R, C] with element (fault_row, fault_col) of head `fault_head` corrupted (MODEL 1: + delta,
    2: bits XOR mask); `rows`, `cols` are the tile's global indices (a transposed tile passes its
    keys as `rows` and the fault's column as `fault_row`)."""
    hit = (rows == fault_row)[:, None] & (cols == fault_col)[None, :] & (head == fault_head)
    if MODEL == 1:
        return tl.where(hit, x + fault_delta, x)
    flipped = (x.to(tl.int32, bitcast=True) ^ fault_mask).to(tl.float32, bitcast=True)
    return tl.where(hit, flipped, x)


@triton.jit
def _tile(ptr, rows, n_rows, stride, D: tl.constexpr, EVEN: tl.constexpr, UPCAST: tl.constexpr):
    """Rows `rows` [R] of a [rows, D] matrix (rows past n_rows are zero unless EVEN: none are)."""
    cols = tl.arange(0, D)
    if EVEN:
        t = tl.load(ptr + rows[:, None] * stride + cols[None, :])
    else:
        t = tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=(rows < n_rows)[:, None], other=0.0)
    return t.to(tl.float32) if UPCAST else t


@triton.jit
def _tile_t(ptr, rows, n_rows, stride, D: tl.constexpr, EVEN: tl.constexpr, UPCAST: tl.constexpr):
    """The transpose [D, R] of rows `rows` of a [rows, D] matrix, loaded as such (an MMA operand)."""
    cols = tl.arange(0, D)
    if EVEN:
        t = tl.load(ptr + rows[None, :] * stride + cols[:, None])
    else:
        t = tl.load(ptr + rows[None, :] * stride + cols[:, None], mask=(rows < n_rows)[None, :], other=0.0)
    return t.to(tl.float32) if UPCAST else t


@triton.jit
def _side(ptr, rows, n_rows, EVEN: tl.constexpr, UPCAST: tl.constexpr):
    """Rows `rows` of a side operand W [rows, SIDE] (see the module docstring)."""
    cols = tl.arange(0, 16)
    if EVEN:
        w = tl.load(ptr + rows[:, None] * 16 + cols[None, :])
    else:
        w = tl.load(ptr + rows[:, None] * 16 + cols[None, :], mask=(rows < n_rows)[:, None], other=0.0)
    return w.to(tl.float32) if UPCAST else w


@triton.jit
def _vector(ptr, rows, n_rows, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptr + rows)
    return tl.load(ptr + rows, mask=rows < n_rows, other=0.0)


@triton.jit
def _side_rows(x, sq_scale, DT: tl.constexpr):
    """(W's rows [R, SIDE] as fp32 values of DT, ‖x‖² [R]) of x [R, D] fp32: hi, mid, lo of x·1 and
    ‖x‖²·sq_scale (see the module docstring)."""
    total = tl.sum(x, axis=1)
    sq = tl.sum(x * x, axis=1)
    hi = total.to(DT).to(tl.float32)
    mid = (total - hi).to(DT).to(tl.float32)
    lo = (total - hi - mid).to(DT).to(tl.float32)
    c = tl.arange(0, 16)[None, :]
    w = tl.where(c == 0, hi[:, None], tl.where(c == 1, mid[:, None], tl.where(c == 2, lo[:, None], 0.0)))
    return tl.where(c == 3, (sq * sq_scale)[:, None], w), sq


@triton.jit
def _side_sums(acc_side):
    """(reference side, scale²) from a side accumulator [R, SIDE]: columns 0–2 summed, column 3."""
    cols = tl.arange(0, 16)[None, :]
    return tl.sum(tl.where(cols < 3, acc_side, 0.0), axis=1), tl.sum(tl.where(cols == 3, acc_side, 0.0), axis=1)


@triton.jit
def _at(head, heads, s_b, s_h):
    """The offset of flattened head `head` (batch-major, `heads` per batch) in a tensor with batch
    stride s_b and head stride s_h: [B, H, S, D] views are read in place, whatever their layout."""
    return (head // heads) * s_b + (head % heads) * s_h


@triton.jit
def _kv_head(head, heads, group):
    """The key/value head of flattened query head `head` (batch-major, `heads` per batch, `group`
    query heads per key/value head): GQA read in place, no expanded copy of K and V."""
    return (head // heads) * (heads // group) + (head % heads) // group


@triton.jit
def _normalized(raw, scale):
    """|raw| / (u·scale), a check's normalized difference; an infinite scale (a sum of squares that
    overflowed, |values| ≳ 10¹⁹) counts as non-finite (an infinite difference), as in
    kernels/gemm_evidence.py, and NaN as infinite (`_block_max`)."""
    diff = tl.abs(raw) / tl.maximum(U32 * scale, TINY)
    return tl.where(scale == float("inf"), float("inf"), diff)


@triton.jit
def _operand(x, DT: tl.constexpr, UPCAST: tl.constexpr):
    """x [R, C] fp32 rounded to the operand dtype for an MMA (upcast again under the interpreter)."""
    rounded = x.to(DT)
    return rounded.to(tl.float32) if UPCAST else rounded


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
def _no_key(lse2):
    """A saved log-sum-exp with −∞ (a query row an attn_mask leaves no key) as +∞, so that the
    backward's P = exp2(s − lse) is 0 there rather than NaN: the row's output and gradients are 0."""
    return tl.where(lse2 == float("-inf"), float("inf"), lse2)


@triton.jit
def _clamp(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def _key_range(pid_m, Sq, Sk, CAUSAL: tl.constexpr, EVEN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """(free, hi) for query block pid_m: it visits the keys [0, hi), and the key blocks below `free`
    are seen by every row of the block, so they need no mask (causal: the band from `free` on does;
    not EVEN: every block does, for the bounds)."""
    hi = Sk
    free = Sk
    if CAUSAL:
        hi = tl.minimum(Sk, (pid_m + 1) * BM + Sk - Sq)
        free = _clamp(tl.maximum(pid_m * BM + Sk - Sq + 1, 0) // BN * BN, 0, hi)
    if not EVEN:
        free = 0
    return free, hi


@triton.jit
def attention_sums_kernel(
    x_ptr, o_ptr, w_ptr, colsum_ptr, colsq_ptr, colmax_ptr, delta_ptr, dmag_ptr,
    sx_b, sx_h, sx_s, so_b, so_h, so_s, heads, S, sq_scale,
    WITH_COLS: tl.constexpr, WITH_O: tl.constexpr, DT: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One pass over rows [BLOCK] of head n of x [N, S, D]: the side operand W [N, S, SIDE] in the
    operand dtype; with WITH_COLS the block's column sums [N, blocks, D], Σ‖x‖² and max ‖x‖²
    [N, blocks] (fp32); with WITH_O (x = dO, o = O) D = Σ_d x·o and Σ_d |x·o| [N, S] (fp32)."""
    pid = tl.program_id(0)
    n = tl.program_id(1)
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    valid = rows < S
    cols = tl.arange(0, D)
    x_ptr += _at(n, heads, sx_b, sx_h)
    x = tl.load(x_ptr + rows[:, None] * sx_s + cols[None, :], mask=valid[:, None], other=0.0)
    x = x.to(tl.float32)
    w, sq = _side_rows(x, sq_scale, DT)
    tl.store(w_ptr + (n * S + rows[:, None]) * 16 + tl.arange(0, 16)[None, :], w.to(DT), mask=valid[:, None])
    if WITH_COLS:
        slot = n * tl.num_programs(0) + pid
        tl.store(colsum_ptr + slot * D + cols, tl.sum(x, axis=0))
        tl.store(colsq_ptr + slot, tl.sum(sq, axis=0))
        tl.store(colmax_ptr + slot, tl.max(sq, axis=0))
    if WITH_O:
        o_ptr += _at(n, heads, so_b, so_h)
        o = tl.load(o_ptr + rows[:, None] * so_s + cols[None, :], mask=valid[:, None], other=0.0)
        prod = x * o.to(tl.float32)
        tl.store(delta_ptr + n * S + rows, tl.sum(prod, axis=1), mask=valid)
        tl.store(dmag_ptr + n * S + rows, tl.sum(tl.abs(prod), axis=1), mask=valid)


@triton.jit
def _scores(q, k, offs_m, offs_n, head, mask_ptr, sm_q, Sq, Sk, scale2,
            fault_head, fault_row, fault_col, fault_delta, fault_mask,
            HAS_MASK: tl.constexpr, MODEL: tl.constexpr, STAGE: tl.constexpr):  # fmt: skip
    """The scores of one tile [BM, BN] in base 2: (c·q·kᵀ + mask)·log₂e (and a `qk` fault)."""
    s = tl.dot(q, tl.trans(k)) * scale2
    if HAS_MASK:
        inside = (offs_m < Sq)[:, None] & (offs_n < Sk)[None, :]
        bias = tl.load(mask_ptr + offs_m[:, None] * sm_q + offs_n[None, :], mask=inside, other=0.0)
        s += bias * 1.4426950408889634
    if STAGE == 0:
        s = _fault(s, offs_m, offs_n, head, fault_head, fault_row, fault_col, fault_delta, fault_mask, MODEL)
    return s


@triton.jit
def _keep_scale(seed, offs_m, offs_n, Sk, p_drop, keep_scale, TRANSPOSED: tl.constexpr):
    """Dropout's factor per element (query, key) of a tile: 1/(1 − p) where a Philox uniform keyed by
    the head's seed is ≥ p, else 0 — a function of the element alone, so the forward, both backward
    kernels and every replay draw the same mask whatever their blocks. [BM, BN], or [BN, BM]."""
    offs = offs_m[None, :] * Sk + offs_n[:, None] if TRANSPOSED else offs_m[:, None] * Sk + offs_n[None, :]
    return tl.where(tl.rand(seed, offs) >= p_drop, keep_scale, 0.0)


@triton.jit
def _head_seed(drop_ptr, head, DROPOUT: tl.constexpr):
    """The head's Philox seed: the call's seed plus the head's index in the call (`drop_ptr`: int64
    [seed, index of the first head]; a one-head replay of head h passes h)."""
    seed = 0
    if DROPOUT:
        seed = tl.load(drop_ptr) + tl.load(drop_ptr + 1) + head
    return seed


@triton.jit
def _fwd_step(acc, m_i, l_i, q, k, v, offs_m, offs_n, head, mask_ptr, sm_q, Sq, Sk, scale2,
              fault_head, fault_row, fault_col, fault_delta, fault_mask, seed, p_drop, keep_scale,
              DROPOUT: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
              MODEL: tl.constexpr, STAGE: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """One key block of the online softmax, k and v [BN, D] as the caller loaded them; MASKED applies
    the causal and bounds masks. Returns the MMA's operand p and the rescale α too: the caller's
    reference side multiplies the same p (after the P·V MMA, where the pointer loop loads W)."""
    s = _scores(q, k, offs_m, offs_n, head, mask_ptr, sm_q, Sq, Sk, scale2,
                fault_head, fault_row, fault_col, fault_delta, fault_mask, HAS_MASK, MODEL, STAGE)  # fmt: skip
    if MASKED:
        s = tl.where(_visible(offs_m, offs_n, Sq, Sk, CAUSAL), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = m_new
    if MASKED or HAS_MASK:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key seen yet
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    if STAGE == 1:
        p = _fault(p, offs_m, offs_n, head, fault_head, fault_row, fault_col, fault_delta, fault_mask, MODEL)
    l_i = l_i * alpha + tl.sum(p, axis=1)  # the normalizer sums every p, kept or dropped
    if DROPOUT:
        p = p * _keep_scale(seed, offs_m, offs_n, Sk, p_drop, keep_scale, False)
    p_op = _operand(p, DT, UPCAST)  # the MMA's operand; the reference side multiplies the same
    acc = tl.dot(p_op, v, acc * alpha[:, None])
    return acc, m_new, l_i, p_op, alpha


@triton.jit
def _fwd_block(acc, ref, m_i, l_i, q, k_ptr, v_ptr, w_ptr, sk_s, sv_s, offs_m, lo, hi, head,
               mask_ptr, sm_q, Sq, Sk, scale2, fault_head, fault_row, fault_col, fault_delta, fault_mask,
               seed, p_drop, keep_scale, DROPOUT: tl.constexpr,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, CHECK: tl.constexpr,
               MODEL: tl.constexpr, STAGE: tl.constexpr, EVEN: tl.constexpr, DT: tl.constexpr,
               UPCAST: tl.constexpr, D: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """The online softmax over key blocks [lo, hi), loaded through pointers."""
    for start_n in range(lo, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        k = _tile(k_ptr, offs_n, Sk, sk_s, D, EVEN, UPCAST)
        v = _tile(v_ptr, offs_n, Sk, sv_s, D, EVEN, UPCAST)
        acc, m_i, l_i, p_op, alpha = _fwd_step(acc, m_i, l_i, q, k, v, offs_m, offs_n, head, mask_ptr, sm_q, Sq, Sk,
                                               scale2, fault_head, fault_row, fault_col, fault_delta, fault_mask, seed,
                                               p_drop, keep_scale, DROPOUT, MASKED, CAUSAL, HAS_MASK, MODEL, STAGE,
                                               DT, UPCAST)  # fmt: skip
        if CHECK:
            ref = tl.dot(p_op, _side(w_ptr, offs_n, Sk, EVEN, UPCAST), ref * alpha[:, None])
    return acc, ref, m_i, l_i


@triton.jit
def _fwd_finish(acc, ref, m_i, l_i, head, heads, check_ptr, o_ptr, lse_ptr, so_b, so_h, so_s, Sq,
                sq_unscale, fault_head, fault_row, fault_col, fault_delta, fault_mask, CHECK: tl.constexpr,
                MODEL: tl.constexpr, STAGE: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                PER_ROW: tl.constexpr):  # fmt: skip
    """A query block's end: its check (the block's largest normalized difference and Σ raw² into
    check_ptr [N, q_blocks, 2]; PER_ROW: each row's into [N, Sq, 2]), the normalized output and the
    log-sum-exp (natural log). PER_ROW (the warp-specialized kernel) stores the output by TMA — by
    row index, its second consumer wrote the wrong rows on the H100; its per-row values (lse, check)
    still go by row index and still land 64 rows off there (GPU_FWD_WARP_SPECIALIZED: not used)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    if STAGE == 2:  # an error of `delta` in the normalized output is delta·ℓ in the accumulator
        acc = _fault(acc, rows, tl.arange(0, D), head, fault_head, fault_row, fault_col,
                     fault_delta * l_safe[:, None], fault_mask, MODEL)  # fmt: skip
    valid = rows < Sq
    if CHECK:
        side, ssq = _side_sums(ref)
        raw = tl.sum(acc, axis=1) - side
        diff = _normalized(raw, tl.maximum(tl.sqrt(ssq * sq_unscale), tl.sum(tl.abs(acc), axis=1)))
        raw = raw / l_safe  # in units of the normalized output, as the reference path reports it
        if PER_ROW:  # the warp-specialized kernel's consumers each own half of the rows: no sum across them
            slot = check_ptr + (head * Sq + rows) * 2
            tl.store(slot, tl.where(diff != diff, float("inf"), diff), mask=valid)
            tl.store(slot + 1, raw * raw, mask=valid)
        else:
            slot = check_ptr + (head * tl.num_programs(0) + tl.program_id(0)) * 2
            tl.store(slot, _block_max(diff, valid))
            tl.store(slot + 1, tl.sum(tl.where(valid, raw * raw, 0.0), axis=0))
    out = (acc / l_safe[:, None]).to(o_ptr.dtype.element_ty)
    o_ptr += _at(head, heads, so_b, so_h)
    if PER_ROW:
        o_desc = tl.make_tensor_descriptor(o_ptr, shape=[Sq, D], strides=[so_s, 1], block_shape=[BM, D])
        o_desc.store([tl.program_id(0) * BM, 0], out)  # rows past Sq are not written
    else:
        cols = tl.arange(0, D)
        tl.store(o_ptr + rows[:, None] * so_s + cols[None, :], out, mask=valid[:, None])
    tl.store(lse_ptr + head * Sq + rows, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, mask=valid)


# A fault's element and bit are runtime values, not specializations: an injection at a new element
# reuses the compiled variant (Triton would otherwise compile one per value class of each argument).
_FAULT_INTS = ["fault_head", "fault_row", "fault_col", "fault_mask"]


@triton.jit(do_not_specialize=_FAULT_INTS)
def attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, wv_ptr, o_ptr, lse_ptr, check_ptr,  # W of V [Nkv, Sk, SIDE]; check [N, q_blocks, 2]
    mask_ptr, sm_b, sm_h, sm_q,  # additive fp32 mask broadcast to [B, H, Sq, Sk] (HAS_MASK): its strides
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_s,
    Sq, Sk, scale, sq_unscale, heads, group,
    fault_head, fault_row, fault_col, fault_delta, fault_mask,
    drop_ptr, p_drop, keep_scale,  # dropout (DROPOUT): int64 [seed, first head]; p; 1/(1 − p)
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, CHECK: tl.constexpr, MODEL: tl.constexpr, STAGE: tl.constexpr,
    DROPOUT: tl.constexpr, EVEN: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = _kv_head(head, heads, group)
    offs_m = pid_m * BM + tl.arange(0, BM)
    q = _tile(q_ptr + _at(head, heads, sq_b, sq_h), offs_m, Sq, sq_s, D, EVEN, UPCAST)
    mask_ptr += _at(head, heads, sm_b, sm_h)
    scale2 = scale * 1.4426950408889634
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    ref = tl.zeros((BM, 16), tl.float32)  # p·W of V: p·(V·1) in three parts, p·‖V‖²
    k_ptr += _at(kv_head, heads // group, sk_b, sk_h)
    v_ptr += _at(kv_head, heads // group, sv_b, sv_h)
    wv_ptr += kv_head * Sk * 16
    seed = _head_seed(drop_ptr, head, DROPOUT)
    free, hi = _key_range(pid_m, Sq, Sk, CAUSAL, EVEN, BM, BN)
    if CAUSAL or not EVEN:
        acc, ref, m_i, l_i = _fwd_block(acc, ref, m_i, l_i, q, k_ptr, v_ptr, wv_ptr, sk_s, sv_s, offs_m, 0, free,
                                        head, mask_ptr, sm_q, Sq, Sk, scale2, fault_head, fault_row, fault_col,
                                        fault_delta, fault_mask, seed, p_drop, keep_scale, DROPOUT, False, CAUSAL,
                                        HAS_MASK, CHECK, MODEL, STAGE, EVEN, DT, UPCAST, D, BN)  # fmt: skip
        acc, ref, m_i, l_i = _fwd_block(acc, ref, m_i, l_i, q, k_ptr, v_ptr, wv_ptr, sk_s, sv_s, offs_m, free, hi,
                                        head, mask_ptr, sm_q, Sq, Sk, scale2, fault_head, fault_row, fault_col,
                                        fault_delta, fault_mask, seed, p_drop, keep_scale, DROPOUT, True, CAUSAL,
                                        HAS_MASK, CHECK, MODEL, STAGE, EVEN, DT, UPCAST, D, BN)  # fmt: skip
    else:
        acc, ref, m_i, l_i = _fwd_block(acc, ref, m_i, l_i, q, k_ptr, v_ptr, wv_ptr, sk_s, sv_s, offs_m, 0, hi,
                                        head, mask_ptr, sm_q, Sq, Sk, scale2, fault_head, fault_row, fault_col,
                                        fault_delta, fault_mask, seed, p_drop, keep_scale, DROPOUT, False, CAUSAL,
                                        HAS_MASK, CHECK, MODEL, STAGE, EVEN, DT, UPCAST, D, BN)  # fmt: skip
    _fwd_finish(acc, ref, m_i, l_i, head, heads, check_ptr, o_ptr, lse_ptr, so_b, so_h, so_s, Sq, sq_unscale,
                fault_head, fault_row, fault_col, fault_delta, fault_mask, CHECK, MODEL, STAGE, D, BM,
                False)  # fmt: skip


@triton.jit
def _up(x, UPCAST: tl.constexpr):
    return x.to(tl.float32) if UPCAST else x


@triton.jit(do_not_specialize=_FAULT_INTS)
def attention_fwd_ws_kernel(
    q_ptr, k_ptr, v_ptr, wv_ptr, o_ptr, lse_ptr, check_ptr,  # as attention_fwd_kernel's, check [N, Sq, 2]
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_s,
    Sq, Sk, scale, sq_unscale, heads, group,
    fault_head, fault_row, fault_col, fault_delta, fault_mask,
    CAUSAL: tl.constexpr, CHECK: tl.constexpr, MODEL: tl.constexpr, STAGE: tl.constexpr, EVEN: tl.constexpr,
    DT: tl.constexpr, UPCAST: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """The forward of `attention_fwd_kernel` (no attn_mask, no dropout) warp-specialized on Hopper:
    K, V and W of V come by TMA (descriptors built on the device) from a producer warp group, and
    two consumer warp groups each take half of the block's rows, so that one's softmax runs while
    the other's MMAs do (FlashAttention-3's overlap, left to the hardware's warp schedulers). Triton
    3.6 specializes one such loop per kernel, so a causal block visits its keys in one loop that
    masks every block (the split into unmasked blocks and the diagonal band needs two), and its check
    values are stored per row (a reduction over the rows would cross the consumers), reduced by the
    finish kernel as the other kernel's per block. Q, too, comes by TMA. Elsewhere (the interpreter,
    other GPUs) the same code runs unspecialized. Not used: wrong rows on the H100 under Triton 3.6
    (GPU_FWD_WARP_SPECIALIZED, docs/attention.md)."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = _kv_head(head, heads, group)
    offs_m = pid_m * BM + tl.arange(0, BM)
    q_desc = tl.make_tensor_descriptor(q_ptr + _at(head, heads, sq_b, sq_h), shape=[Sq, D], strides=[sq_s, 1],
                                       block_shape=[BM, D])  # fmt: skip
    q = _up(q_desc.load([pid_m * BM, 0]), UPCAST)  # (a pointer load here stops Triton 3.6 specializing)
    scale2 = scale * 1.4426950408889634
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    ref = tl.zeros((BM, 16), tl.float32)
    k_desc = tl.make_tensor_descriptor(k_ptr + _at(kv_head, heads // group, sk_b, sk_h), shape=[Sk, D],
                                       strides=[sk_s, 1], block_shape=[BN, D])  # fmt: skip
    v_desc = tl.make_tensor_descriptor(v_ptr + _at(kv_head, heads // group, sv_b, sv_h), shape=[Sk, D],
                                       strides=[sv_s, 1], block_shape=[BN, D])  # fmt: skip
    w_desc = tl.make_tensor_descriptor(wv_ptr + kv_head * Sk * 16, shape=[Sk, 16], strides=[16, 1],
                                       block_shape=[BN, 16])  # fmt: skip
    hi = _key_range(pid_m, Sq, Sk, CAUSAL, EVEN, BM, BN)[1]
    for start_n in tl.range(0, hi, BN, num_stages=STAGES, warp_specialize=True):
        offs_n = start_n + tl.arange(0, BN)
        k = _up(k_desc.load([start_n, 0]), UPCAST)  # rows past Sk read as zeros (and are masked)
        v = _up(v_desc.load([start_n, 0]), UPCAST)
        acc, m_i, l_i, p_op, alpha = _fwd_step(acc, m_i, l_i, q, k, v, offs_m, offs_n, head, q_ptr, 0, Sq, Sk, scale2,
                                               fault_head, fault_row, fault_col, fault_delta, fault_mask, 0, 0.0, 1.0,
                                               False, CAUSAL or not EVEN, CAUSAL, False, MODEL, STAGE, DT,
                                               UPCAST)  # fmt: skip
        if CHECK:
            ref = tl.dot(p_op, _up(w_desc.load([start_n, 0]), UPCAST), ref * alpha[:, None])
    _fwd_finish(acc, ref, m_i, l_i, head, heads, check_ptr, o_ptr, lse_ptr, so_b, so_h, so_s, Sq, sq_unscale,
                fault_head, fault_row, fault_col, fault_delta, fault_mask, CHECK, MODEL, STAGE, D, BM,
                True)  # fmt: skip


@triton.jit
def _kv_block(dk, dv, dk_ref, dv_ref, k, v, q_ptr, do_ptr, wq_ptr, wdo_ptr, lse_ptr, delta_ptr, sq_s, sdo_s,
              offs_n, lo, hi, head, mask_ptr, sm_q, Sq, Sk, scale2,
              fault_head, fault_row, fault_col, fault_delta, fault_mask,
              seed, p_drop, keep_scale, DROPOUT: tl.constexpr,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, CHECK: tl.constexpr,
              MODEL: tl.constexpr, STAGE: tl.constexpr, EVEN: tl.constexpr, DT: tl.constexpr,
              UPCAST: tl.constexpr, D: tl.constexpr, BM: tl.constexpr):  # fmt: skip
    """dK and dV of one key block over query blocks [lo, hi), on transposed tiles [BN, BM]."""
    for start_m in range(lo, hi, BM):
        offs_m = start_m + tl.arange(0, BM)
        q = _tile(q_ptr, offs_m, Sq, sq_s, D, EVEN, UPCAST)
        do_t = _tile_t(do_ptr, offs_m, Sq, sdo_s, D, EVEN, UPCAST)
        lse2 = _no_key(_vector(lse_ptr, offs_m, Sq, EVEN) * 1.4426950408889634)
        delta = _vector(delta_ptr, offs_m, Sq, EVEN)
        s_t = tl.dot(k, tl.trans(q)) * scale2  # Sᵀ [BN, BM]
        if HAS_MASK:
            inside = (offs_m < Sq)[None, :] & (offs_n < Sk)[:, None]
            bias = tl.load(mask_ptr + offs_m[None, :] * sm_q + offs_n[:, None], mask=inside, other=0.0)
            s_t += bias * 1.4426950408889634
        if STAGE == 0:
            s_t = _fault(s_t, offs_n, offs_m, head, fault_head, fault_col, fault_row, fault_delta, fault_mask, MODEL)
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if MASKED:
            p_t = tl.where(tl.trans(_visible(offs_m, offs_n, Sq, Sk, CAUSAL)), p_t, 0.0)
        if STAGE == 1:
            p_t = _fault(p_t, offs_n, offs_m, head, fault_head, fault_col, fault_row, fault_delta, fault_mask, MODEL)
        dp_t = tl.dot(v, do_t)
        if STAGE == 3:
            dp_t = _fault(dp_t, offs_n, offs_m, head, fault_head, fault_col, fault_row, fault_delta, fault_mask, MODEL)
        if DROPOUT:  # dV = P_dᵀ·dO and dS = P ⊙ (dP ⊙ keep/(1 − p) − D), with P_d = P ⊙ keep/(1 − p)
            factor = _keep_scale(seed, offs_m, offs_n, Sk, p_drop, keep_scale, True)
            ds_t = p_t * (dp_t * factor - delta[None, :])
            p_t = p_t * factor
        else:
            ds_t = p_t * (dp_t - delta[None, :])
        if STAGE == 4:
            ds_t = _fault(ds_t, offs_n, offs_m, head, fault_head, fault_col, fault_row, fault_delta, fault_mask, MODEL)
        p_op = _operand(p_t, DT, UPCAST)
        dv = tl.dot(p_op, tl.trans(do_t), dv)
        ds_op = _operand(ds_t, DT, UPCAST)
        dk = tl.dot(ds_op, q, dk)
        if CHECK:
            dv_ref = tl.dot(p_op, _side(wdo_ptr, offs_m, Sq, EVEN, UPCAST), dv_ref)
            dk_ref = tl.dot(ds_op, _side(wq_ptr, offs_m, Sq, EVEN, UPCAST), dk_ref)
    return dk, dv, dk_ref, dv_ref


@triton.jit(do_not_specialize=_FAULT_INTS)
def attention_bwd_kv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, wq_ptr, wdo_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, check_ptr,
    mask_ptr, sm_b, sm_h, sm_q,  # W of Q and of dO [N, Sq, SIDE]; check [N, k_blocks, KV_CHECKS]
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sdo_b, sdo_h, sdo_s,
    Sq, Sk, scale, sq_unscale, heads, group,
    fault_head, fault_row, fault_col, fault_delta, fault_mask,
    drop_ptr, p_drop, keep_scale,  # dropout, as in the forward
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, CHECK: tl.constexpr, MODEL: tl.constexpr, STAGE: tl.constexpr,
    DROPOUT: tl.constexpr, EVEN: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """dK and dV of one key block (dK unscaled until stored), with the dv and dk checks."""
    pid_n = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = _kv_head(head, heads, group)
    offs_n = pid_n * BN + tl.arange(0, BN)
    cols = tl.arange(0, D)
    k = _tile(k_ptr + _at(kv_head, heads // group, sk_b, sk_h), offs_n, Sk, sk_s, D, EVEN, UPCAST)
    v = _tile(v_ptr + _at(kv_head, heads // group, sv_b, sv_h), offs_n, Sk, sv_s, D, EVEN, UPCAST)
    dk = tl.zeros((BN, D), tl.float32)
    dv = tl.zeros((BN, D), tl.float32)
    dk_ref = tl.zeros((BN, 16), tl.float32)  # dSᵀ·W of Q: dSᵀ·(Q·1) in three parts
    dv_ref = tl.zeros((BN, 16), tl.float32)  # Pᵀ·W of dO: Pᵀ·(dO·1) in three parts, Pᵀ·‖dO‖²
    scale2 = scale * 1.4426950408889634
    q_ptr += _at(head, heads, sq_b, sq_h)
    do_ptr += _at(head, heads, sdo_b, sdo_h)
    mask_ptr += _at(head, heads, sm_b, sm_h)
    wq_ptr += head * Sq * 16
    wdo_ptr += head * Sq * 16
    lse_ptr += head * Sq
    delta_ptr += head * Sq
    seed = _head_seed(drop_ptr, head, DROPOUT)
    lo = 0
    free = 0  # query blocks from `free` on see every key of the block (EVEN only)
    if CAUSAL:
        lo = tl.maximum(0, pid_n * BN - (Sk - Sq)) // BM * BM
        free = _clamp(tl.cdiv(tl.maximum(pid_n * BN + BN - 1 - (Sk - Sq), 0), BM) * BM, lo, Sq)
    if not EVEN:
        free = Sq
    if CAUSAL or not EVEN:
        dk, dv, dk_ref, dv_ref = _kv_block(
            dk, dv, dk_ref, dv_ref, k, v, q_ptr, do_ptr, wq_ptr, wdo_ptr, lse_ptr, delta_ptr, sq_s, sdo_s, offs_n,
            lo, free, head, mask_ptr, sm_q, Sq, Sk, scale2, fault_head, fault_row, fault_col, fault_delta,
            fault_mask, seed, p_drop, keep_scale, DROPOUT, True, CAUSAL, HAS_MASK, CHECK, MODEL, STAGE, EVEN, DT,
            UPCAST, D, BM)  # fmt: skip
    dk, dv, dk_ref, dv_ref = _kv_block(
        dk, dv, dk_ref, dv_ref, k, v, q_ptr, do_ptr, wq_ptr, wdo_ptr, lse_ptr, delta_ptr, sq_s, sdo_s, offs_n,
        free, Sq, head, mask_ptr, sm_q, Sq, Sk, scale2, fault_head, fault_row, fault_col, fault_delta,
        fault_mask, seed, p_drop, keep_scale, DROPOUT, False, CAUSAL, HAS_MASK, CHECK, MODEL, STAGE, EVEN, DT,
        UPCAST, D, BM)  # fmt: skip
    if STAGE == 2:
        dv = _fault(dv, offs_n, cols, head, fault_head, fault_row, fault_col, fault_delta, fault_mask, MODEL)
    if STAGE == 6:
        dk = _fault(dk, offs_n, cols, head, fault_head, fault_row, fault_col, fault_delta, fault_mask, MODEL)
    valid = offs_n < Sk
    if CHECK:
        dv_side, dv_ssq = _side_sums(dv_ref)
        dv_raw = tl.where(valid, tl.sum(dv, axis=1) - dv_side, 0.0)
        dv_diff = _normalized(dv_raw, tl.maximum(tl.sqrt(dv_ssq * sq_unscale), tl.sum(tl.abs(dv), axis=1)))
        dk_side, _ = _side_sums(dk_ref)
        dk_raw = tl.where(valid, tl.sum(dk, axis=1) - dk_side, 0.0)
        dk_diff = _normalized(dk_raw, tl.maximum(tl.sqrt(tl.sum(dk * dk, axis=1)), tl.sum(tl.abs(dk), axis=1)))
        slot = check_ptr + (head * tl.num_programs(0) + pid_n) * 4
        tl.store(slot, _block_max(dv_diff, valid))
        tl.store(slot + 1, _block_max(dk_diff, valid))
        tl.store(slot + 2, tl.sum(dv_raw * dv_raw, axis=0))
        tl.store(slot + 3, tl.sum(dk_raw * dk_raw, axis=0))
    out = head * Sk * D + offs_n[:, None] * D + cols[None, :]
    tl.store(dv_ptr + out, dv, mask=valid[:, None])
    tl.store(dk_ptr + out, dk * scale, mask=valid[:, None])


@triton.jit
def _q_block(dq, dq_ref, dp_sum, ds_sum, p_sum, q, do, lse2, delta, k_ptr, v_ptr, wk_ptr, sk_s, sv_s, offs_m,
             lo, hi, head, mask_ptr, sm_q, Sq, Sk, scale2,
             fault_head, fault_row, fault_col, fault_delta, fault_mask,
             seed, p_drop, keep_scale, DROPOUT: tl.constexpr,
             MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, CHECK: tl.constexpr,
             MODEL: tl.constexpr, STAGE: tl.constexpr, EVEN: tl.constexpr, DT: tl.constexpr,
             UPCAST: tl.constexpr, D: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """dQ of one query block over key blocks [lo, hi), with the row sums of dP, dS and P."""
    for start_n in range(lo, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        k = _tile(k_ptr, offs_n, Sk, sk_s, D, EVEN, UPCAST)
        v = _tile(v_ptr, offs_n, Sk, sv_s, D, EVEN, UPCAST)
        s = _scores(q, k, offs_m, offs_n, head, mask_ptr, sm_q, Sq, Sk, scale2,
                    fault_head, fault_row, fault_col, fault_delta, fault_mask, HAS_MASK, MODEL, STAGE)  # fmt: skip
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            p = tl.where(_visible(offs_m, offs_n, Sq, Sk, CAUSAL), p, 0.0)
        if STAGE == 1:
            p = _fault(p, offs_m, offs_n, head, fault_head, fault_row, fault_col, fault_delta, fault_mask, MODEL)
        dp = tl.dot(do, tl.trans(v))
        if STAGE == 3:
            dp = _fault(dp, offs_m, offs_n, head, fault_head, fault_row, fault_col, fault_delta, fault_mask, MODEL)
        if DROPOUT:  # dP itself (its check) is taken before the mask
            ds = p * (dp * _keep_scale(seed, offs_m, offs_n, Sk, p_drop, keep_scale, False) - delta[:, None])
        else:
            ds = p * (dp - delta[:, None])
        if STAGE == 4:
            ds = _fault(ds, offs_m, offs_n, head, fault_head, fault_row, fault_col, fault_delta, fault_mask, MODEL)
        ds_op = _operand(ds, DT, UPCAST)
        dq = tl.dot(ds_op, k, dq)
        if CHECK:
            dq_ref = tl.dot(ds_op, _side(wk_ptr, offs_n, Sk, EVEN, UPCAST), dq_ref)
            dp_sum += tl.sum(dp, axis=1)
            ds_sum += tl.sum(ds, axis=1)
            p_sum += tl.sum(p, axis=1)
    return dq, dq_ref, dp_sum, ds_sum, p_sum


@triton.jit(do_not_specialize=_FAULT_INTS)
def attention_bwd_q_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, wk_ptr, vcols_ptr, vsq_ptr, vmax_ptr, lse_ptr, delta_ptr, dmag_ptr, dq_ptr,
    check_ptr,  # W of K [Nkv, Sk, SIDE]; per key block of V: column sums [Nkv, blocks, D], Σ and max of ‖V_k‖²
    wq_ptr,  # [Nkv, blocks] (blocks of BN keys); check [N, q_blocks, Q_CHECKS]; W of Q [N, Sq, SIDE] (written)
    mask_ptr, sm_b, sm_h, sm_q,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sdo_b, sdo_h, sdo_s,
    Sq, Sk, scale, u_out, sq_scale, heads, group,
    fault_head, fault_row, fault_col, fault_delta, fault_mask,
    drop_ptr, p_drop, keep_scale,  # dropout, as in the forward
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, CHECK: tl.constexpr, MODEL: tl.constexpr, STAGE: tl.constexpr,
    DROPOUT: tl.constexpr, EVEN: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """dQ of one query block, with the dp, ds and dq checks and the row sums of the recomputed P; with
    CHECK also W of Q for the dK/dV kernel, which runs after it (its block of Q is loaded here anyway:
    no pass over Q of its own)."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = _kv_head(head, heads, group)
    offs_m = pid_m * BM + tl.arange(0, BM)
    cols = tl.arange(0, D)
    q = _tile(q_ptr + _at(head, heads, sq_b, sq_h), offs_m, Sq, sq_s, D, EVEN, UPCAST)
    do = _tile(do_ptr + _at(head, heads, sdo_b, sdo_h), offs_m, Sq, sdo_s, D, EVEN, UPCAST)
    mask_ptr += _at(head, heads, sm_b, sm_h)
    valid = offs_m < Sq
    lse2 = _no_key(tl.load(lse_ptr + head * Sq + offs_m, mask=valid, other=0.0) * 1.4426950408889634)
    delta = tl.load(delta_ptr + head * Sq + offs_m, mask=valid, other=0.0)
    scale2 = scale * 1.4426950408889634
    dq = tl.zeros((BM, D), tl.float32)
    dq_ref = tl.zeros((BM, 16), tl.float32)  # dS·W of K: dS·(K·1) in three parts
    dp_sum = tl.zeros((BM,), tl.float32)
    ds_sum = tl.zeros((BM,), tl.float32)
    p_sum = tl.zeros((BM,), tl.float32)
    k_ptr += _at(kv_head, heads // group, sk_b, sk_h)
    v_ptr += _at(kv_head, heads // group, sv_b, sv_h)
    wk_ptr += kv_head * Sk * 16
    seed = _head_seed(drop_ptr, head, DROPOUT)
    free, hi = _key_range(pid_m, Sq, Sk, CAUSAL, EVEN, BM, BN)
    if CHECK:
        w_q, _ = _side_rows(q.to(tl.float32), sq_scale, DT)
        tl.store(wq_ptr + (head * Sq + offs_m[:, None]) * 16 + tl.arange(0, 16)[None, :], w_q.to(DT),
                 mask=valid[:, None])  # fmt: skip
        # dP's reference and the dp and ds scales, taken before the loop from dO [BM, D] and V's
        # per-block sums over the key blocks the loops will visit (whole blocks: dP is not masked),
        # summed in block order: after the loop only [BM] vectors are left of them, so dO's fp32 copy
        # does not live across the loop (taken after it, the kernel spilled twice as much in its loops:
        # results/attention_registers.json)
        dof = do.to(tl.float32)
        vcols = tl.zeros((D,), tl.float32)
        vsq = 0.0
        vmax = 0.0
        block_row = kv_head * tl.cdiv(Sk, BN)
        for b in range(0, tl.cdiv(hi, BN)):
            vcols += tl.load(vcols_ptr + (block_row + b) * D + cols)
            vsq += tl.load(vsq_ptr + block_row + b)
            vmax = tl.maximum(vmax, tl.load(vmax_ptr + block_row + b))
        dp_ref = tl.sum(dof * vcols[None, :], axis=1)  # dO_q·Σ_k V_k
        do_norm = tl.sqrt(tl.sum(dof * dof, axis=1))
        dp_scale = do_norm * tl.sqrt(vsq)
        ds_scale = do_norm * tl.sqrt(vmax) * keep_scale  # under dropout each dP term enters dS times 1/(1 − p)
    if CAUSAL or not EVEN:
        dq, dq_ref, dp_sum, ds_sum, p_sum = _q_block(
            dq, dq_ref, dp_sum, ds_sum, p_sum, q, do, lse2, delta, k_ptr, v_ptr, wk_ptr, sk_s, sv_s, offs_m, 0, free,
            head, mask_ptr, sm_q, Sq, Sk, scale2, fault_head, fault_row, fault_col, fault_delta, fault_mask,
            seed, p_drop, keep_scale, DROPOUT, False, CAUSAL, HAS_MASK, CHECK, MODEL, STAGE, EVEN, DT, UPCAST, D,
            BN)  # fmt: skip
        dq, dq_ref, dp_sum, ds_sum, p_sum = _q_block(
            dq, dq_ref, dp_sum, ds_sum, p_sum, q, do, lse2, delta, k_ptr, v_ptr, wk_ptr, sk_s, sv_s, offs_m, free, hi,
            head, mask_ptr, sm_q, Sq, Sk, scale2, fault_head, fault_row, fault_col, fault_delta, fault_mask,
            seed, p_drop, keep_scale, DROPOUT, True, CAUSAL, HAS_MASK, CHECK, MODEL, STAGE, EVEN, DT, UPCAST, D,
            BN)  # fmt: skip
    else:
        dq, dq_ref, dp_sum, ds_sum, p_sum = _q_block(
            dq, dq_ref, dp_sum, ds_sum, p_sum, q, do, lse2, delta, k_ptr, v_ptr, wk_ptr, sk_s, sv_s, offs_m, 0, hi,
            head, mask_ptr, sm_q, Sq, Sk, scale2, fault_head, fault_row, fault_col, fault_delta, fault_mask,
            seed, p_drop, keep_scale, DROPOUT, False, CAUSAL, HAS_MASK, CHECK, MODEL, STAGE, EVEN, DT, UPCAST, D,
            BN)  # fmt: skip
    if STAGE == 5:
        dq = _fault(dq, offs_m, cols, head, fault_head, fault_row, fault_col, fault_delta, fault_mask, MODEL)
    if CHECK:
        dp_raw = tl.where(valid, dp_sum - dp_ref, 0.0)
        dp_diff = _normalized(dp_raw, tl.maximum(dp_scale, tl.abs(dp_sum)))
        dmag = tl.load(dmag_ptr + head * Sq + offs_m, mask=valid, other=0.0)
        ds_raw = tl.where(valid, ds_sum, 0.0)
        ds_diff = _normalized(ds_raw, ds_scale + tl.abs(delta) + (u_out / U32) * dmag)
        dq_side, _ = _side_sums(dq_ref)
        dq_raw = tl.where(valid, tl.sum(dq, axis=1) - dq_side, 0.0)
        dq_diff = _normalized(dq_raw, tl.maximum(tl.sqrt(tl.sum(dq * dq, axis=1)), tl.sum(tl.abs(dq), axis=1)))
        p_diff = tl.abs(p_sum - 1.0) / (U32 * (Sk + 3.0))  # in units of its bound: at most 1 when correct
        p_diff = tl.where(lse2 == float("inf"), 0.0, p_diff)  # a row with no key has no P to sum
        slot = check_ptr + (head * tl.num_programs(0) + pid_m) * 7
        tl.store(slot, _block_max(dp_diff, valid))
        tl.store(slot + 1, _block_max(ds_diff, valid))
        tl.store(slot + 2, _block_max(dq_diff, valid))
        tl.store(slot + 3, _block_max(p_diff, valid))
        tl.store(slot + 4, tl.sum(dp_raw * dp_raw, axis=0))
        tl.store(slot + 5, tl.sum(ds_raw * ds_raw, axis=0))
        tl.store(slot + 6, tl.sum(dq_raw * dq_raw, axis=0))
    tl.store(dq_ptr + head * Sq * D + offs_m[:, None] * D + cols[None, :], dq * scale, mask=valid[:, None])


@triton.jit
def attention_fwd_finish_kernel(check_ptr, values_ptr, l2_ptr, blocks, BLOCK: tl.constexpr):
    """Per head: the largest normalized difference over its query blocks and the root of the Σ of
    squared raw differences (fp64), from check [N, blocks, FWD_CHECKS]: one launch, no torch epilogue."""
    head = tl.program_id(0)
    top = tl.zeros((BLOCK,), tl.float32)
    ssq = tl.zeros((BLOCK,), tl.float64)
    for start in range(0, blocks, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        slot = check_ptr + (head * blocks + offs) * 2
        top = tl.maximum(top, tl.load(slot, mask=offs < blocks, other=0.0))
        ssq += tl.load(slot + 1, mask=offs < blocks, other=0.0).to(tl.float64)
    tl.store(values_ptr + head, tl.max(top, axis=0).to(tl.float64))
    tl.store(l2_ptr + head, tl.sqrt(tl.sum(ssq, axis=0)))


@triton.jit
def _column_max(ptr, head, blocks, width, col, BLOCK: tl.constexpr):
    top = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, blocks, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        top = tl.maximum(top, tl.load(ptr + (head * blocks + offs) * width + col, mask=offs < blocks, other=0.0))
    return tl.max(top, axis=0).to(tl.float64)


@triton.jit
def _column_root(ptr, head, blocks, width, col, BLOCK: tl.constexpr):
    total = tl.zeros((BLOCK,), tl.float64)
    for start in range(0, blocks, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        total += tl.load(ptr + (head * blocks + offs) * width + col, mask=offs < blocks, other=0.0).to(tl.float64)
    return tl.sqrt(tl.sum(total, axis=0))


@triton.jit
def attention_bwd_finish_kernel(kv_ptr, q_ptr, values_ptr, l2_ptr, N, k_blocks, q_blocks, BLOCK: tl.constexpr):
    """Per head, from kv_check [N, k_blocks, KV_CHECKS] and q_check [N, q_blocks, Q_CHECKS]: values
    [BACKWARD_CHECKS, N] (block maxima; dv the larger of dV's rows and P's rows) and each check's
    ‖raw‖₂ [BACKWARD_CHECKS, N] (fp64)."""
    head = tl.program_id(0)
    dv = tl.maximum(_column_max(kv_ptr, head, k_blocks, 4, 0, BLOCK), _column_max(q_ptr, head, q_blocks, 7, 3, BLOCK))
    tl.store(values_ptr + head, dv)
    tl.store(values_ptr + N + head, _column_max(q_ptr, head, q_blocks, 7, 0, BLOCK))
    tl.store(values_ptr + 2 * N + head, _column_max(q_ptr, head, q_blocks, 7, 1, BLOCK))
    tl.store(values_ptr + 3 * N + head, _column_max(q_ptr, head, q_blocks, 7, 2, BLOCK))
    tl.store(values_ptr + 4 * N + head, _column_max(kv_ptr, head, k_blocks, 4, 1, BLOCK))
    tl.store(l2_ptr + head, _column_root(kv_ptr, head, k_blocks, 4, 2, BLOCK))
    tl.store(l2_ptr + N + head, _column_root(q_ptr, head, q_blocks, 7, 4, BLOCK))
    tl.store(l2_ptr + 2 * N + head, _column_root(q_ptr, head, q_blocks, 7, 5, BLOCK))
    tl.store(l2_ptr + 3 * N + head, _column_root(q_ptr, head, q_blocks, 7, 6, BLOCK))
    tl.store(l2_ptr + 4 * N + head, _column_root(kv_ptr, head, k_blocks, 4, 3, BLOCK))


@triton.jit
def dropout_scale_kernel(drop_ptr, out_ptr, Sq, Sk, p_drop, keep_scale, BM: tl.constexpr, BN: tl.constexpr):
    """Dropout's factors [N, Sq, Sk] as the kernels draw them (the reference path's `drop`: tests)."""
    head = tl.program_id(1)
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    seed = _head_seed(drop_ptr, head, True)
    for start_n in range(0, Sk, BN):
        offs_n = start_n + tl.arange(0, BN)
        factor = _keep_scale(seed, offs_m, offs_n, Sk, p_drop, keep_scale, False)
        inside = (offs_m < Sq)[:, None] & (offs_n < Sk)[None, :]
        tl.store(out_ptr + head * Sq * Sk + offs_m[:, None] * Sk + offs_n[None, :], factor, mask=inside)


# -- host side --------------------------------------------------------------------------------------
import dataclasses  # noqa: E402

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_STAGE_IDS = {stage: i for i, stage in enumerate(("qk", "softmax", "pv", "dp", "ds", "dq", "dk"))}
assert set(_STAGE_IDS) == set(STAGES)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One kernel's blocks and pipeline. A block is also the unit a row's (or column's) check sums run
    over, so a replay must use the same: fixed per head dimension, never autotuned."""

    block_m: int  # query rows per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    # (forward) calls without an attn_mask or dropout, head dimension ≤ WS_MAX_HEAD_DIM, run
    # `attention_fwd_ws_kernel`: warp-specialized on Hopper with num_warps = 4 (a producer and two
    # consumer warp groups); its own bits, so a replay, which has the call's blocks, runs it too
    warp_specialize: bool = False


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """The three kernels' blocks: forward (a program owns block_m queries and loops over keys), the
    dK/dV kernel (owns block_n keys, loops over queries) and the dQ kernel (owns block_m queries)."""

    fwd: Blocks
    kv: Blocks
    q: Blocks


# Chosen on the H200 with benchmarks/attention.py --tune (bf16, head dimension 128, checked kernels;
# the sum of four cases 4 × 2048 and 1 × 8192, causal and full: results in the tune record).
GPU_CONFIG = AttentionConfig(fwd=Blocks(128, 64, 8, 3), kv=Blocks(32, 64, 4, 3), q=Blocks(128, 128, 8, 2))
# The warp-specialized forward (`attention_fwd_ws_kernel`): 128 query rows, 64 per consumer warp group,
# 128 keys per block in two stages (205 KB of shared memory checked, 0 spills, sm_90a under Triton 3.6:
# benchmarks/attention_registers.py). Not used: on the H100 its second consumer's row indices are off
# by 64 rows (its lse and check values land in the wrong rows, its causal mask is wrong;
# docs/attention.md). benchmarks/attention.py times it beside GPU_CONFIG's forward; it becomes
# GPU_CONFIG.fwd only once its GPU tests pass and it is the faster.
GPU_FWD_WARP_SPECIALIZED = Blocks(128, 128, 4, 2, warp_specialize=True)
# past this head dimension its two stages of K and V need more shared memory than Hopper has (353 KB at 256)
WS_MAX_HEAD_DIM = 128
# The interpreter runs one program at a time on the CPU: small blocks keep the tests fast.
INTERPRETER_CONFIG = AttentionConfig(fwd=Blocks(16, 16, 4, 1), kv=Blocks(16, 16, 4, 1), q=Blocks(16, 16, 4, 1))


# Shared memory, as a launch at real shapes compiles (the K and V loads pipelined into it; sm_90a under
# Triton 3.6: `benchmarks/attention_registers.py`, its records name the options): Hopper gives a block
# 227 KB, and a kernel that asks for more does not launch. An attn_mask pipelines its fp32 tiles too:
# with one, GPU_CONFIG's dQ kernel asks for 270 KB at head dimension 128, so masked calls run it on
# 128 × 64 blocks (135 KB unmasked, 168 KB with a mask and dropout; results/attention_registers_mask.json).
GPU_CONFIG_MASKED = dataclasses.replace(GPU_CONFIG, q=Blocks(128, 64, 8, 2))
# Head dimension 256 (Gemma's): GPU_CONFIG's dQ kernel would ask for 401 KB and its dK/dV kernel spill
# 3.2 KB per thread (two [64, 256] fp32 accumulators over 4 warps). These blocks ask for 133, 171 and
# 201 KB (150, 187 and 217 KB with a mask and dropout), at most 276 bytes of spills
# (results/attention_registers_d256.json, ..._d256_mask.json). Chosen to fit, not yet timed.
GPU_CONFIG_WIDE = AttentionConfig(fwd=Blocks(128, 32, 8, 2), kv=Blocks(32, 64, 8, 3), q=Blocks(64, 64, 8, 2))
WIDE_HEAD_DIM = 128  # GPU_CONFIG up to this head dimension, GPU_CONFIG_WIDE past it


def config_for(head_dim: int, masked: bool = False) -> AttentionConfig:
    """The blocks of a call with this head dimension, with an attn_mask or not (a call's bits depend on
    them: its replays have the same head dimension and mask, so the same blocks)."""
    if INTERPRET:
        return INTERPRETER_CONFIG
    if head_dim > WIDE_HEAD_DIM:
        return GPU_CONFIG_WIDE
    return GPU_CONFIG_MASKED if masked else GPU_CONFIG


def _launch_args(blocks: Blocks) -> dict:
    return dict(BM=blocks.block_m, BN=blocks.block_n, num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def _tma_operand(x: torch.Tensor) -> torch.Tensor:
    """x as a TMA descriptor can read it — its start and every stride in use 16-byte aligned — or an
    aligned copy (a view into an odd offset of a fused projection: rare). The kernel stays the same
    either way, so a call and its replays compute the same bits."""
    size = x.element_size()
    strides = [st for st, n in zip(x.stride()[:-1], x.shape[:-1], strict=True) if n > 1]  # those in use
    if x.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in strides):
        return x
    return x.clone(memory_format=torch.contiguous_format)


def supported(q: torch.Tensor, k: torch.Tensor, dropout_p: float = 0.0) -> str | None:
    """Why these operands ([N, S, D] or [B, H, S, D]) cannot run here (None: they can)."""
    d = q.shape[-1]
    if q.dtype not in _TL_DTYPES or (q.is_cuda and q.dtype == torch.float32):
        return f"{q.dtype} operands (the GPU kernels take bf16/fp16)"
    if d < 16 or d > 256 or d & (d - 1):
        return f"head dimension {d} (a power of two from 16 to 256)"
    if dropout_p > 0.0 and q.shape[-2] * k.shape[-2] >= 2**31:
        return f"attention dropout over {q.shape[-2]} × {k.shape[-2]} scores (its Philox offsets are 32-bit)"
    return None


@dataclasses.dataclass(frozen=True)
class DropoutDraw:
    """Attention dropout drawn inside the kernels: each score kept with probability 1 − p, from Philox
    keyed by `seeds` (int64 [2] on the device: the call's seed and the index of its first head) — the
    mask is never stored; forward, backward and replays redraw it identically."""

    p: float
    seeds: torch.Tensor

    @staticmethod
    def new(p: float, device: torch.device) -> DropoutDraw:
        """A fresh draw from the device's generator (SDPA's dropout draws there too; a checkpointed
        segment's recomputation restores it), with no host read."""
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)
        return DropoutDraw(p, torch.cat((seed, torch.zeros(1, dtype=torch.int64, device=device))))

    def of_head(self, head: torch.Tensor) -> DropoutDraw:
        """The draw of a one-head copy of head `head` (int64 [1] on the device)."""
        return DropoutDraw(self.p, torch.cat((self.seeds[:1], self.seeds[1:] + head)))

    def detach(self) -> DropoutDraw:  # a replay keeps its context as it keeps tensors: detached copies
        return self

    def clone(self) -> DropoutDraw:
        return DropoutDraw(self.p, self.seeds.clone())


def dropout_scales(drop: DropoutDraw, n: int, sq: int, sk: int) -> torch.Tensor:
    """The factors [n, Sq, Sk] fp32 (0 or 1/(1 − p)) the kernels apply for `drop`: the reference
    path's dropout mask for the same draw."""
    out = torch.empty(n, sq, sk, dtype=torch.float32, device=drop.seeds.device)
    block = 16
    dropout_scale_kernel[(ceil_div(sq, block), n)](drop.seeds, out, sq, sk, drop.p, 1.0 / (1.0 - drop.p),
                                                      BM=block, BN=block)  # fmt: skip
    return out


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


def _dropout_args(drop: DropoutDraw | None, q: torch.Tensor) -> tuple[tuple, bool]:
    """(runtime args, DROPOUT) of a call's dropout; a stand-in pointer when there is none."""
    if drop is None:
        return (q, 0.0, 1.0), False
    if not isinstance(drop, DropoutDraw):
        raise ValueError("the Triton attention kernels draw dropout themselves: pass a DropoutDraw, not a mask")
    return (drop.seeds, float(drop.p), 1.0 / (1.0 - drop.p)), True


def _mask_args(mask: torch.Tensor | None, q: torch.Tensor, heads: int) -> tuple:
    """(pointer, batch, head and row strides) of an additive fp32 mask: [N or 1, Sq, Sk] for flattened
    operands, or anything that broadcasts to [B, H, Sq, Sk] for 4-D ones — read in place (broadcast
    dimensions get stride 0), never expanded in memory. A stand-in when there is none."""
    if mask is None:
        return (q, 0, 0, 0)
    if mask.dtype != torch.float32:
        raise ValueError(f"the Triton attention kernels take an fp32 additive mask, not {mask.dtype}")
    sq, sk = q.shape[-2], mask.shape[-1]
    full = mask.expand(*q.shape[:-2], sq, sk) if q.dim() == 4 else mask.expand(q.shape[0], sq, sk)
    if full.stride(-1) != 1:
        full = full.contiguous()  # a mask broadcast over the keys (a constant per row): rare, materialized
    return (full, *_strides(full, heads))


def _layout(q: torch.Tensor, k: torch.Tensor, heads: int | None) -> tuple[int, int, int]:
    """(N flattened query heads, query heads per batch, query heads per key/value head) of flattened
    [N, S, D] operands (`heads` as given) or [B, H, S, D] views (H from the shape)."""
    if q.dim() == 4:
        if k.dim() != 4 or (heads is not None and heads != q.shape[1]):
            raise ValueError("4-D q takes 4-D k and v [B, Hkv, S, D] (and `heads` equal to its H, or none)")
        return q.shape[0] * q.shape[1], *_grouping(q.shape[0] * q.shape[1], k.shape[0] * k.shape[1], q.shape[1])
    return q.shape[0], *_grouping(q.shape[0], k.shape[0], heads)


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


def _strides(t: torch.Tensor, heads: int) -> tuple[int, int, int]:
    """(batch, head, row) strides of [B, H, S, D] or of flattened [N, S, D] in batches of `heads`."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError("attention operands need a unit stride in the head dimension")
    if t.dim() == 4:
        return t.stride(0), t.stride(1), t.stride(2)
    return heads * t.stride(0), t.stride(0), t.stride(1)


def _sums(x: torch.Tensor, heads: int, block: int = 64, cols: bool = False, o: torch.Tensor | None = None) -> tuple:
    """The side pass over x [N, S, D] or [B, H, S, D] (`attention_sums_kernel`; `heads` per batch):
    W [N, S, SIDE] in x's dtype, and with `cols` per block of `block` rows its column sums
    [N, blocks, D], Σ and max of ‖x_k‖² [N, blocks] (fp32); with `o` (x = dO, o = O [N, S, D]) D and
    Σ_d |dO ⊙ O| [N, S]."""
    n = x.shape[0] * x.shape[1] if x.dim() == 4 else x.shape[0]
    length, d = x.shape[-2:]
    blocks = ceil_div(length, block)
    f32 = dict(dtype=torch.float32, device=x.device)
    w = torch.empty(n, length, SIDE, dtype=x.dtype, device=x.device)
    colsum = torch.empty(n, blocks, d, **f32) if cols else w
    colsq, colmax = (torch.empty(n, blocks, **f32) if cols else w for _ in range(2))
    delta, dmag = (torch.empty(n, length, **f32) if o is not None else w for _ in range(2))
    attention_sums_kernel[(blocks, n)](
        x, x if o is None else o, w, colsum, colsq, colmax, delta, dmag, *_strides(x, heads),
        *_strides(x if o is None else o, heads), heads, length, _sq_scale(x.dtype),
        WITH_COLS=cols, WITH_O=o is not None, DT=_TL_DTYPES[x.dtype], D=d, BLOCK=block,
    )  # fmt: skip
    return w, colsum, colsq, colmax, delta, dmag


def _sq_scale(dtype: torch.dtype) -> float:
    """The factor on ‖x‖² in a side operand: 2⁻⁸ for fp16 (65504 is its largest value), else 1."""
    return 2.0**-8 if dtype == torch.float16 else 1.0


def _even(sq: int, sk: int, blocks: Blocks) -> bool:
    return sq % blocks.block_m == 0 and sk % blocks.block_n == 0


def forward(q, k, v, scale: float, causal: bool, fault: HeadFault | None = None, mask: torch.Tensor | None = None,
            drop: torch.Tensor | None = None, *, heads: int | None = None, check: bool = True) -> Forward:  # fmt: skip
    """The checked forward (see the module docstring) of flattened heads q [N, Sq, D] or of q
    [B, H, Sq, D] as it is laid out (a transposed view is read in place): out [N, Sq, D] (q's dtype),
    lse [N, Sq] fp32 (natural log), values [N] fp64 and raw_l2 [N] fp64 on the device, N = B·H.

    k and v hold N or fewer heads: with `heads` query heads per batch and k [N·Hkv/heads, Sk, D] (or
    k [B, Hkv, Sk, D]), query head h of a batch reads key/value head h // (heads / Hkv) in place (GQA
    without an expanded copy). `check=False` runs the same kernel without its checks (values empty:
    benchmarks). `mask`: an additive fp32 mask, [N or 1, Sq, Sk] for flattened heads or anything that
    broadcasts to [B, H, Sq, Sk] (not with `causal`). `drop`: a `DropoutDraw` (out = P_d·V with
    P_d = P ⊙ keep/(1 − p); the check O·1 = P_d·(V·1))."""
    dropout, has_dropout = _dropout_args(drop, q)
    n, heads, group = _layout(q, k, heads)
    sq, d = q.shape[-2:]
    sk = k.shape[-2]
    cfg = config_for(d, masked=mask is not None).fwd
    q_blocks = ceil_div(sq, cfg.block_m)
    out = torch.empty(n, sq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(n, sq, dtype=torch.float32, device=q.device)
    checks = torch.empty(n, q_blocks, FWD_CHECKS, dtype=torch.float32, device=q.device)
    wv = _sums(v, heads // group)[0] if check else q
    model, stage, fargs = _fault_args(fault, False, sq, sk, d)
    if cfg.warp_specialize and mask is None and not has_dropout and d <= WS_MAX_HEAD_DIM:
        q, k, v = _tma_operand(q), _tma_operand(k), _tma_operand(v)
        checks = torch.empty(n, sq, FWD_CHECKS, dtype=torch.float32, device=q.device) if check else checks
        with descriptor_scratch():
            attention_fwd_ws_kernel[(q_blocks, n)](
                q, k, v, wv, out, lse, checks, *_strides(q, heads), *_strides(k, heads // group),
                *_strides(v, heads // group), *_strides(out, heads), sq, sk, float(scale), 1.0 / _sq_scale(q.dtype),
                heads, group, *fargs, CAUSAL=causal, CHECK=check, MODEL=model, STAGE=stage, EVEN=_even(sq, sk, cfg),
                DT=_TL_DTYPES[q.dtype], UPCAST=INTERPRET, D=d, STAGES=cfg.num_stages, **_launch_args(cfg),
            )  # fmt: skip
        return _fwd_values(out, lse, checks, check)
    attention_fwd_kernel[(q_blocks, n)](
        q, k, v, wv, out, lse, checks, *_mask_args(mask, q, heads), *_strides(q, heads),
        *_strides(k, heads // group), *_strides(v, heads // group), *_strides(out, heads),
        sq, sk, float(scale), 1.0 / _sq_scale(q.dtype), heads, group, *fargs, *dropout,
        CAUSAL=causal, HAS_MASK=mask is not None, CHECK=check, MODEL=model, STAGE=stage, DROPOUT=has_dropout,
        EVEN=_even(sq, sk, cfg), DT=_TL_DTYPES[q.dtype], UPCAST=INTERPRET, D=d, **_launch_args(cfg),
    )  # fmt: skip
    return _fwd_values(out, lse, checks, check)


def _fwd_values(out: torch.Tensor, lse: torch.Tensor, checks: torch.Tensor, check: bool) -> Forward:
    """The forward's result, its blocks' check values [N, q_blocks, 2] reduced to one per head."""
    if not check:
        return Forward(out, lse, torch.empty(0), torch.empty(0))
    n, q_blocks = checks.shape[:2]
    values, raw_l2 = torch.empty(2, n, dtype=torch.float64, device=out.device)
    attention_fwd_finish_kernel[(n,)](checks, values, raw_l2, q_blocks, BLOCK=FINISH_BLOCK)
    return Forward(out, lse, values, raw_l2)


def backward(q, k, v, out, lse, dout, scale: float, causal: bool, fault: HeadFault | None = None,
             mask: torch.Tensor | None = None, drop: torch.Tensor | None = None, *, heads: int | None = None,
             check: bool = True) -> Backward:  # fmt: skip
    """The checked backward, operands as for `forward` (dout like q, out and lse as `forward` gave
    them): dq, dk, dv [N, S, D] fp32 (dk and dv per query head: a GQA group's sum is the caller's),
    values [len(BACKWARD_CHECKS), N] fp64 and raw_l2 [N] (‖dV·1 − Pᵀ·(dO·1)‖₂) on the device.
    `heads`, `mask`, `drop` and `check` as for `forward`."""
    dropout, has_dropout = _dropout_args(drop, q)
    n, heads, group = _layout(q, k, heads)
    sq, d = q.shape[-2:]
    sk = k.shape[-2]
    cfg = config_for(d, masked=mask is not None)
    do = dout if dout.stride(-1) == 1 else dout.contiguous()
    wdo, _, _, _, delta, dmag = _sums(do, heads, o=out)  # D = rowsum(dO ⊙ O) [N, Sq] with the side operand of dO
    if check:
        wk = _sums(k, heads // group)[0]
        _, vcols, vsq, vmax, _, _ = _sums(v, heads // group, block=cfg.q.block_n, cols=True)
        wq = torch.empty(n, sq, SIDE, dtype=q.dtype, device=q.device)  # written by the dQ kernel
    else:
        wq = wk = vcols = vsq = vmax = wdo
    dq = torch.empty(n, sq, d, dtype=torch.float32, device=q.device)
    dk = torch.empty(n, sk, d, dtype=torch.float32, device=q.device)
    dv = torch.empty(n, sk, d, dtype=torch.float32, device=q.device)  # per query head
    q_blocks, k_blocks = ceil_div(sq, cfg.q.block_m), ceil_div(sk, cfg.kv.block_n)
    kv_check = torch.empty(n, k_blocks, KV_CHECKS, dtype=torch.float32, device=q.device)
    q_check = torch.empty(n, q_blocks, Q_CHECKS, dtype=torch.float32, device=q.device)
    model, stage, fargs = _fault_args(fault, True, sq, sk, d)
    common = dict(CAUSAL=causal, HAS_MASK=mask is not None, CHECK=check, MODEL=model, STAGE=stage,
                  DROPOUT=has_dropout, DT=_TL_DTYPES[q.dtype], UPCAST=INTERPRET, D=d)  # fmt: skip
    operands = (*_mask_args(mask, q, heads), *_strides(q, heads), *_strides(k, heads // group),
                *_strides(v, heads // group), *_strides(do, heads))  # fmt: skip
    u_out = torch.finfo(out.dtype).eps / 2
    attention_bwd_q_kernel[(q_blocks, n)](
        q, k, v, do, wk, vcols, vsq, vmax, lse, delta, dmag, dq, q_check, wq, *operands, sq, sk,
        float(scale), u_out, _sq_scale(q.dtype), heads, group, *fargs, *dropout, EVEN=_even(sq, sk, cfg.q), **common,
        **_launch_args(cfg.q),
    )  # fmt: skip
    attention_bwd_kv_kernel[(k_blocks, n)](
        q, k, v, do, wq, wdo, lse, delta, dk, dv, kv_check, *operands, sq, sk, float(scale),
        1.0 / _sq_scale(q.dtype), heads, group, *fargs, *dropout, EVEN=_even(sq, sk, cfg.kv), **common,
        **_launch_args(cfg.kv),
    )  # fmt: skip
    if not check:
        return Backward(dq, dk, dv, torch.empty(0), torch.empty(0))
    values, l2 = torch.empty(2, len(BACKWARD_CHECKS), n, dtype=torch.float64, device=q.device)
    attention_bwd_finish_kernel[(n,)](kv_check, q_check, values, l2, n, k_blocks, q_blocks, BLOCK=FINISH_BLOCK)
    return Backward(dq, dk, dv, values, l2[0], check_l2=l2)
