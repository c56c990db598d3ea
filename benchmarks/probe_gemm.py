"""Tuning probe for the checked GEMM (GPU): kernel variants and configs at a few shapes, one run.

Prints cuBLAS / ours ratios for unchecked, row and row+col launches under several
`TritonGemmConfig`s, and the registers / spills of the compiled kernels; writes the table as JSON.

    python benchmarks/probe_gemm.py --out benchmarks/results/probe_gemm.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from common import gpu_environment, write_result
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).parent))
from gemm import Case

from aegis_sdc.kernels import triton_gemm as tg

CONFIGS = {
    "128x256x64/s3/w8": tg.TritonGemmConfig(),
}
SHAPES = [("8b.gate_up", 4096, 4096, 14336), ("8b.out", 16384, 4096, 4096)]
MODES = ("unchecked", "partials", "row-noev", "row", "row+col")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "probe_gemm.json")
    parser.add_argument("--rep", type=int, default=40)
    args = parser.parse_args()
    rows = []
    for name, m, k, n in SHAPES:
        for kind in ("fwd", "dgrad", "wgrad"):
            for label, cfg in CONFIGS.items():
                tg.set_config(cfg)
                try:
                    case = Case(kind, m, k, n)
                    cublas = do_bench(case.cublas, warmup=10, rep=args.rep, return_mode="median")
                    row = {"layer": name, "M": m, "K": k, "N": n, "gemm": kind, "config": label}
                    for mode in MODES:
                        ms = do_bench(case.ours(mode), warmup=10, rep=args.rep, return_mode="median")
                        row[mode] = cublas / ms
                    rows.append(row)
                    print(f"{name:10s} {kind:5s} " + " ".join(f"{m} {row[m]:.3f}" for m in MODES), flush=True)
                except Exception as error:  # a config that does not compile or fit is a result too
                    print(
                        f"{name:10s} {kind:5s} {label:24s} FAILED {type(error).__name__}: {str(error)[:200]}",
                        flush=True,
                    )
                    rows.append({"layer": name, "gemm": kind, "config": label, "error": str(error)[:500]})
                finally:
                    tg.set_config(None)
    kernels = []
    for device_cache in tg.checked_gemm_kernel.device_caches.values():
        for compiled in device_cache[0].values():
            kernels.append(
                {"n_regs": getattr(compiled, "n_regs", None), "n_spills": getattr(compiled, "n_spills", None)}
            )
    print("compiled kernels (regs, spills):", [(k["n_regs"], k["n_spills"]) for k in kernels])
    env = gpu_environment(configs={k: dataclasses.asdict(v) for k, v in CONFIGS.items()})
    write_result(args.out, env, rows, kernels=kernels)


if __name__ == "__main__":
    main()
