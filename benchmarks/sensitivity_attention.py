"""Sensitivity of the attention invariants: the AEGIS fault-injection experiment, per stage and check.

For every fault stage and the check that claims it — forward `pv` (O·1 against P·(V·1)); backward
`pv` (dv), `dp`, `ds`, `dq`, `dk` — with fresh random q, k, v, dO on every call (causal):

1. calibrate as the guard does: threshold = 4 × the median of the first 16 clean values of the
   normalized statistic (the largest over the heads of a call);
2. m = the median over ≥ 500 clean calls of the check's raw difference ‖·‖₂ of one head;
3. add ±r·m to one random element of the stage's matrix in one random head (a score-shaped matrix:
   an element the causal mask leaves visible), 100 repeats per r; a fault is detected when the
   call's statistic exceeds the threshold;
4. count false alarms over the clean calls (every check of every clean call).

    python benchmarks/sensitivity_attention.py [--kernels reference|triton] [--dtype fp32|bf16]
                                               [--out benchmarks/results/sensitivity_attention.json]

`--kernels reference` (plain PyTorch, fp32) measures the forward and dv checks, whose raw size the
reference path reports; `--kernels triton` (kernels/triton_attention.py, on the GPU; bf16 by default)
every stage and check.
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
from aegis_sdc.kernels import attention_reference, triton_attention
from aegis_sdc.kernels.attention_reference import BACKWARD_CHECKS, HeadFault

R_VALUES = (0.25, 0.5, 1, 2, 4, 16, 1e2, 1e3, 1e4, 1e5)
# (pass, stage, check): the stages whose faults a check claims, checked where the fault lands
STUDIES = {
    "reference": [("fwd", "pv", "fwd"), ("bwd", "pv", "dv")],
    "triton": [("fwd", "pv", "fwd"), ("bwd", "pv", "dv"), ("bwd", "dp", "dp"), ("bwd", "ds", "ds"),
               ("bwd", "dq", "dq"), ("bwd", "dk", "dk")],
}  # fmt: skip


def call(kernels, pass_: str, check: str, shape, device: str, dtype, fault: HeadFault | None = None):
    """(statistic of `check`, its raw L2 per head, every check's statistic) of one call with fresh
    random operands."""
    n, s, d = shape
    q, k, v, do = (torch.randn(n, s, d, device=device).to(dtype) for _ in range(4))
    scale = d**-0.5
    forward, backward = kernels
    if pass_ == "fwd":
        result = forward(q, k, v, scale, True, fault)
        return float(result.values.max()), result.raw_l2, [float(result.values.max())]
    fwd = forward(q, k, v, scale, True)
    result = backward(q, k, v, fwd.out, fwd.lse, do, scale, True, fault)
    row = BACKWARD_CHECKS.index(check)
    l2 = result.check_l2[row] if result.check_l2 is not None else result.raw_l2
    return float(result.values[row].max()), l2, [float(x) for x in result.values.amax(dim=1)]


def study(kernels, pass_: str, stage: str, check: str, shape, device: str, dtype, clean_calls: int,
          repeats: int, rng: random.Random) -> dict:  # fmt: skip
    margin = ThresholdConfig().margin
    clean = [call(kernels, pass_, check, shape, device, dtype) for _ in range(max(clean_calls, 500))]
    # every check of the pass calibrated on the first 16 clean calls: a false alarm is any check over its threshold
    thresholds = [margin * statistics.median(c[2][i] for c in clean[:16]) for i in range(len(clean[0][2]))]
    threshold = margin * statistics.median(value for value, _, _ in clean[:16])
    m = statistics.median(float(raw[0]) for _, raw, _ in clean[:500])
    false_alarms = sum(any(x > t for x, t in zip(c[2], thresholds, strict=True)) for c in clean[16:])
    n, s, d = shape
    rows, cols = {"qk": (s, s), "softmax": (s, s), "dp": (s, s), "ds": (s, s)}.get(stage, (s, d))
    rates = {}
    for r in R_VALUES:
        hits = 0
        for _ in range(repeats):
            delta = rng.choice((-1.0, 1.0)) * r * m
            row = rng.randrange(rows)
            # a score-shaped element the causal mask hides is never computed (or weighs 0): draw visible ones
            col = rng.randrange(row + 1) if (rows, cols) == (s, s) else rng.randrange(cols)
            fault = AccumulatorFault("perturb", 0, delta, row, col, 0.0, 0.0)
            value, _, _ = call(kernels, pass_, check, shape, device, dtype, HeadFault(rng.randrange(n), stage, fault))
            hits += value > threshold
        rates[str(r)] = hits / repeats
    return {
        "pass": pass_, "stage": stage, "check": check, "shape": {"heads": n, "seq": s, "dim": d},
        "threshold": threshold, "median_l2": m, "clean_calls": len(clean) - 16, "false_alarms": false_alarms,
        "detection": rates,
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
    parser.add_argument("--kernels", choices=sorted(STUDIES), default="reference")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                        help="operand dtype (default: fp32 for the reference path, bf16 for Triton)")  # fmt: skip
    args = parser.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    shape = (args.heads, args.seq, args.dim)
    dtype_name = args.dtype or ("fp32" if args.kernels == "reference" else "bf16")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    kernels = {
        "reference": (attention_reference.attention_forward, attention_reference.attention_backward),
        "triton": (triton_attention.forward, triton_attention.backward),
    }[args.kernels]
    rows = []
    for pass_, stage, check in STUDIES[args.kernels]:
        started = time.time()
        rows.append(study(kernels, pass_, stage, check, shape, args.device, dtype, args.clean_calls, args.repeats, rng))
        rows[-1]["seconds"] = time.time() - started
        print(json.dumps(rows[-1]), flush=True)

    def key(row: dict) -> str:
        return f"{row['pass']}.{row['stage']}"

    summary = {
        "detection_at_r1": {key(row): row["detection"]["1"] for row in rows},
        "detection_at_r4": {key(row): row["detection"]["4"] for row in rows},
        "clean_calls": sum(row["clean_calls"] for row in rows),
        "false_alarms": sum(row["false_alarms"] for row in rows),
        "r_for_99": {
            key(row): next((float(r) for r, rate in row["detection"].items() if rate >= 0.99), None) for row in rows
        },
    }
    result = {
        "env": {
            "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": "python " + " ".join(sys.argv),
            "path": f"{args.kernels} kernels, {dtype_name} operands, causal, fresh N(0, 1) operands per call",
        },
        "rows": rows,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
