"""Checked GEMMs against cuBLAS on the Linear shapes of real models, measured in the same run (GPU).

Models (`MODELS`): TinyLlama-1.1B, Llama-3-8B, Llama-3-70B with tensor parallelism 8 (the shard of one
rank: column-parallel q/kv/gate/up/lm_head split their outputs, row-parallel o/down their inputs),
Qwen2.5-7B, and the lm_head of Qwen2.5-1.5B (vocabulary 151936). Each model's distinct Linear shapes —
query, GQA key/value, attention output, SwiGLU gate/up and down, lm_head — at tokens M ∈ {2048, 8192,
16384}, and each Linear's three GEMMs (forward, dgrad, wgrad). Per case, times of:

    cublas      torch.matmul, the unprotected baseline
    unchecked   our kernel, no check
    row         row checks (the reference side A·c on the tensor cores, in-kernel evidence)
    rowcol      `row+col` in the AEGIS meaning: row checks on forward and dgrad, row and column
                checks on wgrad — the default, and what the summary's rowcol ratios measure
    colopt      forward/dgrad only: the optional column check (its u1 = 1ᵀA pass included)

Two clocks per mode, on random bf16 inputs (Linear-like scales); every checked launch does all its
hot-path work (workspace lookup, descriptors, evidence, threshold compare):

    *_ms        GPU time per call (`common.device_ms`: calls unrolled into a CUDA graph, median of
                its replays). The ratios and the summary's targets use this clock: the kernels'
                speed. (Timed eagerly, a small GEMM measures its launch path instead: cuBLAS's GPU
                time for a GQA projection at 2048 tokens is ~10 µs.)
    *_host_us   host time per call, calls queued without synchronizing: what the call costs the
                training thread (the hot-path issue's budget; `summary.host_us` gives the medians).

The weight's per-step sums (`WeightStats`) are timed per case too (`weight_sums_ms`: once per weight
and step, shared by its forward and dgrad). Ratios are cuBLAS time ÷ ours (1 = parity).

    python benchmarks/gemm.py [--models tinyllama-1.1b,...] [--tokens 2048,8192] [--resume]
                              [--out benchmarks/results/gemm.json]

The record is written after every case: a call cut short keeps what it measured, and `--resume`
continues it (a long run is split over several calls by --models).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import device_ms, gpu_environment, host_us, write_result

from aegis_sdc.kernels import triton_gemm as tg
from aegis_sdc.kernels.gemm_side import SideMatrix
from aegis_sdc.ops.triton_linear import WeightStats

# model → {layer: (in_features K, out_features N)} (one entry per distinct shape)
MODELS = {
    "tinyllama-1.1b": {"q_o": (2048, 2048), "kv": (2048, 256), "gate_up": (2048, 5632), "down": (5632, 2048),
                       "lm_head": (2048, 32000)},
    "llama3-8b": {"q_o": (4096, 4096), "kv": (4096, 1024), "gate_up": (4096, 14336), "down": (14336, 4096),
                  "lm_head": (4096, 128256)},
    "llama3-70b-tp8": {"q": (8192, 1024), "kv": (8192, 128), "o": (1024, 8192), "gate_up": (8192, 3584),
                       "down": (3584, 8192), "lm_head": (8192, 16032)},
    "qwen2.5-7b": {"q_o": (3584, 3584), "kv": (3584, 512), "gate_up": (3584, 18944), "down": (18944, 3584),
                   "lm_head": (3584, 152064)},
    "qwen2.5-1.5b": {"lm_head": (1536, 151936)},
}  # fmt: skip
TOKENS = (2048, 8192, 16384)
TARGETS = {"median_ratio_row": 0.97, "min_ratio_row": 0.93, "median_ratio_rowcol": 0.95, "min_ratio_rowcol": 0.90}


class Case:
    """Operands and preallocated per-call buffers of one (Linear shape, GEMM kind)."""

    def __init__(self, kind: str, m: int, k: int, n: int, dev: str = "cuda", dtype=torch.bfloat16) -> None:
        bf16, f64 = dtype, torch.float64
        x = torch.randn(m, k, device=dev, dtype=bf16)
        w = (torch.randn(n, k, device=dev) / k**0.5).to(bf16)
        dy = (torch.randn(m, n, device=dev) / n**0.5).to(bf16)
        self.kind = kind
        if kind == "fwd":  # Y[M, N] = X·Wᵀ
            self.a, self.b, self.a_t, self.b_t = x, w, False, True
            self.out = torch.empty(m, n, device=dev, dtype=bf16)
            self.cvec = WeightStats.compute(w)[0]
            self.cublas = lambda: torch.matmul(x, w.t())
        elif kind == "dgrad":  # dX[M, K] = dY·W
            self.a, self.b, self.a_t, self.b_t = dy, w, False, False
            self.out = torch.empty(m, k, device=dev, dtype=bf16)
            self.cvec = WeightStats.compute(w)[1]
            self.cublas = lambda: torch.matmul(dy, w)
        else:  # dW[N, K] = dYᵀ·X: c = X·1, u1 = dY·1 (by-products of a checked forward / dgrad)
            self.a, self.b, self.a_t, self.b_t = dy, x, True, False
            self.out = torch.empty(n, k, device=dev, dtype=bf16)
            self.cvec = x.sum(1, dtype=f64)
            self.u1 = dy.sum(1, dtype=f64)
            self.cublas = lambda: torch.matmul(dy.t(), x)
        self.weight = w
        # S matrices of the vectors, as the training step keeps them (once per weight and step; the
        # wgrad's from its forward's and dgrad's launches)
        self.c_side = SideMatrix.of(self.cvec, bf16)
        self.u_side = SideMatrix.of(self.u1 if kind == "wgrad" else self.a.sum(0, dtype=f64), bf16)
        mm, nn = self.out.shape
        kred = self.a.shape[0] if self.a_t else self.a.shape[1]
        self.shape = (mm, nn, kred)
        self.cfg = tg.config_for(mm, nn, kred)
        self.stats = torch.zeros(tg.STATS_LEN, dtype=torch.int64, device=dev)
        self.counters = torch.zeros(tg.counters_needed(mm, nn, self.cfg), dtype=torch.int32, device=dev)
        self.pools = {
            capture: tg.CapturePool.allocate(4, *tg.CapturePool.layout(mm, nn, kred, capture, self.cfg), bf16, dev)
            for capture in (tg.CAPTURE_ROWS, tg.CAPTURE_TILE)
        }
        self.flops = 2 * m * k * n

    def ours(self, mode: str, cfg: tg.TritonGemmConfig | None = None, launch: Callable | None = None):
        """Our launch for `mode` (see the module docstring), at the shape's configuration or `cfg`;
        `launch`: another module's launch_checked_gemm (a diagnostic's patched kernel)."""
        cfg = cfg or self.cfg
        launch = launch or tg.launch_checked_gemm
        if mode == "unchecked":
            return lambda: launch(self.a, self.b, self.out, a_t=self.a_t, b_t=self.b_t, cfg=cfg)
        col = mode == "colopt" or (mode == "rowcol" and self.kind == "wgrad")
        capture = tg.CAPTURE_TILE if col else tg.CAPTURE_ROWS

        def run() -> None:
            u_side = None
            if col:  # wgrad: a by-product of the dgrad; forward/dgrad: the option's own pass over A
                u_side = self.u_side
                if self.kind != "wgrad":
                    u_side = SideMatrix.of(self.a.sum(0, dtype=torch.float64), self.a.dtype)
            launch(
                self.a, self.b, self.out, a_t=self.a_t, b_t=self.b_t, c_side=self.c_side, u_side=u_side,
                row_check=True, row_side=True, col_check=col, stats=self.stats, counters=self.counters,
                pool=self.pools[capture], capture=capture,
                row_threshold=1e30, col_threshold=1e30,  # timing: no alarm, so no capture copy (rare path)
                cfg=cfg, scratch=True,
            )  # fmt: skip

        return run


def verify(case: Case) -> float:
    """Relative error of our output against cuBLAS's (both bf16): a sanity check of every case."""
    ref = case.cublas().float()
    case.ours("rowcol")()
    return float((case.out.float() - ref).norm() / ref.norm())


