"""Checked attention on the reference path: plain PyTorch, fp32 accumulation, all heads batched.

Heads are flattened: q [N, Sq, D], k and v [N, Sk, D] (N = batch · query heads, GQA already
expanded), scale c, optional causal mask (queries aligned to the end of the keys, as SDPA does) and
optional additive mask (SDPA's `attn_mask`, added to the scaled scores; every row keeps a key) and
optional dropout (a multiplier of P drawn by the op; with it `dv` is the GEMM column check of
P_dᵀ·dO together with the recomputed P's row sums, since P_d's rows do not sum to 1):

    forward   S = c·q·kᵀ (fp32),  m = max_k S,  p = exp(S − m),  ℓ = Σ_k p,  P = p / ℓ,  lse = m + log ℓ,
              O_acc = P·V (fp32); the checksum compares O_acc·1 with P·(V·1) (fp64), a checksum column
              of V taken from the accumulator before O is rounded to the input dtype
    backward  P is recomputed from q, k and the saved lse; dV = Pᵀ·dO (fp32), dP = dO·Vᵀ,
              D = rowsum(dO ⊙ O), dS = P ⊙ (dP − D), dQ = c·dS·k, dK = c·dSᵀ·q. Five checks:
      dv      every row of P sums to 1, so 1ᵀdV = 1ᵀPᵀdO = (P·1)ᵀdO = 1ᵀdO — which also checks the
              recomputation of P (a wrong score, exponent or saved lse breaks the row sums)
      dp      a GEMM row check of dP: dP·1 against dO·(Vᵀ·1)
      ds      the softmax-backward identity: Σ_k dS_qk = Σ_k P_qk dP_qk − D_q Σ_k P_qk = 0, since
              D_q = dO_q·O_q = Σ_k P_qk (dO_q·V_k) = Σ_k P_qk dP_qk. It holds to the rounding of O (D is
              taken from the output, as FlashAttention takes it), so its scale carries that term:
              a fault in dP, D or the elementwise dS that moves a row sum beyond it is seen
      dq, dk  GEMM row checks of the accumulators of dS·k and dSᵀ·q: dQ·1 against dS·(K·1) and
              dKᵀ·1 against dSᵀ·(Q·1) (c applied after the check). With ds they give Σ_keys dK = 0
              and dQ·1 = c·dS·(K·1), the issue's invariants, each check covering its own stage.

Normalized differences per head (units of fp32 rounding u = 2⁻²⁴), the largest over rows / columns:
    forward   |O_acc·1 − P·(V·1)|_q / (u·s_q),  s_q = sqrt(Σ_k P²_qk ‖V_k‖²)   (as for a GEMM)
    dv        |1ᵀdV − 1ᵀdO|_d / (u·t_d),          t_d = Σ_q |dO_qd|
    dp, dq, dk  as for a GEMM: |C·1 − A·(B·1)|_i / (u·sqrt(Σ_k A²_ik ‖B_k,:‖²))
    ds        |Σ_k dS_qk| / (u·Σ_k |dS_qk| + u_O·Σ_d |dO_qd O_qd|),  u_O the rounding of O's dtype
A correct dv stays below Sq + Sk + 8: the row sums of P are 1 within (Sk + 3)·u, and the fp32 sums
of dV over the queries add at most Sq·u of Σ_qk P_qk |dO_qd| = t_d per column (`backward_bound`).

The same call replays bit for bit on a healthy device: the verifier reruns the whole call (the same
batched shapes) and compares the suspect head. Faults (`stage`): ``qk`` corrupts one score, ``softmax``
one unnormalized probability, ``pv`` one accumulator element of O (forward) or dV (backward), and in
backward ``dp``, ``ds``, ``dq``, ``dk`` one element of those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from aegis_sdc.kernels.numerics import exact_fp32
from aegis_sdc.kernels.reference import U32, AccumulatorCorruption

STAGES = ("qk", "softmax", "pv", "dp", "ds", "dq", "dk")
BACKWARD_CHECKS = ("dv", "dp", "ds", "dq", "dk")  # the rows of `Backward.values`


@dataclass
class HeadFault:
    """A fault in one head of one call: the head, the stage and the element's corruption."""

    head: int
    stage: str
    fault: AccumulatorCorruption


@dataclass
class Forward:
    out: torch.Tensor  # [N, Sq, D] input dtype
    lse: torch.Tensor  # [N, Sq] fp32
    values: torch.Tensor  # [N] fp64: normalized forward differences
    raw_l2: torch.Tensor  # [N] fp64: ‖O_acc·1 − P·(V·1)‖₂ per head (the AEGIS unit of fault size)


