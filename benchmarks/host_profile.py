"""Where the host's time goes in a protected step (cProfile), for the HF Llama of e2e_step.py.

python benchmarks/host_profile.py --sampling full|p0|budget_1pct [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import e2e_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sampling", default="full", choices=[c for c in e2e_step.CONFIGS if c != "unprotected"])
    parser.add_argument("--workload", default="hf")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    runner = e2e_step.make_runner(args.sampling, args.workload, compiled=False)
    batch = torch.randint(0, e2e_step.HF_SHAPE["vocab_size"], (e2e_step.BATCH, e2e_step.SEQ), device="cuda")
    for _ in range(e2e_step.CALIBRATION_STEPS):
        runner.step(batch, record=False)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        runner.step(batch, record=True)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
    stats.print_stats(45)
    stats.sort_stats("cumulative").print_stats(45)
    report = f"host ms/step {runner.host_ms}  gpu ms/step {runner.gpu_ms}\n" + text.getvalue()
    print(report[:6000])
    if args.out is not None:
        args.out.write_text(report)
        profiler.dump_stats(args.out.with_suffix(".pstats"))  # the whole profile, for pstats
    runner.guard.close()


if __name__ == "__main__":
    main()
