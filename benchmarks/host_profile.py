"""Where the protected step's host time goes: cProfile over timed steps of the HF 1.1B step.

The workload and configs of `benchmarks/e2e_step.py` (one model resident at a time). Per config:
calibration and four more steps untimed, then `--steps` steps under cProfile (Python 3.12's cProfile
sees every thread: the store writer's waits appear beside the training thread's work), the report
sorted by own time and by cumulative time, and each step's GPU and host milliseconds. Also, without
the profiler, `--stall-steps` steps per config with each step's garbage-collection time: a step far
over the median with no collection in it is not the library's Python.

    python benchmarks/host_profile.py [--configs full,p0] [--steps 12] [--stall-steps 0] [--out DIR]

Writes DIR/host_profile_<config>.txt and, with --stall-steps, DIR/step_stalls.json.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import torch
from e2e_step import BATCH, CALIBRATION_STEPS, HF_SHAPE, SEQ, make_runner


class GcClock:
    """Milliseconds spent in garbage collection since the last `take`."""

    def __init__(self) -> None:
        self.ms = 0.0
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._started) * 1000.0

    def take(self) -> float:
        ms, self.ms = self.ms, 0.0
        return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="full,p0")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--stall-steps", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, HF_SHAPE["vocab_size"], (BATCH, SEQ), device="cuda", generator=gen) for _ in range(8)]
    clock, stalls = GcClock(), {}
    for label in args.configs.split(","):
        runner = make_runner(label, "hf", False)
        for i in range(CALIBRATION_STEPS + 4):
            runner.step(batches[i % len(batches)], record=False)
        if args.steps:
            profile = cProfile.Profile()
            started = time.perf_counter()
            profile.enable()
            for i in range(args.steps):
                runner.step(batches[i % len(batches)], record=True)
            profile.disable()
            per_step = (time.perf_counter() - started) / args.steps * 1000.0
            text = io.StringIO()
            stats = pstats.Stats(profile, stream=text)
            stats.sort_stats("tottime").print_stats(45)
            stats.sort_stats("cumulative").print_stats(70)
            gpu, host = [round(x, 1) for x in runner.gpu_ms], [round(x, 1) for x in runner.host_ms]
            head = f"== {label}: {args.steps} steps, {per_step:.1f} ms/step profiled\ngpu ms {gpu}\nhost ms {host}\n"
            (args.out / f"host_profile_{label}.txt").write_text(head + text.getvalue())
            print(head, flush=True)
        if args.stall_steps:
            runner.gpu_ms.clear()
            clock.take()
            rows = []
            for i in range(args.stall_steps):
                runner.step(batches[i % len(batches)], record=True)
                rows.append({"gpu_ms": runner.gpu_ms[-1], "host_ms": runner.host_ms[-1], "gc_ms": clock.take()})
            median = statistics.median(r["gpu_ms"] for r in rows)
            stalls[label] = {"median_ms": median, "mean_ms": statistics.mean(r["gpu_ms"] for r in rows),
                             "over_1.1x_median": [i for i, r in enumerate(rows) if r["gpu_ms"] > 1.1 * median],
                             "gc_ms_total": sum(r["gc_ms"] for r in rows), "steps": rows}  # fmt: skip
            print(label, {k: v for k, v in stalls[label].items() if k != "steps"}, flush=True)
        if runner.guard is not None:
            runner.guard.close()
        del runner
        torch.cuda.empty_cache()
    if stalls:
        (args.out / "step_stalls.json").write_text(json.dumps(stalls, indent=1) + "\n")


if __name__ == "__main__":
    main()