@dataclass
class Backward:
    dq: torch.Tensor  # [N, Sq, D] fp32
    dk: torch.Tensor  # [N, Sk, D] fp32 (per query head: GQA sums are the op's)
    dv: torch.Tensor  # [N, Sk, D] fp32
    values: torch.Tensor  # [len(BACKWARD_CHECKS), N] fp64: normalized differences, check by check
    raw_l2: torch.Tensor  # [N] fp64: ‖1ᵀdV − 1ᵀdO‖₂ per head
    check_l2: torch.Tensor | None = None  # [len(BACKWARD_CHECKS), N]: each check's ‖raw difference‖₂ (Triton path)
    ds: torch.Tensor | None = None  # [N, Sq, Sk] fp32: the scores' gradient, an attn_mask's (reference path)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, mask: torch.Tensor | None) -> torch.Tensor:
    s = torch.bmm(q.float(), k.float().transpose(1, 2)) * scale
    if mask is not None:  # additive fp32 [N or 1, Sq, Sk] (a boolean mask arrives as 0 / −inf)
        s = s + mask
    if causal:
        sq, sk = s.shape[1:]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(diagonal=sk - sq)
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _corrupt(batched: torch.Tensor, fault: HeadFault | None, stage: str) -> torch.Tensor:
    if fault is None or fault.stage != stage:
        return batched
    i, j = fault.fault.element(*batched.shape[1:])
    batched = batched.clone()
    batched[fault.head, i, j] = fault.fault.corrupt(batched[fault.head, i, j])
    return batched


def _largest(diff: torch.Tensor) -> torch.Tensor:
    """[N, X] → [N]: the largest difference per head; NaN (a non-finite checksum) counts as infinite."""
    return torch.nan_to_num(diff, nan=math.inf).amax(dim=1)


def attention_forward(q, k, v, scale: float, causal: bool, fault: HeadFault | None = None,
                      mask: torch.Tensor | None = None, drop: torch.Tensor | None = None) -> Forward:  # fmt: skip
    """`mask`: an additive fp32 attention mask [N or 1, Sq, Sk] (SDPA's `attn_mask`, flattened);
    `drop`: dropout as an fp32 multiplier [N, Sq, Sk] (0 where dropped, 1/(1 − p) where kept)."""
    with exact_fp32(q.device.type):  # the same arithmetic in training and in every replay
        return _forward(q, k, v, scale, causal, fault, mask, drop)


def attention_backward(q, k, v, out, lse, dout, scale: float, causal: bool, fault: HeadFault | None = None,
                       mask: torch.Tensor | None = None, drop: torch.Tensor | None = None) -> Backward:  # fmt: skip
    with exact_fp32(q.device.type):
        return _backward(q, k, v, out, lse, dout, scale, causal, fault, mask, drop)


def _forward(q, k, v, scale: float, causal: bool, fault: HeadFault | None, mask, drop) -> Forward:
    s = _corrupt(_scores(q, k, scale, causal, mask), fault, "qk")
    m = s.amax(dim=-1, keepdim=True)
    # A query row an attn_mask leaves no key (a left-padded row) has m = −∞: its p, P and output are
    # zeros, as SDPA gives, its lse −∞, and its checks compare 0 with 0.
    p = _corrupt(torch.exp(s - m.clamp_min(torch.finfo(torch.float32).min)), fault, "softmax")
    ell = p.sum(dim=-1, keepdim=True)
    probs = p / torch.where(ell == 0, 1.0, ell)
    if drop is not None:  # O = P_d·V with P_d = P ⊙ drop: the check takes the same P_d
        probs = probs * drop
    v32 = v.float()
    acc = _corrupt(torch.bmm(probs, v32), fault, "pv")  # [N, Sq, D] fp32 accumulator
    p64, v64 = probs.double(), v32.double()
    row_sum = acc.double().sum(dim=-1)
    row_ref = torch.bmm(p64, v64.sum(dim=-1, keepdim=True)).squeeze(-1)
    row_scale = torch.bmm(p64 * p64, (v64 * v64).sum(dim=-1, keepdim=True)).squeeze(-1).sqrt()
    diff = row_sum - row_ref
    values = _largest(diff.abs() / (U32 * row_scale).clamp_min(1e-300))
    return Forward(acc.to(q.dtype), (m + torch.log(ell)).squeeze(-1), values, diff.norm(dim=1))


