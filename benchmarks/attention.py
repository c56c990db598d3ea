"""Checked attention against SDPA on the GPU: forward and backward, in the same run.

Shapes: 32 query / 8 key-value heads (GQA), head dimension 128, bf16, 8192 tokens per call split as
batch × seq = 4 × 2048, 2 × 4096, 1 × 8192; causal and full. Per case, times of

    default    `F.scaled_dot_product_attention` with its default backend (cuDNN on the H200): the
               unprotected baseline
    flash      SDPA's FlashAttention-2 backend
    unchecked  our kernels (kernels/triton_attention.py) without their checks
    checked    our kernels with every check
    ws_unchecked, ws_checked   the warp-specialized forward (`GPU_FWD_WARP_SPECIALIZED`), forward only,
               beside `GPU_CONFIG`'s forward in the same run

for the forward and for the backward (SDPA: `torch.autograd.grad` of a retained graph; ours: the
backward launch with its D = rowsum(dO ⊙ O) pass and the GQA group sums of dK and dV, as the op
runs it). `triton.testing.do_bench` medians (these calls take milliseconds: the launch path is
negligible). Ratios are the default backend's time ÷ ours (1 = parity); `median_invariant_cost` is
checked ÷ unchecked − 1 of our own kernels.

    python benchmarks/attention.py [--out benchmarks/results/attention.json] [--smoke]
    python benchmarks/attention.py --tune [--out ...]   choose the kernels' blocks (coordinate search)

`--tune` times candidate blocks for each kernel at 4 × 2048 and 1 × 8192, causal and full, checked:
the forward first, then the dK/dV kernel with the dQ kernel fixed, then the dQ kernel; the sum of
medians over the four cases decides. The chosen blocks go into `GPU_CONFIG` by hand (a replay must
use the blocks of the original call, so they are a table, never tuned at run time).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import gpu_environment, write_result
from triton.testing import do_bench

from aegis_sdc.kernels import triton_attention as ta

HEADS, KV_HEADS, DIM = 32, 8, 128
SPLITS = ((4, 2048), (2, 4096), (1, 8192))  # (batch, seq)
TARGETS = {"median_fwd_ratio_default": 0.8, "median_bwd_ratio_default": 0.8, "median_invariant_cost": 0.02}


def sdpa_times(q, k, v, do, causal: bool, backend) -> tuple[float | None, float | None]:
    """(forward ms, backward ms) of SDPA on one backend; None where the backend refuses the call."""
    ctx = torch.nn.attention.sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
    try:
        with ctx:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
            fwd = do_bench(lambda: F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True))
            bwd = do_bench(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True))
        return fwd, bwd
    except RuntimeError as error:  # e.g. a backend without GQA or this head dimension
        print(f"  {backend}: {str(error).splitlines()[0][:100]}", flush=True)
        return None, None


def our_times(q, k, v, do, causal: bool, check: bool, forward_only: bool = False) -> tuple[float, float]:
    b, h, s, d = q.shape
    hkv = k.shape[1]
    qf, kf, vf, dof = (t.reshape(-1, s, d) for t in (q, k, v, do))
    scale = d**-0.5
    fwd = ta.forward(qf, kf, vf, scale, causal, heads=h, check=check)

    def backward():
        g = ta.backward(qf, kf, vf, fwd.out, fwd.lse, dof, scale, causal, heads=h, check=check)
        dk = g.dk.reshape(b, hkv, h // hkv, s, d).sum(dim=2).to(k.dtype)
        dv = g.dv.reshape(b, hkv, h // hkv, s, d).sum(dim=2).to(v.dtype)
        return g.dq.to(q.dtype), dk, dv

    fwd_ms = do_bench(lambda: ta.forward(qf, kf, vf, scale, causal, heads=h, check=check))
    return fwd_ms, (float("nan") if forward_only else do_bench(backward))


def ws_forward_times(q, k, v, do, causal: bool, check: bool) -> tuple[float, None]:
    """(forward ms, None) of the warp-specialized forward."""
    cfg = ta.GPU_CONFIG
    ta.GPU_CONFIG = dataclasses.replace(cfg, fwd=ta.GPU_FWD_WARP_SPECIALIZED)
    try:
        return our_times(q, k, v, do, causal, check, forward_only=True)[0], None
    finally:
        ta.GPU_CONFIG = cfg


def flops(b: int, s: int, causal: bool) -> tuple[float, float]:
    """(forward, backward) FLOPs: 2 GEMMs forward, 5 backward (with the recomputed scores), halved when causal."""
    per_gemm = 2 * b * HEADS * s * s * DIM * (0.5 if causal else 1.0)
    return 2 * per_gemm, 5 * per_gemm


# (block_m, block_n, num_warps, num_stages) tried per kernel by --tune (not the warp-specialized
# forward while its GPU tests fail: docs/attention.md)
FWD_CANDIDATES = [ta.Blocks(*b) for b in (
    (64, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3),
    (128, 64, 8, 2), (64, 64, 4, 3))]  # fmt: skip
KV_CANDIDATES = [ta.Blocks(*b) for b in (
    (64, 64, 4, 2), (32, 128, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3), (32, 64, 4, 2), (32, 128, 8, 2),
    (16, 64, 4, 3), (64, 64, 8, 3))]  # fmt: skip
Q_CANDIDATES = [ta.Blocks(*b) for b in (
    (64, 64, 4, 2), (128, 64, 8, 3), (128, 32, 4, 3), (64, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3),
    (128, 128, 8, 2))]  # fmt: skip


def tune(out: Path) -> None:
    """Coordinate search over the candidates above (see the module docstring)."""
    cases = []
    for b, s in ((4, 2048), (1, 8192)):
        q = torch.randn(b, HEADS, s, DIM, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, KV_HEADS, s, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        cases += [(q, k, v, torch.randn_like(q), causal) for causal in (True, False)]
    rows = []
    started = time.time()

    def total(kind: str, config: ta.AttentionConfig) -> float:
        ta.GPU_CONFIG = config
        times = []
        for q, k, v, do, causal in cases:
            try:
                fwd, bwd = our_times(q, k, v, do, causal, True, forward_only=kind == "fwd")
            except Exception as error:  # a candidate that does not compile (e.g. out of shared memory)
                print(f"  {kind} {config}: {str(error).splitlines()[0][:120]}", flush=True)
                return float("inf")
            times.append(fwd if kind == "fwd" else bwd)
        rows.append({"kernel": kind, "config": dataclasses.asdict(config), "ms": times, "total_ms": sum(times)})
        print(f"{kind:3s} {getattr(config, kind)} total {sum(times):.3f} ms {[round(t, 3) for t in times]}", flush=True)
        return sum(times)

    best = ta.GPU_CONFIG
    for kind, candidates in (("fwd", FWD_CANDIDATES), ("kv", KV_CANDIDATES), ("q", Q_CANDIDATES)):
        best = min((dataclasses.replace(best, **{kind: c}) for c in candidates), key=lambda cfg: total(kind, cfg))
    summary = {"chosen": dataclasses.asdict(best)}
    write_result(out, gpu_environment(seconds=round(time.time() - started, 1)), rows, summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "attention.json")
    parser.add_argument("--smoke", action="store_true", help="one tiny case (checks the script on a GPU quickly)")
    parser.add_argument("--tune", action="store_true", help="choose the kernels' blocks instead (see above)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.tune:
        return tune(args.out)
    rows = []
    splits = ((1, 256),) if args.smoke else SPLITS
    started = time.time()
    for b, s in splits:
        for causal in (True, False):
            q = torch.randn(b, HEADS, s, DIM, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, KV_HEADS, s, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            do = torch.randn_like(q)
            row = {"batch": b, "seq": s, "causal": causal, "heads": HEADS, "kv_heads": KV_HEADS, "dim": DIM}
            times = {
                "default": sdpa_times(q, k, v, do, causal, None),
                "flash": sdpa_times(q, k, v, do, causal, torch.nn.attention.SDPBackend.FLASH_ATTENTION),
                "unchecked": our_times(q, k, v, do, causal, False),
                "checked": our_times(q, k, v, do, causal, True),
                "ws_unchecked": ws_forward_times(q, k, v, do, causal, False),
                "ws_checked": ws_forward_times(q, k, v, do, causal, True),
            }
            f_fwd, f_bwd = flops(b, s, causal)
            for mode, (fwd, bwd) in times.items():
                row[f"{mode}_fwd_ms"], row[f"{mode}_bwd_ms"] = fwd, bwd
                row[f"{mode}_fwd_tflops"] = f_fwd / fwd / 1e9 if fwd else None
                row[f"{mode}_bwd_tflops"] = f_bwd / bwd / 1e9 if bwd else None
            for mode in ("unchecked", "checked", "ws_unchecked", "ws_checked"):
                row[f"{mode}_fwd_ratio"] = row["default_fwd_ms"] / row[f"{mode}_fwd_ms"]
            for mode in ("unchecked", "checked"):
                row[f"{mode}_bwd_ratio"] = row["default_bwd_ms"] / row[f"{mode}_bwd_ms"]
            row["invariant_cost_fwd"] = row["checked_fwd_ms"] / row["unchecked_fwd_ms"] - 1
            row["invariant_cost_bwd"] = row["checked_bwd_ms"] / row["unchecked_bwd_ms"] - 1
            row["invariant_cost_fwd_ws"] = row["ws_checked_fwd_ms"] / row["ws_unchecked_fwd_ms"] - 1
            rows.append(row)
            print(
                f"B={b} S={s:5d} {'causal' if causal else 'full  '} | fwd TF/s default "
                f"{row['default_fwd_tflops']:.0f} ours {row['checked_fwd_tflops']:.0f} "
                f"(ratio {row['checked_fwd_ratio']:.3f}) | bwd default {row['default_bwd_tflops']:.0f} ours "
                f"{row['checked_bwd_tflops']:.0f} (ratio {row['checked_bwd_ratio']:.3f}) | invariants "
                f"+{row['invariant_cost_fwd']:.3f} / +{row['invariant_cost_bwd']:.3f} | warp-specialized fwd "
                f"{row['ws_checked_fwd_tflops']:.0f} (ratio {row['ws_checked_fwd_ratio']:.3f}, unchecked "
                f"{row['ws_unchecked_fwd_ratio']:.3f})",
                flush=True,
            )
    summary = {
        "median_fwd_ratio_default": statistics.median(r["checked_fwd_ratio"] for r in rows),
        "median_bwd_ratio_default": statistics.median(r["checked_bwd_ratio"] for r in rows),
        "median_invariant_cost": statistics.median(
            cost for r in rows for cost in (r["invariant_cost_fwd"], r["invariant_cost_bwd"])
        ),
        "median_fwd_ratio_unchecked": statistics.median(r["unchecked_fwd_ratio"] for r in rows),
        "median_bwd_ratio_unchecked": statistics.median(r["unchecked_bwd_ratio"] for r in rows),
        "median_fwd_ratio_ws_checked": statistics.median(r["ws_checked_fwd_ratio"] for r in rows),
        "median_fwd_ratio_ws_unchecked": statistics.median(r["ws_unchecked_fwd_ratio"] for r in rows),
        "median_invariant_cost_fwd_ws": statistics.median(r["invariant_cost_fwd_ws"] for r in rows),
        "targets": TARGETS,
        "ratio": "SDPA default backend time / ours (1 = parity); invariant cost: checked / unchecked - 1",
    }
    summary["targets_met"] = (
        summary["median_fwd_ratio_default"] >= TARGETS["median_fwd_ratio_default"]
        and summary["median_bwd_ratio_default"] >= TARGETS["median_bwd_ratio_default"]
        and summary["median_invariant_cost"] <= TARGETS["median_invariant_cost"]
    )
    env = gpu_environment(seconds=round(time.time() - started, 1), config=dataclasses.asdict(ta.config_for(DIM)),
                          warp_specialized_fwd=dataclasses.asdict(ta.GPU_FWD_WARP_SPECIALIZED))  # fmt: skip
    write_result(args.out, env, rows, summary)


if __name__ == "__main__":
    main()