def summarize(rows: list[dict]) -> dict:
    def ratios(key: str, kind: str | None = None) -> list[float]:
        return [r[key] for r in rows if key in r and (kind is None or r["gemm"] == kind)]

    summary = {
        "median_ratio_row": statistics.median(ratios("row_ratio")),
        "min_ratio_row": min(ratios("row_ratio")),
        "median_ratio_rowcol": statistics.median(ratios("rowcol_ratio")),
        "min_ratio_rowcol": min(ratios("rowcol_ratio")),
        "median_ratio_unchecked": statistics.median(ratios("unchecked_ratio")),
        "median_ratio_colopt": statistics.median(ratios("colopt_ratio")) if ratios("colopt_ratio") else None,
        "per_gemm": {
            kind: {mode: statistics.median(ratios(f"{mode}_ratio", kind)) for mode in ("unchecked", "row", "rowcol")}
            for kind in ("fwd", "dgrad", "wgrad")
            if ratios("row_ratio", kind)
        },
        "host_us": {
            mode: statistics.median(r[f"{mode}_host_us"] for r in rows if f"{mode}_host_us" in r)
            for mode in ("cublas", "unchecked", "row", "rowcol")
            if any(f"{mode}_host_us" in r for r in rows)
        },
        "cases": len(rows),
        "below_target": [
            f"{r['model']}.{r['layer']} M={r['M']} {r['gemm']}: row {r['row_ratio']:.3f} rowcol {r['rowcol_ratio']:.3f}"
            for r in rows
            if r["row_ratio"] < TARGETS["min_ratio_row"] or r["rowcol_ratio"] < TARGETS["min_ratio_rowcol"]
        ],
        "targets": TARGETS,
        "ratio": "cuBLAS GPU time / our GPU time (CUDA-graph replays), same run (1.0 = parity, > 1 faster)",
    }
    summary["targets_met"] = all(summary[key] >= value for key, value in TARGETS.items())
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated M values")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gemm.json")
    parser.add_argument("--resume", action="store_true", help="keep the cases already in --out, run the rest")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter (checks the script)")
    args = parser.parse_args()
    if args.smoke:
        smoke()
        return
    models = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = [name for name in models if name not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    tokens = [int(t) for t in args.tokens.split(",")]
    rows: list[dict] = []
    earlier: list[dict] = []
    if args.resume and args.out.exists():
        record = json.loads(args.out.read_text())
        rows = record["rows"]
        previous = {key: value for key, value in record["env"].items() if key != "earlier_calls"}
        earlier = [*record["env"].get("earlier_calls", []), previous]
    rows = [r for r in rows if "model" in r]  # a record of another layout is not resumed
    done = {(r["model"], r["layer"], r["M"], r["gemm"]) for r in rows}
    torch.manual_seed(0)
    started = time.time()
    for model in models:
        for layer, (k, n) in MODELS[model].items():
            for m in tokens:
                for kind in ("fwd", "dgrad", "wgrad"):
                    if (model, layer, m, kind) in done:
                        continue
                    rows.append(measure(model, layer, m, k, n, kind, args))
                    env = gpu_environment(
                        sms=torch.cuda.get_device_properties(0).multi_processor_count,
                        table={name: cfg.__dict__ for name, cfg in tg.HOPPER_TABLE.items()},
                        seconds=round(time.time() - started, 1),
                        earlier_calls=earlier,
                    )
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=2))
    env = gpu_environment(
        sms=torch.cuda.get_device_properties(0).multi_processor_count,
        table={name: cfg.__dict__ for name, cfg in tg.HOPPER_TABLE.items()},
        seconds=round(time.time() - started, 1),
        earlier_calls=earlier,
    )
    write_result(args.out, env, rows, summarize(rows))