def _gemm_rows(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The GEMM row check of acc = a·b (batched, [N, R, C]): the largest |acc·1 − a·(b·1)| / (u·s) per head."""
    a64, b64 = a.double(), b.double()
    ref = torch.bmm(a64, b64.sum(dim=-1, keepdim=True)).squeeze(-1)
    scale = torch.bmm(a64 * a64, (b64 * b64).sum(dim=-1, keepdim=True)).squeeze(-1).sqrt()
    return _largest((acc.double().sum(dim=-1) - ref).abs() / (U32 * scale).clamp_min(1e-300))


def _backward(q, k, v, out, lse, dout, scale: float, causal: bool, fault: HeadFault | None, mask, drop) -> Backward:
    s = _corrupt(_scores(q, k, scale, causal, mask), fault, "qk")
    keyed = ~torch.isneginf(lse)[..., None]  # [N, Sq, 1]: rows the mask leaves a key (others: P = 0; NaN stays)
    lse_use = torch.where(keyed.squeeze(-1), lse.float(), float("inf"))  # exp(−∞ − ∞) = 0 on a keyless row
    probs = _corrupt(torch.exp(s - lse_use[..., None]), fault, "softmax")
    do32, q32, k32, v32, o32 = dout.float(), q.float(), k.float(), v.float(), out.float()
    kept = probs if drop is None else probs * drop  # P_d: what multiplied V in forward
    dv = _corrupt(torch.bmm(kept.transpose(1, 2), do32), fault, "pv")  # [N, Sk, D] fp32 accumulator
    col_dv = dv.double().sum(dim=1)  # [N, D]: 1ᵀdV
    if drop is None:  # rows of P sum to 1 (0 on a keyless row): 1ᵀdV = Σ of the keyed rows of dO
        keyed_do = do32.double() * keyed
        col_ref = keyed_do.sum(dim=1)
        t = keyed_do.abs().sum(dim=1)
    else:  # rows of P_d do not: 1ᵀdV = (P_d·1)ᵀdO, the GEMM column check of P_dᵀ·dO
        rows = kept.double().sum(dim=-1, keepdim=True)
        col_ref = (rows * do32.double()).sum(dim=1)
        t = (rows * do32.double().abs()).sum(dim=1)
    diff = col_dv - col_ref
    dv_values = _largest(diff.abs() / (U32 * t).clamp_min(1e-300))
    if drop is not None:  # what 1ᵀdO also checked: the recomputed P's rows sum to 1 (within (Sk + 3)·u)
        row_error = (probs.double().sum(dim=-1) - keyed.squeeze(-1).double()).abs()  # a keyless row sums to 0
        dv_values = torch.maximum(dv_values, _largest(row_error / U32))
    vt = v32.transpose(1, 2)
    dp = _corrupt(torch.bmm(do32, vt), fault, "dp")  # [N, Sq, Sk]: the GEMM dO·Vᵀ (= dP_d)
    delta = (do32 * o32).sum(dim=-1, keepdim=True)
    dp_kept = dp if drop is None else dp * drop  # dL/dP = dP_d ⊙ drop; Σ_k P·(dP_d ⊙ drop) = dO·O = D still
    ds = _corrupt(probs * (dp_kept - delta), fault, "ds")
    dq_acc = _corrupt(torch.bmm(ds, k32), fault, "dq")  # [N, Sq, D] fp32 accumulator of dS·k
    dk_acc = _corrupt(torch.bmm(ds.transpose(1, 2), q32), fault, "dk")  # [N, Sk, D] of dSᵀ·q
    u_out = torch.finfo(out.dtype).eps / 2
    ds64 = ds.double()
    ds_scale = U32 * ds64.abs().sum(dim=-1) + u_out * (do32.double() * o32.double()).abs().sum(dim=-1)
    ds_values = _largest(ds64.sum(dim=-1).abs() / ds_scale.clamp_min(1e-300))
    values = torch.stack([
        dv_values,
        _gemm_rows(dp, do32, vt),
        ds_values,
        _gemm_rows(dq_acc, ds, k32),
        _gemm_rows(dk_acc, ds.transpose(1, 2), q32),
    ])  # fmt: skip
    return Backward(dq_acc * scale, dk_acc * scale, dv, values, diff.norm(dim=1), ds=ds)


def backward_bound(queries: int, keys: int) -> float:
    """The largest normalized backward difference of a correct computation: the row sums of P are 1
    within (Sk + 3)·u, and dV's fp32 sums over the queries add at most Sq·u of t_d per column."""
    return queries + keys + 8.0
