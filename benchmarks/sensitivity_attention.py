"""Sensitivity of the attention invariants: the AEGIS fault-injection experiment on the reference op.

For the forward invariant (O·1 against P·(V·1)) and the backward invariant (1ᵀdV against 1ᵀdO), with
fresh random q, k, v, dO on every call (causal, fp32 inputs: the reference path's accumulation):

1. calibrate as the guard does: threshold = 4 × the median of the first 16 clean values of the
   normalized statistic (the largest over the heads of a call);
2. m = the median over ≥ 500 clean calls of the raw difference ‖·‖₂ of one head;
3. add ±r·m to one random accumulator element of one random head (O before rounding, or dV), 100
   repeats per r; a fault is detected when the call's statistic exceeds the threshold;
4. count false alarms over the clean calls.

    python benchmarks/sensitivity_attention.py [--out benchmarks/results/sensitivity_attention.json]

This measures the invariants on the reference path (plain PyTorch, fp32). The fused Triton kernels
are not built yet; their rows belong in benchmarks/sensitivity.py with the GEMMs once they are.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from aegis_sdc.config import ThresholdConfig
from aegis_sdc.faults.models import AccumulatorFault
from aegis_sdc.kernels.attention_reference import HeadFault, attention_backward, attention_forward

R_VALUES = (0.25, 0.5, 1, 2, 4, 16, 1e2, 1e3, 1e4, 1e5)


def call(pass_: str, shape: tuple[int, int, int], device: str, fault: HeadFault | None = None):
    """(statistic, raw L2 per head) of one call with fresh random operands."""
    n, s, d = shape
    q, k, v, do = (torch.randn(n, s, d, device=device) for _ in range(4))
    scale = d**-0.5
    if pass_ == "fwd":
        result = attention_forward(q, k, v, scale, True, fault)
    else:
        forward = attention_forward(q, k, v, scale, True)
        result = attention_backward(q, k, v, forward.out, forward.lse, do, scale, True, fault)
    values = result.values if pass_ == "fwd" else result.values[0]  # backward: the dv check (a pv fault)
    return float(values.max()), result.raw_l2


def study(pass_: str, shape, device: str, clean_calls: int, repeats: int, rng: random.Random) -> dict:
    margin = ThresholdConfig().margin
    clean = [call(pass_, shape, device) for _ in range(max(clean_calls, 500))]
    threshold = margin * statistics.median(v for v, _ in clean[:16])
    m = statistics.median(float(raw[0]) for _, raw in clean[:500])
    false_alarms = sum(v > threshold for v, _ in clean[16:])
    n, s, d = shape
    rates = {}
    for r in R_VALUES:
        hits = 0
        for _ in range(repeats):
            delta = rng.choice((-1.0, 1.0)) * r * m
            fault = AccumulatorFault("perturb", 0, delta, rng.randrange(s), rng.randrange(d), 0.0, 0.0)
            value, _ = call(pass_, shape, device, HeadFault(rng.randrange(n), "pv", fault))
            hits += value > threshold
        rates[str(r)] = hits / repeats
    return {
        "pass": pass_, "shape": {"heads": n, "seq": s, "dim": d}, "threshold": threshold, "median_l2": m,
        "clean_calls": len(clean) - 16, "false_alarms": false_alarms, "detection": rates,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sensitivity_attention.json")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--clean-calls", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    shape = (args.heads, args.seq, args.dim)
    rows = []
    for pass_ in ("fwd", "bwd"):
        started = time.time()
        rows.append(study(pass_, shape, args.device, args.clean_calls, args.repeats, rng))
        rows[-1]["seconds"] = time.time() - started
        print(json.dumps(rows[-1]), flush=True)
    summary = {
        "detection_at_r1": {row["pass"]: row["detection"]["1"] for row in rows},
        "clean_calls": sum(row["clean_calls"] for row in rows),
        "false_alarms": sum(row["false_alarms"] for row in rows),
        "r_for_99": {
            row["pass"]: next((float(r) for r, rate in row["detection"].items() if rate >= 0.99), None) for row in rows
        },
    }
    result = {
        "env": {
            "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": "python " + " ".join(sys.argv),
            "path": "reference (plain PyTorch, fp32 accumulation), causal, fresh N(0, 1) operands per call",
        },
        "rows": rows,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
