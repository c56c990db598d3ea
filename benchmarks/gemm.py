"""Checked GEMMs against cuBLAS, measured in the same run (GPU).

For tokens M ∈ {4096, 16384} and the Linear layers of a Llama-3-8B block (hidden 4096) and a
Llama-3-70B block (hidden 8192), plus 8192³: forward, dgrad and wgrad each, timed for
cuBLAS (`torch.matmul`), our kernel unchecked, checked `row`, and checked `row+col`.
Times are `triton.testing.do_bench` medians on random bf16 inputs; every checked launch does all
its hot-path work (workspace allocation, reference-side reductions, evidence, threshold compare).

    python benchmarks/gemm.py [--quick] [--out benchmarks/results/gemm.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import triton
from common import gpu_environment, write_result
from triton.testing import do_bench

from aegis_sdc.kernels import triton_gemm as tg

LAYERS = {  # name: (in_features K, out_features N)
    "8b.qkv": (4096, 6144),
    "8b.out": (4096, 4096),
    "8b.gate_up": (4096, 14336),
    "8b.down": (14336, 4096),
    "70b.qkv": (8192, 10240),
    "70b.out": (8192, 8192),
    "70b.gate_up": (8192, 28672),
    "70b.down": (28672, 8192),
}


def shapes(quick: bool) -> list[tuple[str, int, int, int]]:
    rows = [(name, m, k, n) for m in (4096, 16384) for name, (k, n) in LAYERS.items()]
    rows.append(("cube", 8192, 8192, 8192))
    if quick:
        rows = [r for r in rows if r[0] in ("8b.out", "8b.gate_up", "cube") and r[1] in (4096, 8192)]
    return rows


class Case:
    """Operands and preallocated per-call buffers of one (Linear shape, GEMM kind)."""

    def __init__(self, kind: str, m: int, k: int, n: int) -> None:
        dev, bf16 = "cuda", torch.bfloat16
        x = torch.randn(m, k, device=dev, dtype=bf16)
        w = torch.randn(n, k, device=dev, dtype=bf16) / k**0.5
        dy = torch.randn(m, n, device=dev, dtype=bf16)
        f32, f64 = torch.float32, torch.float64
        if kind == "fwd":  # Y[M, N] = X·Wᵀ
            self.a, self.b, self.a_t, self.b_t = x, w, False, True
            self.out = torch.empty(m, n, device=dev, dtype=bf16)
            self.cvec, self.beta = w.sum(0, dtype=f64), torch.linalg.vector_norm(w, dim=0, dtype=f32) ** 2
            self.u1 = self.u2 = None
            self.cublas = lambda: torch.matmul(x, w.t())
        elif kind == "dgrad":  # dX[M, K] = dY·W
            self.a, self.b, self.a_t, self.b_t = dy, w, False, False
            self.out = torch.empty(m, k, device=dev, dtype=bf16)
            self.cvec, self.beta = w.sum(1, dtype=f64), torch.linalg.vector_norm(w, dim=1, dtype=f32) ** 2
            self.u1 = self.u2 = None
            self.cublas = lambda: torch.matmul(dy, w)
        else:  # dW[N, K] = dYᵀ·X
            self.a, self.b, self.a_t, self.b_t = dy, x, True, False
            self.out = torch.empty(n, k, device=dev, dtype=bf16)
            self.cvec, self.beta = x.sum(1, dtype=f64), torch.linalg.vector_norm(x, dim=1, dtype=f32) ** 2
            self.u1, self.u2 = dy.sum(1, dtype=f64), torch.linalg.vector_norm(dy, dim=1, dtype=f32) ** 2
            self.cublas = lambda: torch.matmul(dy.t(), x)
        cfg = tg.default_config()
        mm, nn = self.out.shape
        self.stats = torch.zeros(tg.STATS_LEN, dtype=torch.int64, device=dev)
        self.counters = torch.zeros(
            triton.cdiv(mm, cfg.block_m) + triton.cdiv(nn, cfg.block_n) + 1, dtype=torch.int32, device=dev
        )
        kred = self.a.shape[0] if self.a_t else self.a.shape[1]
        capture = tg.CAPTURE_TILE if kind == "wgrad" else tg.CAPTURE_ROWS
        self.pool = tg.CapturePool.allocate(4, *tg.CapturePool.layout(mm, nn, kred, capture, cfg), bf16, dev)
        self.capture = capture
        self.flops = 2 * m * k * n

    def ours(self, mode: str):
        if mode in ("partials", "row-noev"):  # diagnostics: the row check without its evidence stage
            return lambda: tg.launch_checked_gemm(
                self.a, self.b, self.out, a_t=self.a_t, b_t=self.b_t, cvec=self.cvec, beta=self.beta,
                row_check=True, row_side=mode == "row-noev", evidence=False,
            )  # fmt: skip
        checked = mode != "unchecked"
        col = mode == "row+col"
        return lambda: tg.launch_checked_gemm(
            self.a,
            self.b,
            self.out,
            a_t=self.a_t,
            b_t=self.b_t,
            cvec=self.cvec,
            beta=self.beta,
            u1=self.u1 if col else None,
            u2=self.u2 if col else None,
            row_check=checked,
            row_side=checked,
            col_check=col,
            stats=self.stats if checked else None,
            counters=self.counters if checked else None,
            pool=self.pool if checked else None,
            capture=self.capture if checked else tg.CAPTURE_NONE,
            row_threshold=1e30,  # timing: no alarm, so no capture copy (the alarm path is rare)
            col_threshold=1e30,
            # A·1 and ‖A_i‖² are by-products a forward/dgrad computes for the wgrad's check: counted
            # with the wgrad (whose c, β, u1, u2 are given here), not twice.
            byproducts=False,
        )


def verify(case: Case) -> float:
    """Relative error of our output against cuBLAS's (both bf16): a sanity check of every case."""
    ref = case.cublas().float()
    case.ours("row+col")()
    return float((case.out.float() - ref).norm() / ref.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three shapes only")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gemm.json")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    started = time.time()
    for name, m, k, n in shapes(args.quick):
        for kind in ("fwd", "dgrad", "wgrad"):
            case = Case(kind, m, k, n)
            err = verify(case)
            row = {"layer": name, "M": m, "K": k, "N": n, "gemm": kind, "rel_err_vs_cublas": err}
            times = {}
            for variant, fn in (
                ("cublas", case.cublas),
                ("unchecked", case.ours("unchecked")),
                ("row", case.ours("row")),
                ("row+col", case.ours("row+col")),
            ):
                ms = do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")
                times[variant] = ms
                row[f"{variant}_ms"] = ms
                row[f"{variant}_tflops"] = case.flops / ms / 1e9
            for variant in ("unchecked", "row", "row+col"):
                row[f"{variant}_ratio"] = times["cublas"] / times[variant]  # > 1: faster than cuBLAS
            rows.append(row)
            print(
                f"{name:12s} M={m:5d} {kind:5s} cuBLAS {row['cublas_tflops']:6.1f} TF/s | ours "
                f"{row['unchecked_ratio']:.3f} | row {row['row_ratio']:.3f} | row+col {row['row+col_ratio']:.3f} "
                f"| err {err:.1e}",
                flush=True,
            )
            del case
            torch.cuda.empty_cache()

    def median(key, kind=None):
        return statistics.median(r[key] for r in rows if kind is None or r["gemm"] == kind)

    summary = {
        "median_ratio_row": median("row_ratio"),
        "median_ratio_rowcol": median("row+col_ratio"),
        "median_ratio_unchecked": median("unchecked_ratio"),
        "per_gemm": {
            kind: {mode: median(f"{mode}_ratio", kind) for mode in ("unchecked", "row", "row+col")}
            for kind in ("fwd", "dgrad", "wgrad")
        },
        "cases": len(rows),
        "ratio": "cuBLAS time / our time, same run (1.0 = parity, > 1 faster)",
    }
    env = gpu_environment(
        sms=torch.cuda.get_device_properties(0).multi_processor_count,
        config=tg.default_config().__dict__,
        seconds=round(time.time() - started, 1),
    )
    write_result(args.out, env, rows, summary)


if __name__ == "__main__":
    main()
