"""Choose the checked GEMM's configuration per shape class on the GPU (the table in kernels/triton_gemm.py).

For every shape class (`triton_gemm.shape_class`) the GEMMs of `gemm.MODELS` that fall in it (at the
token counts given) are timed, checked as the training step checks them (`rowcol`: row checks, plus
columns on wgrad), under each candidate configuration (GPU time, `common.device_ms`); the
candidate with the best geometric mean of cuBLAS time ÷ ours wins. Writes every timing and the
winners to JSON and prints the table to paste into `HOPPER_TABLE`. A configuration changes which
bits a tile computes: the table is fixed in the code, never chosen at run time.

    python benchmarks/gemm_tune.py [--classes narrow-n,...] [--tokens 2048,8192] [--out ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch
from common import device_ms, gpu_environment
from gemm import MODELS, Case

from aegis_sdc.kernels import triton_gemm as tg

BASE = tg.HOPPER_CONFIG
CANDIDATES = {
    "128x256x64 w8 s3": BASE,
    "128x256x64 w8 s4": dataclasses.replace(BASE, num_stages=4),
    "128x128x64 w8 s4": dataclasses.replace(BASE, block_n=128, num_stages=4),
    "128x128x64 w4 s4": dataclasses.replace(BASE, block_n=128, num_warps=4, num_stages=4),
    "64x256x64 w4 s4": dataclasses.replace(BASE, block_m=64, num_warps=4, num_stages=4),
    "64x128x64 w4 s4": dataclasses.replace(BASE, block_m=64, block_n=128, num_warps=4, num_stages=4),
    "64x64x64 w4 s5": dataclasses.replace(BASE, block_m=64, block_n=64, num_warps=4, num_stages=5),
}


def cases_by_class(tokens: list[int]) -> dict[str, list[tuple[str, int, int, int, str]]]:
    """shape class → [(label, tokens M, in-features K, out-features N, GEMM kind)]: the models' GEMMs
    in that class, one per distinct (kind, shape)."""
    out: dict[str, list[tuple[str, int, int, int, str]]] = {}
    seen = set()
    for model, layers in MODELS.items():
        for layer, (k, n) in layers.items():
            for m in tokens:
                # the GEMM's C [rows, cols] and reduction length, as `Case.shape`
                for kind, shape in (("fwd", (m, n, k)), ("dgrad", (m, k, n)), ("wgrad", (n, k, m))):
                    if (kind, shape) not in seen:
                        seen.add((kind, shape))
                        label = f"{model}.{layer} M={m} {kind}"
                        out.setdefault(tg.shape_class(*shape), []).append((label, m, k, n, kind))
    return out


def compiled_kernels() -> list[dict]:
    """Registers and spills of every compiled variant of the checked GEMM (a spilling variant is slow)."""
    kernels = []
    for device_cache in tg.checked_gemm_kernel.device_caches.values():
        for compiled in device_cache[0].values():
            kernels.append(
                {"n_regs": getattr(compiled, "n_regs", None), "n_spills": getattr(compiled, "n_spills", None)}
            )
    return kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", default=",".join(tg.HOPPER_TABLE), help="comma-separated shape classes")
    parser.add_argument("--tokens", default="2048,8192", help="comma-separated M values")
    parser.add_argument("--max-cases", type=int, default=6, help="cases per class, spread over its FLOPs range")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gemm_tune.json")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    classes = cases_by_class(tokens)
    started = time.time()
    record = json.loads(args.out.read_text()) if args.out.exists() else {"rows": [], "winners": {}}
    for cls in args.classes.split(","):
        ordered = sorted(classes.get(cls, []), key=lambda c: c[1] * c[2] * c[3])
        cases = ordered[:: max(1, len(ordered) // args.max_cases)][: args.max_cases]
        scores: dict[str, list[float]] = {name: [] for name in CANDIDATES}
        for label, m, k, n, kind in cases:
            case = Case(kind, m, k, n)
            cublas = device_ms(case.cublas)
            for name, cfg in CANDIDATES.items():
                tg.set_config(cfg)
                try:
                    case.counters = torch.zeros(tg.counters_needed(*case.shape[:2], cfg), dtype=torch.int32,
                                                device="cuda")  # fmt: skip
                    case.cfg = cfg
                    case.pools = {c: tg.CapturePool.allocate(4, *tg.CapturePool.layout(*case.shape, c, cfg),
                                                             torch.bfloat16, "cuda")
                                  for c in (tg.CAPTURE_ROWS, tg.CAPTURE_TILE)}  # fmt: skip
                    ms = device_ms(case.ours("rowcol"))
                    ratio = cublas / ms
                except Exception as error:  # a configuration that does not compile or fit: out
                    ms, ratio = None, 0.0
                    print(f"  {name}: {type(error).__name__}: {str(error)[:120]}", flush=True)
                finally:
                    tg.set_config(None)
                scores[name].append(ratio)
                record["rows"].append({"class": cls, "case": label, "config": name, "ms": ms, "cublas_ms": cublas,
                                       "ratio": ratio})  # fmt: skip
            print(f"{cls:10s} {label:40s} " + " ".join(f"{r:.3f}" for r in (s[-1] for s in scores.values())),
                  flush=True)  # fmt: skip
            del case
            torch.cuda.empty_cache()
        if cases:
            geo = {name: math.exp(sum(math.log(max(r, 1e-9)) for r in rs) / len(rs)) for name, rs in scores.items()}
            best = max(geo, key=geo.get)
            record["winners"][cls] = {"config": best, "geomean_ratio": geo[best], "all": geo,
                                      "fields": CANDIDATES[best].__dict__}  # fmt: skip
            print(f"{cls}: {best} (geomean {geo[best]:.3f})", flush=True)
        record["env"] = gpu_environment(seconds=round(time.time() - started, 1), candidates=list(CANDIDATES))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2))
    record["kernels"] = compiled_kernels()
    args.out.write_text(json.dumps(record, indent=2))
    print("compiled kernels (registers, spills):", [(k["n_regs"], k["n_spills"]) for k in record["kernels"]])
    print("HOPPER_TABLE = {")
    for cls, win in record["winners"].items():
        print(f'    "{cls}": TritonGemmConfig(**{win["fields"]}),  # {win["config"]}: {win["geomean_ratio"]:.3f}')
    print("}")


if __name__ == "__main__":
    main()
