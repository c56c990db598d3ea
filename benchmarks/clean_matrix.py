"""The clean-run matrix on the GPU: every common training setup, healthy, for ≥ 200 steps — zero
confirmed incidents, no rank blamed — and the same setups with one injected fault each, confirmed at
its site and step.

Cells: `aegis_sdc.workloads.setups.matrix("small")` (AdamW fused / foreach / for-loop, SGD momentum,
hand-written p.data updates in both orders, GradScaler + fp16 autocast, bf16 weights, bf16 autocast,
fp32 with TF32 allowed, activation checkpointing, gradient accumulation, load_state_dict mid-run, HF
Llama / Qwen2 / GPT-2 / BERT from configs) plus HF Llama at the TinyLlama-1.1B widths with bf16
weights and fused AdamW (the setup that confirmed 55 "SDCs" in 40 clean steps before).

Each cell runs clean twice — default thresholds (the product, `--steps`) and a hair trigger (margin
1, relax window 10: half the checks alarm and are replayed; `--hair-trigger-steps`) — and once with
a bitflip (bit 27) at step `--fault-step`, default thresholds. One process, one GPU: data-parallel
cells need several GPUs. Results are written after every cell; `--resume FILE` keeps the cells of an
earlier, partial call (a device call has a time limit).

    python benchmarks/clean_matrix.py [--steps 200] [--cells NAME ...] [--out benchmarks/results/clean_matrix.json]

Summary keys: `confirmed_clean` (confirmed or unattributed verdicts in clean runs: must be 0),
`wrong_rank_named` (incidents naming a rank, site or step other than the injected fault's: must be 0),
`faults_confirmed` / `faults_injected`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path

import torch
from common import gpu_environment, write_result  # benchmarks/ is the script's directory

import aegis_sdc as aegis
from aegis_sdc.workloads.setups import Setup, matrix, run_setup

HAIR_TRIGGER = aegis.ThresholdConfig(margin=1.0, relax_window=10)


def config(thresholds: aegis.ThresholdConfig, faults=(), backend: str = "auto") -> aegis.GuardConfig:
    return aegis.GuardConfig(
        run_dir=tempfile.mkdtemp(prefix="aegis-matrix-"), thresholds=thresholds, faults=faults, backend=backend,
        sampling=aegis.SamplingConfig.every_call(),
        response=aegis.ResponseConfig(quarantine=False),
    )  # fmt: skip


def gpu_backend(setup: Setup) -> str:
    """fp32 cells on the GPU: the reference path, by request (`auto` leaves fp32 GPU layers unchecked,
    named in the coverage; the matrix still wants their optimizers and loops judged)."""
    return "reference" if setup.precision == "fp32" else "auto"


def row_of(setup: Setup, variant: str, result, fault: tuple[str, int] | None) -> dict:
    s = result.summary
    wrong = [i for i in result.incidents if fault is None or (i[0], i[1], i[2]) != (*fault, 0)]
    return {
        "cell": setup.name, "variant": variant, "steps": result.steps,
        "ms_per_step": 1000 * result.seconds / result.steps,
        "checks": s["checks"], "alarms": s["alarms"], "false_alarms": s["false_alarms"],
        "confirmed": s["confirmed"], "unattributed": s["unattributed"], "not_verifiable": s["not_verifiable"],
        "nonfinite_inputs": s["nonfinite_inputs"], "data_false_alarms": s["data_false_alarms"],
        "attention_checks": s["attention_checks"], "fingerprint_checks": s["fingerprint_checks"],
        "relaxations": result.relaxations, "uncalibrated": result.uncalibrated,
        "incidents": result.incidents, "injected": result.injected, "verdicts": result.verdicts,
        "wrong_incidents": wrong, "loss_first": result.losses[0], "loss_last": result.losses[-1],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "clean_matrix.json")
    parser.add_argument("--steps", type=int, default=200, help="steps of each clean run")
    parser.add_argument("--fault-steps", type=int, default=50, help="steps of each faulty run")
    parser.add_argument("--fault-step", type=int, default=40, help="step of the injected fault (after calibration)")
    parser.add_argument("--hair-trigger-steps", type=int, default=60, help="steps of each hair-trigger run")
    parser.add_argument("--cells", nargs="*", help="only these cells (names)")
    parser.add_argument(
        "--resume", type=Path, help="a partial result of an earlier call: its cells are kept, not rerun"
    )
    args = parser.parse_args()
    cells = list(matrix("small"))
    if args.cells:  # in the order given
        cells = [next(s for s in cells if s.name == name) for name in args.cells]
    rows, errors = [], []
    if args.resume is not None and args.resume.exists():
        earlier = json.loads(args.resume.read_text())
        rows, errors = earlier["rows"], earlier.get("errors", [])
    done = {r["cell"] for r in rows}
    env = gpu_environment(
        cells=[s.name for s in cells], clean_steps=args.steps, hair_trigger_steps=args.hair_trigger_steps,
        fault_step=args.fault_step,
    )  # fmt: skip
    if args.resume is not None and args.resume.exists():
        env["earlier_calls"] = [*earlier["env"].get("earlier_calls", []), earlier["env"]]

    def record() -> dict:
        clean = [r for r in rows if r["variant"] != "fault"]
        faulty = [r for r in rows if r["variant"] == "fault"]
        summary = {
            "confirmed_clean": sum(r["confirmed"] + r["unattributed"] for r in clean),
            "wrong_rank_named": sum(len(r["wrong_incidents"]) for r in rows),
            "faults_injected": sum(len(r["injected"]) for r in faulty),
            "faults_confirmed": sum(len(r["incidents"]) - len(r["wrong_incidents"]) for r in faulty),
            "clean_runs": len(clean),
            "clean_steps": sum(r["steps"] for r in clean),
            "clean_alarms_replayed": sum(r["alarms"] for r in clean),
            "errors": len(errors),
            "not_run": "data-parallel cells (2 and 3 ranks) need several GPUs; they run on the CPU in tests",
        }
        write_result(args.out, env, rows, summary, errors=errors)
        return summary

    for setup in cells:
        if setup.name in done:
            continue
        fault = (setup.fault_site, args.fault_step)
        spec = aegis.FaultSpec(site=setup.fault_site, model="bitflip", bit=27, steps=(args.fault_step,))
        for variant, thresholds, faults, steps in (
            ("default", aegis.ThresholdConfig(), (), args.steps),
            ("hair-trigger", HAIR_TRIGGER, (), args.hair_trigger_steps),
            ("fault", aegis.ThresholdConfig(), (spec,), args.fault_steps),
        ):
            started = time.perf_counter()
            try:
                result = run_setup(setup, config(thresholds, faults, gpu_backend(setup)), steps=steps, device="cuda")
            except Exception as error:  # keep going: one broken cell must not hide the others
                errors.append({"cell": setup.name, "variant": variant, "error": traceback.format_exc()})
                print(f"{setup.name:32s} {variant:12s} ERROR {error!r}", flush=True)
                continue
            row = row_of(setup, variant, result, fault if faults else None)
            rows.append(row)
            print(f"{setup.name:32s} {variant:12s} {time.perf_counter() - started:6.1f}s "
                  f"{row['ms_per_step']:7.1f} ms/step checks={row['checks']} alarms={row['alarms']} "
                  f"false={row['false_alarms']} confirmed={row['confirmed']} nv={row['not_verifiable']} "
                  f"incidents={row['incidents']}", flush=True)  # fmt: skip
            torch.cuda.empty_cache()
        record()
    summary = record()
    assert summary["confirmed_clean"] == 0 and summary["wrong_rank_named"] == 0, summary


if __name__ == "__main__":
    main()
