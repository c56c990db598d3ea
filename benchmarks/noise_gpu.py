"""Diagnostic (GPU): clean normalized checksum differences of the Triton kernel against the reference
path on the same operands, for operands with and without a common mean (trained weights have
row means; random ones do not), split into the error of the accumulator's row sums and the error of
the reference side (the tensor-core MMA against c's three parts, accumulated in fp32). Prints one line
per case."""

from __future__ import annotations

import torch

from aegis_sdc.kernels import reference as R
from aegis_sdc.kernels import triton_gemm as tg


def case(kind: str, m: int, k: int, n: int, mean: float) -> None:
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    x = (torch.randn(m, k, device=dev) + mean).to(bf16)
    w = ((torch.randn(n, k, device=dev) + mean) / k**0.5).to(bf16)
    A, B = x, w.t()  # the forward orientation
    cfg = tg.default_config()
    out = torch.empty(m, n, device=dev, dtype=bf16)
    stats = torch.zeros(tg.STATS_LEN, dtype=torch.int64, device=dev)
    counters = torch.zeros(m // cfg.block_m + n // cfg.block_n + 2, dtype=torch.int32, device=dev)
    res = tg.launch_checked_gemm(
        x,
        w,
        out,
        a_t=False,
        b_t=True,
        cvec=w.double().sum(0),
        row_check=True,
        row_side=True,
        stats=stats,
        counters=counters,
        row_threshold=1e30,
        cfg=cfg,
    )
    ours = ((stats[0] >> 32).to(torch.int32)).view(torch.float32).item()
    ref = R.checked_gemm(A.cpu(), B.cpu(), out_dtype=bf16)
    ref_val = float(((ref.row_sum - ref.row_ref).abs() / (R.U32 * ref.row_scale)).max())
    # decompose the GPU difference: accumulator sums vs exact, reference side vs exact
    rs = res.row_part.double().sum(0).cpu()
    rv = res.rowref.double().cpu()[None]
    exact_rows = (A.double() @ B.double()).sum(1).cpu()
    exact_ref = A.double().cpu() @ B.double().cpu().sum(1)
    scale = R.U32 * ref.row_scale
    acc_err = float(((rs - exact_rows).abs() / scale).max())
    ref_err = float(((rv[0] - exact_ref).abs() / scale).max())
    cpu_acc_err = float(((ref.row_sum - exact_rows).abs() / scale).max())
    print(
        f"{kind} {m}x{k}x{n} mean {mean}: gpu {ours:.1f}  reference path {ref_val:.1f} | gpu acc-sum err {acc_err:.1f} "
        f"(cpu {cpu_acc_err:.1f}), gpu ref-side err {ref_err:.1f}",
        flush=True,
    )


for k in (2048, 16384):  # the reference side accumulates over all of K in fp32
    for mean in (0.0, 0.1, 1.0):
        case("fwd", 4096, k, 4096, mean)
