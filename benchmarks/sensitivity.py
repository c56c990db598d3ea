"""Sensitivity of the accumulator checksums: the AEGIS fault-injection experiment, on the GPU kernel.

For each GEMM of a Linear (forward, dgrad, wgrad) at three shape classes of real models — a square
projection, a GQA key/value projection (N = 256) and an lm_head (vocabulary 32000) — with fresh random
bf16 operands on every call:

1. calibrate as the guard does: threshold = 4 × the median of the first 16 clean values of the
   normalized row statistic (for the fp32-accumulator checksum and, separately, for the same
   checksum taken from the bf16 output);
2. m = the median over ≥ 500 clean calls of ‖(AB)·1 − A·(B·1)‖₂ from the fp32 accumulator;
3. add ±r·m to one random accumulator element (before checksum and rounding), 100 repeats per r;
   a fault is detected when the call's statistic exceeds the threshold — the row statistic, and on
   wgrad also the column statistic (the default `row+col` checks wgrad's columns; its own threshold);
4. count false alarms over ≥ 10⁴ clean calls.

    python benchmarks/sensitivity.py [--out benchmarks/results/sensitivity.json] [--smoke] [--plots DIR]
    python benchmarks/sensitivity.py --replot benchmarks/results/sensitivity.json --plots docs/campaign

`--plots` draws `gemm_fp32_vs_bf16_output.png` (AEGIS Fig. 16): detection against r for the checksum
of the fp32 accumulator and for the same checksum of the rounded bf16 output, a panel per GEMM kind,
a line per shape class.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import struct
import sys
import time
from pathlib import Path

import torch
import triton

from aegis_sdc.config import ThresholdConfig
from aegis_sdc.kernels import triton_gemm as tg

U32 = 2.0**-24
R_VALUES = (0.25, 0.5, 1, 2, 4, 16, 1e2, 1e3, 1e4, 1e5)
# (tokens M, in-features K, out-features N) of a Linear; each class's three GEMMs are studied.
SHAPE_CLASSES = {
    "square": (4096, 4096, 4096),  # Llama-3-8B attention output projection
    "gqa-narrow": (4096, 4096, 256),  # a key/value projection with 2 KV heads of 128 (TinyLlama: 4 × 64)
    "lm_head": (2048, 2048, 32000),  # TinyLlama's vocabulary
}


class Gemm:
    """One GEMM kind with preallocated operands that are refilled with random values per call."""

    def __init__(self, kind: str, m: int, k: int, n: int, device: str) -> None:
        self.kind, self.device = kind, device
        bf16 = torch.bfloat16
        self.x = torch.empty(m, k, device=device, dtype=bf16)
        self.w = torch.empty(n, k, device=device, dtype=bf16)
        self.dy = torch.empty(m, n, device=device, dtype=bf16)
        shape = {"fwd": (m, n), "dgrad": (m, k), "wgrad": (n, k)}[kind]
        self.out = torch.empty(*shape, device=device, dtype=bf16)
        reduction = {"fwd": k, "dgrad": n, "wgrad": m}[kind]
        cfg = tg.config_for(*shape, reduction)  # the launch's own configuration (its shape class)
        self.counters = torch.zeros(tg.counters_needed(*shape, cfg), dtype=torch.int32, device=device)

    def refill(self) -> None:
        self.x.normal_()
        self.w.normal_().mul_(self.x.shape[1] ** -0.5)
        self.dy.normal_()

    def run(self, fault=None) -> tuple[float, float, float, float]:
        """(fp32-accumulator row statistic, column statistic — wgrad, which checks both — the row
        statistic from the bf16 output, raw row L2) of one call."""
        f64 = torch.float64
        x, w, dy = self.x, self.w, self.dy
        if self.kind == "fwd":
            a, b, a_t, b_t, bmat = x, w, False, True, w.t()
        elif self.kind == "dgrad":
            a, b, a_t, b_t, bmat = dy, w, False, False, w
        else:
            a, b, a_t, b_t, bmat = dy, x, True, False, x
        cvec = bmat.sum(dim=1, dtype=f64)
        col = self.kind == "wgrad"  # the default `row+col`: columns on wgrad only
        u1 = dy.sum(dim=1, dtype=f64) if col else None  # 1ᵀA for A = dYᵀ
        stats = torch.zeros(tg.STATS_LEN, dtype=torch.int64, device=self.device)
        result = tg.launch_checked_gemm(
            a, b, self.out, a_t=a_t, b_t=b_t, cvec=cvec, u1=u1, row_check=True, row_side=True, col_check=col,
            stats=stats, counters=self.counters, row_threshold=1e30, col_threshold=1e30, fault=fault,
        )  # fmt: skip
        raw = stats.tolist()
        value = struct.unpack("<f", struct.pack("<I", (raw[tg.ST_ROW] >> 32) & 0xFFFFFFFF))[0]
        col_value = struct.unpack("<f", struct.pack("<I", (raw[tg.ST_COL] >> 32) & 0xFFFFFFFF))[0] if col else 0.0
        l2 = struct.unpack("<d", struct.pack("<q", raw[tg.ST_ROW_L2SQ]))[0] ** 0.5
        # The same checksum from the rounded bf16 output: Σ_j out_ij against A·(B·1), same scale.
        scale = U32 * result.rsq_part.double().sum(dim=0).sqrt()
        bf16_value = float(((self.out.double().sum(dim=1) - result.rowref).abs() / scale.clamp_min(1e-300)).max())
        return value, col_value, bf16_value, l2


def study(kind: str, shape: tuple[int, int, int], device: str, clean_for_m: int, clean_calls: int, repeats: int):
    torch.manual_seed(0)
    rng = random.Random(0)
    gemm = Gemm(kind, *shape, device=device)
    margin = ThresholdConfig().margin
    calib32, calib_col, calib16 = [], [], []
    for _ in range(ThresholdConfig().calibration_checks):
        gemm.refill()
        v32, vcol, v16, _ = gemm.run()
        calib32.append(v32)
        calib_col.append(vcol)
        calib16.append(v16)
    thr32, thr16 = margin * statistics.median(calib32), margin * statistics.median(calib16)
    thr_col = margin * statistics.median(calib_col) if kind == "wgrad" else float("inf")
    l2s = []
    for _ in range(clean_for_m):
        gemm.refill()
        l2s.append(gemm.run()[3])
    m = statistics.median(l2s)
    false_alarms = false_alarms_bf16 = 0
    clean_max = 0.0
    for i in range(clean_calls):
        gemm.refill()
        v32, vcol, v16, _ = gemm.run()
        false_alarms += v32 > thr32 or vcol > thr_col
        clean_max = max(clean_max, v32 / thr32, vcol / thr_col)
        if i < 1000:
            false_alarms_bf16 += v16 > thr16
    rows, cols = gemm.out.shape
    detection = {}
    for r in R_VALUES:
        hits32 = hits16 = 0
        for _ in range(repeats):
            gemm.refill()
            sign = 1.0 if rng.random() < 0.5 else -1.0
            fault = (tg.FAULT_PERTURB, rng.randrange(rows), rng.randrange(cols), sign * r * m, 0)
            v32, vcol, v16, _ = gemm.run(fault)
            hits32 += v32 > thr32 or vcol > thr_col
            hits16 += v16 > thr16
        detection[str(r)] = {"fp32_accumulator": hits32 / repeats, "bf16_output": hits16 / repeats}
        print(f"{kind:5s} r={r:<8g} fp32 {hits32 / repeats:.2f}  bf16-output {hits16 / repeats:.2f}", flush=True)
    bf16_r99 = next((r for r in R_VALUES if detection[str(r)]["bf16_output"] >= 0.99), None)
    return {
        "gemm": kind,
        "shape_MKN": shape,
        "threshold_fp32": thr32,
        "threshold_bf16_output": thr16,
        "median_clean_l2_m": m,
        "clean_calls": clean_calls,
        "false_alarms": false_alarms,
        "threshold_fp32_col": thr_col,
        "clean_max_over_threshold": clean_max,
        "false_alarms_bf16_output_first_1000": false_alarms_bf16,
        "detection": detection,
        "bf16_r_for_99": bf16_r99,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sensitivity.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and counts (CPU interpreter check)")
    parser.add_argument("--clean-calls", type=int, default=3_400, help="clean calls per case (9 cases: ≥ 3×10⁴ in all)")
    parser.add_argument("--plots", type=Path, default=None, help="draw the detection plot into this folder")
    parser.add_argument("--replot", type=Path, default=None, help="draw the plot of this stored record and stop")
    args = parser.parse_args()
    if args.replot is not None:
        print(plot(json.loads(args.replot.read_text()), args.plots or Path(".")))
        return
    if args.smoke:
        device, clean_for_m, clean_calls, repeats = "cpu", 20, 30, 4
        shapes = {"square": (64, 48, 96)}
    else:
        device, clean_for_m, clean_calls, repeats = "cuda", 500, args.clean_calls, 100
        shapes = SHAPE_CLASSES
    started = time.time()
    rows = []
    for shape_class, shape in shapes.items():
        for kind in ("fwd", "dgrad", "wgrad"):
            row = study(kind, shape, device, clean_for_m, clean_calls, repeats)
            rows.append({"shape_class": shape_class, **row})
    summary = {
        "fp32_detection_at_r1": min(r["detection"]["1"]["fp32_accumulator"] for r in rows),
        "clean_calls": sum(r["clean_calls"] for r in rows),
        "false_alarms": sum(r["false_alarms"] for r in rows),
        "bf16_r_for_99": max((r["bf16_r_for_99"] or float("inf")) for r in rows),
        "per_case_fp32_detection_at_r1": {
            f"{r['shape_class']}.{r['gemm']}": r["detection"]["1"]["fp32_accumulator"] for r in rows
        },
        "per_case_bf16_r_for_99": {f"{r['shape_class']}.{r['gemm']}": r["bf16_r_for_99"] for r in rows},
    }
    env = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(["python", *sys.argv]),
           "seconds": round(time.time() - started, 1)}  # fmt: skip
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"env": env, "rows": rows, "summary": summary}
    args.out.write_text(json.dumps(doc, indent=2))
    if args.plots is not None:
        plot(doc, args.plots)
    print(json.dumps(summary, indent=2))


def plot(doc: dict, out_dir: Path) -> Path:
    """Detection against r (× the median clean checksum difference m) per GEMM kind: the fp32
    accumulator's checksum (solid) beside the rounded bf16 output's (dashed), a colour per shape class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ("fwd", "dgrad", "wgrad")
    sources = (("fp32_accumulator", "-", "fp32 accumulator"), ("bf16_output", "--", "bf16 output"))
    classes = sorted({r["shape_class"] for r in doc["rows"]})
    colours = dict(zip(classes, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), sharey=True)
    for ax, kind in zip(axes, kinds, strict=True):
        for row in (r for r in doc["rows"] if r["gemm"] == kind):
            rs = sorted(row["detection"], key=float)
            x = [float(r) for r in rs]
            for source, style, name in sources:
                ax.plot(x, [row["detection"][r][source] for r in rs], style, marker="o", markersize=3,
                        color=colours[row["shape_class"]], label=f"{row['shape_class']}, {name}")  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("r (× median clean checksum difference)")
        ax.set_title(kind)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("detected")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"One accumulator element off by r·m, {doc['env'].get('gpu', doc['env']['device'])}: "
                 "checksum of the fp32 accumulator vs of the rounded bf16 output", fontsize=9)  # fmt: skip
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gemm_fp32_vs_bf16_output.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
