"""End-to-end cost of protection on a training step (GPU): the workload at GPU scale, bf16,
timed unprotected and protected (every Linear, all three GEMMs checked; and sampled) in the same run.

    python benchmarks/training_step.py [--out benchmarks/results/training_step.json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from common import gpu_environment, timed_steps, write_result  # benchmarks/ is the script's directory

import aegis_sdc as aegis
from aegis_sdc.workloads.data import SyntheticTokens, TokenStreamConfig
from aegis_sdc.workloads.llama import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=32768, dim=2048, n_layers=4, n_heads=16, n_kv_heads=8, hidden_dim=5632, max_seq_len=2048)


def step_times(protect: aegis.SamplingConfig | None, steps: int, warmup: int) -> tuple[list[float], object]:
    torch.manual_seed(0)
    model = Llama(CFG).cuda().to(torch.bfloat16)
    data = SyntheticTokens(TokenStreamConfig(vocab_size=CFG.vocab_size, seq_len=2048, batch_size=4), device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    guard = None
    if protect is not None:
        guard = aegis.protect(
            model, optimizer=optimizer, config=aegis.GuardConfig(run_dir=tempfile.mkdtemp(), sampling=protect)
        )
    batches = [data.batch() for _ in range(warmup + steps)]
    times = timed_steps(model, optimizer, batches, warmup)
    summary = guard.close() if guard is not None else None
    return times, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "training_step.json")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=20, help="covers calibration (16 checks per site)")
    args = parser.parse_args()
    rows = {}
    for label, sampling in (("unprotected", None), ("checked p=1", aegis.SamplingConfig()),
                            ("checked p=0.1", aegis.SamplingConfig(probability=0.1))):  # fmt: skip
        times, summary = step_times(sampling, args.steps, args.warmup)
        rows[label] = {"median_ms": statistics.median(times), "times_ms": times,
                       "summary": summary.to_dict() if summary is not None else None}  # fmt: skip
        print(f"{label:14s} {statistics.median(times):8.2f} ms/step", flush=True)
    base = rows["unprotected"]["median_ms"]
    summary = {label: {"median_ms": r["median_ms"], "overhead": r["median_ms"] / base - 1} for label, r in rows.items()}
    env = gpu_environment(workload=CFG.__dict__, tokens_per_step=4 * 2048)
    write_result(args.out, env, rows, summary)


if __name__ == "__main__":
    main()