def measure(model: str, layer: str, m: int, k: int, n: int, kind: str, args) -> dict:
    case = Case(kind, m, k, n)
    row = {"model": model, "layer": layer, "M": m, "K": k, "N": n, "gemm": kind,
           "shape_class": tg.shape_class(*case.shape), "rel_err_vs_cublas": verify(case)}  # fmt: skip
    modes = ["cublas", "unchecked", "row", "rowcol"] + (["colopt"] if kind != "wgrad" else [])
    times = {}
    for mode in modes:
        fn = case.cublas if mode == "cublas" else case.ours(mode)
        times[mode] = device_ms(fn)
        row[f"{mode}_ms"] = times[mode]
        if mode != "colopt":
            row[f"{mode}_host_us"] = host_us(fn)
        row[f"{mode}_tflops"] = case.flops / times[mode] / 1e9
    for mode in modes[1:]:
        row[f"{mode}_ratio"] = times["cublas"] / times[mode]
    if kind != "wgrad":
        weight = case.weight
        row["weight_sums_ms"] = device_ms(lambda: WeightStats.compute(weight))
    print(
        f"{model:15s} {layer:8s} M={m:5d} {kind:5s} cuBLAS {row['cublas_tflops']:6.1f} TF/s | unchecked "
        f"{row['unchecked_ratio']:.3f} | row {row['row_ratio']:.3f} | rowcol {row['rowcol_ratio']:.3f} "
        f"| {row['shape_class']} | err {row['rel_err_vs_cublas']:.1e}",
        flush=True,
    )
    del case
    torch.cuda.empty_cache()
    return row


def smoke() -> None:
    """Every mode of every GEMM kind once at a tiny shape (TRITON_INTERPRET=1, fp16): the script's
    logic checked where no GPU is, before device time is spent on it."""
    for kind in ("fwd", "dgrad", "wgrad"):
        case = Case(kind, 64, 48, 96, dev="cpu", dtype=torch.float16)
        err = verify(case)
        for mode in ("unchecked", "row", "rowcol") + (("colopt",) if kind != "wgrad" else ()):
            case.ours(mode)()
        assert int(case.stats[tg.ST_ALARM]) == 0 and int(case.counters.abs().sum()) == 0
        print(f"smoke {kind}: rel err vs torch {err:.1e}, class {tg.shape_class(*case.shape)}")


if __name__ == "__main__":
    main()
