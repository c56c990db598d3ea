"""Sensitivity of the checked Linear on the training workload (CPU, reference path).

Two measurements on the demo workload (`LlamaConfig()`, 1024 tokens per step, 45 sites):

1. clean: train `--clean-steps` steps with thresholds disabled (margin 1e9) and report, per site and
   channel, the largest clean value after calibration divided by the calibration median — the
   headroom the threshold margin must cover;
2. faults: train `--fault-steps` steps injecting a `perturb` fault of r = `--scale` median
   differences into every site from step 20 on, and report the fraction confirmed per GEMM kind.

Writes benchmarks/results/workload_sensitivity.json.

    python benchmarks/workload_sensitivity.py
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import torch

import aegis_sdc as aegis
from aegis_sdc.sensors import gemm as gemm_sensor
from aegis_sdc.workloads.data import SyntheticTokens, TokenStreamConfig
from aegis_sdc.workloads.llama import Llama, LlamaConfig, lm_loss


def workload(seed: int = 0):
    torch.manual_seed(seed)
    cfg = LlamaConfig()
    model = Llama(cfg)
    data = SyntheticTokens(TokenStreamConfig(vocab_size=cfg.vocab_size, seq_len=128, batch_size=8, seed=seed))
    return model, data, torch.optim.AdamW(model.parameters(), lr=3e-3)


def train(model, data, optimizer, steps):
    for _ in range(steps):
        x, y = data.batch()
        loss = lm_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def clean_headroom(steps: int) -> dict:
    model, data, optimizer = workload()
    values: dict[tuple[str, str], list[float]] = defaultdict(list)
    original = gemm_sensor.GemmSensor.judge

    def spy(self, record, stats):
        values[(self.site.name, "row")].append(stats[gemm_sensor.ROW_VALUE])
        if self.col_check:
            values[(self.site.name, "col")].append(stats[gemm_sensor.COL_VALUE])
        return original(self, record, stats)

    gemm_sensor.GemmSensor.judge = spy
    cfg = aegis.GuardConfig(run_dir=tempfile.mkdtemp(), thresholds=aegis.ThresholdConfig(margin=1e9),
                            sampling=aegis.SamplingConfig.every_call())  # fmt: skip
    try:
        guard = aegis.protect(model, optimizer=optimizer, config=cfg)
        final_loss = train(model, data, optimizer, steps)
        guard.close()
    finally:
        gemm_sensor.GemmSensor.judge = original
    rows = []
    for (site, channel), series in values.items():
        median = statistics.median(series[:16])
        rows.append(
            {
                "site": site,
                "channel": channel,
                "calibration_median": median,
                "max_after_calibration": max(series[16:]),
                "ratio": max(series[16:]) / median,
            }
        )
    return {"steps": steps, "final_loss": final_loss, "sites": rows, "worst_ratio": max(r["ratio"] for r in rows)}


def fault_detection(steps: int, scale: float) -> dict:
    model, data, optimizer = workload()
    spec = aegis.FaultSpec(site="*", model="perturb", scale=scale, steps=tuple(range(20, steps)), seed=1)
    cfg = aegis.GuardConfig(run_dir=tempfile.mkdtemp(), faults=(spec,), response=aegis.ResponseConfig(quarantine=False),
                            sampling=aegis.SamplingConfig.every_call())  # fmt: skip
    guard = aegis.protect(model, optimizer=optimizer, config=cfg)
    train(model, data, optimizer, steps)
    summary = guard.close()
    found = {(i.site.name, i.step) for i in guard.incidents}
    injected, detected = Counter(), Counter()
    misses = Counter()
    for injection in guard.injector.log:
        kind = injection.site.rsplit(":", 1)[1]
        injected[kind] += 1
        hit = (injection.site, injection.step) in found
        detected[kind] += hit
        misses[injection.site] += not hit
    return {
        "steps": steps,
        "scale_r": scale,
        "per_kind": {
            k: {"injected": injected[k], "confirmed": detected[k], "rate": detected[k] / injected[k]} for k in injected
        },
        "false_alarms": summary.false_alarms,
        "most_missed_sites": misses.most_common(5),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clean-steps", type=int, default=300)
    parser.add_argument("--fault-steps", type=int, default=60)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "workload_sensitivity.json")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    logging.getLogger("aegis_sdc").addHandler(logging.NullHandler())
    logging.getLogger("aegis_sdc").propagate = False
    started = time.time()
    clean = clean_headroom(args.clean_steps)
    faults = fault_detection(args.fault_steps, args.scale)
    result = {
        "env": {
            "device": "cpu",
            "torch": torch.__version__,
            "aegis_sdc": aegis.__version__,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(["python", *sys.argv]),
            "seconds": round(time.time() - started, 1),
        },
        "rows": {"clean": clean["sites"]},
        "summary": {
            "clean_steps": clean["steps"],
            "clean_worst_max_over_calibration_median": clean["worst_ratio"],
            "threshold_margin": aegis.ThresholdConfig().margin,
            "fault_scale_r": args.scale,
            "detection_rate": {k: v["rate"] for k, v in faults["per_kind"].items()},
            "faults": faults,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
