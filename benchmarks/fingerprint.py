"""Fingerprint throughput against the copy bandwidth, and the cost of the recompute and saved-tensor
checks on a training step (GPU), measured in the same run.

    python benchmarks/fingerprint.py [--out benchmarks/results/fingerprint.json] [--steps-only] [--kernels-only]
                                     [--optimizer fused|foreach]

Kernel rows: bf16 tensors of random values from 1 MiB to 4 GiB; `triton.testing.do_bench` medians of
the fingerprint (read bytes / time), `torch.sum` (read bytes / time) and a device-to-device copy
((read + written bytes) / time, as GPU.md counts it). A batch of 200 tensors of mixed sizes in one
launch is compared with one tensor of the same total size. A sweep of the kernel's launch shape at
16 MiB – 1 GiB records why the defaults are what they are.

Step rows: the workload at GPU scale (dim 2048, 4 layers, bf16, 4 × 2048 tokens by default: the step
must be device-bound for the difference to be measurable) under a guard whose GEMM checks are
sampled at 0 after calibration, with and without per-block activation checkpointing; fingerprint
checks off / recompute / recompute + saved tensors (default sampling) / saved tensors at every step.
CUDA-event medians per step after the warm-up. AdamW fused by default (its checked steps end without
waiting for the host: the optimizer gate); `--optimizer foreach` shows the wait other optimizers pay.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import tempfile
from pathlib import Path

import torch
from common import gpu_environment, timed_steps, write_result  # benchmarks/ is the script's directory
from triton.testing import do_bench

import aegis_sdc as aegis
from aegis_sdc.config import FingerprintConfig
from aegis_sdc.kernels import fingerprint as kfp
from aegis_sdc.workloads.data import SyntheticTokens, TokenStreamConfig
from aegis_sdc.workloads.llama import Llama, LlamaConfig

MIB = 1 << 20
SIZES_MIB = [1, 4, 16, 64, 256, 1024, 4096]
CFG = LlamaConfig(vocab_size=32768, dim=2048, n_layers=4, n_heads=16, n_kv_heads=8, hidden_dim=5632, max_seq_len=2048)


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def fingerprint_fn(t: torch.Tensor):
    words, out = kfp.as_words(t), torch.zeros(kfp.ROW, dtype=torch.int32, device="cuda")
    return lambda: kfp.launch_one(words, out)


def size_row(mib: int) -> dict:
    t = torch.randn(mib * MIB // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(t)
    nbytes = t.numel() * 2
    fingerprint_ms, sum_ms, copy_ms = bench(fingerprint_fn(t)), bench(lambda: t.sum()), bench(lambda: dst.copy_(t))
    copy_bw = 2 * nbytes / copy_ms / 1e9  # TB/s, read + write
    fp_bw = nbytes / fingerprint_ms / 1e9
    return {
        "bytes": nbytes, "fingerprint_ms": fingerprint_ms, "sum_ms": sum_ms, "copy_ms": copy_ms,
        "fingerprint_tb_s": fp_bw, "sum_tb_s": nbytes / sum_ms / 1e9, "copy_tb_s": copy_bw,
        "fraction_of_copy": fp_bw / copy_bw,
    }  # fmt: skip


def kernel_rows() -> list[dict]:
    rows = []
    for mib in SIZES_MIB:
        rows.append(size_row(mib))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return rows


def batch_row() -> dict:
    g = torch.Generator().manual_seed(0)
    # 200 sizes log-uniform in [64 KiB, 64 MiB] (whole bf16 elements), and one tensor of their total
    sizes = [int(2 ** (16 + 10 * float(torch.rand(1, generator=g)))) // 2 * 2 for _ in range(200)]
    tensors = [torch.randn(s // 2, device="cuda", dtype=torch.bfloat16) for s in sizes]
    total = sum(sizes)
    single = torch.randn(total // 2, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros(len(tensors), kfp.ROW, dtype=torch.int32, device="cuda")
    items = [(kfp.as_words(t), i) for i, t in enumerate(tensors)]
    batch_ms = bench(lambda: kfp.launch_many(items, out))
    single_ms = bench(fingerprint_fn(single))
    return {"tensors": len(tensors), "total_bytes": total, "batch_ms": batch_ms, "single_ms": single_ms,
            "batch_vs_single": batch_ms / single_ms, "batch_tb_s": total / batch_ms / 1e9}  # fmt: skip


def sweep_rows() -> list[dict]:
    """Launch shapes tried at several sizes: where the defaults in kernels/fingerprint.py come from."""
    defaults, batch_default = list(kfp.SHAPES), kfp.BATCH_SHAPE
    rows = []
    for mib in (16, 64, 256, 1024):
        t = torch.randn(mib * MIB // 2, device="cuda", dtype=torch.bfloat16)
        for block, programs, warps, stages in itertools.product((1024, 2048), (528, 1056, 2112), (4, 8), (1, 3)):
            kfp.SHAPES = [(1 << 62, block, programs, warps, stages)]
            ms = bench(fingerprint_fn(t))
            rows.append({"mib": mib, "block": block, "programs": programs, "warps": warps, "stages": stages,
                         "ms": ms, "tb_s": t.numel() * 2 / ms / 1e9})  # fmt: skip
        del t
    kfp.SHAPES = defaults
    for block, programs, warps, stages in itertools.product((1024, 2048), (1056, 2112), (8,), (1, 3)):
        kfp.BATCH_SHAPE = (block, programs, warps, stages)
        rows.append({"batch": True, "block": block, "programs": programs, "warps": warps, "stages": stages,
                     **batch_row()})  # fmt: skip
    kfp.BATCH_SHAPE = batch_default
    return rows


def step_ms(checkpointing: bool, fingerprints: FingerprintConfig, steps: int, warmup: int, batch: int,
            optimizer_kind: str) -> float:  # fmt: skip
    cfg = dataclasses.replace(CFG, activation_checkpointing=checkpointing)
    torch.manual_seed(0)
    model = Llama(cfg).cuda().to(torch.bfloat16)
    data = SyntheticTokens(TokenStreamConfig(vocab_size=cfg.vocab_size, seq_len=2048, batch_size=batch), device="cuda")
    # fused: the optimizer gate lets a checked step end without waiting for its evidence; foreach (and
    # other optimizers without a device-side found_inf) wait for the host before the update
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **{optimizer_kind: True})
    config = aegis.GuardConfig(run_dir=tempfile.mkdtemp(), sampling=aegis.SamplingConfig(probability=0.0),
                               fingerprints=fingerprints)  # fmt: skip
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    times = timed_steps(model, optimizer, (data.batch() for _ in range(warmup + steps)), warmup)
    summary = guard.close()
    assert summary.confirmed == 0 and summary.not_deterministic == 0, summary
    del model, optimizer
    torch.cuda.empty_cache()
    return statistics.median(times)


def step_rows(steps: int, warmup: int, batch: int, optimizer_kind: str) -> list[dict]:
    """Every variant in three interleaved rounds; the median of the rounds' medians (a variant's step
    time moved between rounds by more than the checks cost when the loop was host-bound)."""
    off = FingerprintConfig(recompute=False, saved_tensors=False)
    variants = [
        ("checkpointed", True, off),
        ("checkpointed+recompute", True, FingerprintConfig(saved_tensors=False)),
        ("checkpointed+recompute+saved", True, FingerprintConfig()),
        ("plain", False, off),
        ("plain+saved", False, FingerprintConfig(recompute=False)),
        ("plain+saved_every_step", False, FingerprintConfig(recompute=False, saved_probability=1.0)),
    ]
    rounds = [[step_ms(c, f, steps, warmup, batch, optimizer_kind) for _, c, f in variants] for _ in range(3)]
    rows = [
        {"variant": name, "step_ms": statistics.median(times), "rounds_ms": list(times)}
        for (name, _, _), *times in zip(variants, *rounds, strict=True)
    ]
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def step_summary(steps: list[dict]) -> dict:
    step = {r["variant"]: r["step_ms"] for r in steps}
    return {
        "recompute_check_overhead": step["checkpointed+recompute"] / step["checkpointed"] - 1,
        "recompute_and_saved_check_overhead": step["checkpointed+recompute+saved"] / step["checkpointed"] - 1,
        "saved_check_overhead": step["plain+saved"] / step["plain"] - 1,
        "saved_every_step_overhead": step["plain+saved_every_step"] / step["plain"] - 1,
    }


def environment(args) -> dict:
    return gpu_environment(
        step_model=f"Llama dim {CFG.dim}, {CFG.n_layers} layers, {args.batch}×2048 tokens, bf16, AdamW "
        f"({args.optimizer}); GEMM sampling 0 after calibration; defaults: saved_probability 0.05 (of steps), "
        "saved_min_bytes 64 KiB",
    )


def write_steps_only(args) -> None:
    steps = step_rows(args.steps, args.warmup, args.batch, args.optimizer)
    write_result(args.out.with_name(args.out.stem + "_step.json"), environment(args), {"training_step": steps},
                 step_summary(steps))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fingerprint.json")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=20, help="covers GEMM calibration (16 checks per site)")
    parser.add_argument("--batch", type=int, default=4, help="sequences of 2048 tokens per step")
    parser.add_argument("--kernels-only", action="store_true", help="kernel rows and sweeps only, no JSON")
    parser.add_argument("--steps-only", action="store_true", help="only the training-step rows (their own JSON)")
    parser.add_argument(
        "--optimizer",
        default="fused",
        choices=["fused", "foreach"],
        help="the step's AdamW: fused (the optimizer gate) or foreach (waits for the host)",
    )
    args = parser.parse_args()
    if args.steps_only:
        write_steps_only(args)
        return
    kernels = kernel_rows()
    batch = batch_row()
    print(json.dumps(batch), flush=True)
    sweep = sweep_rows()
    for mib in sorted({r["mib"] for r in sweep if "mib" in r}):
        best = min((r for r in sweep if r.get("mib") == mib), key=lambda r: r["ms"])
        print(json.dumps({"sweep_best": best}), flush=True)
    print(json.dumps({"sweep_best_batch": min((r for r in sweep if "batch" in r), key=lambda r: r["batch_ms"])}))
    if args.kernels_only:
        return
    summary = {
        "bandwidth_fraction_ge_64mb": min(r["fraction_of_copy"] for r in kernels if r["bytes"] >= 64 * MIB),
        "batch_vs_single": batch["batch_vs_single"],
        "fingerprint_tb_s_1gib": next(r["fingerprint_tb_s"] for r in kernels if r["bytes"] == 1024 * MIB),
        "copy_tb_s_1gib": next(r["copy_tb_s"] for r in kernels if r["bytes"] == 1024 * MIB),
    }
    rows = {"kernel": kernels, "batch": batch, "launch_sweep": sweep}
    # the kernel rows first: the training-step rows take minutes more, and a run cut short (a device
    # call's limit) keeps what it measured; the complete record replaces this one
    write_result(args.out, environment(args), {**rows, "training_step": "not measured (run cut short)"}, summary)
    steps = step_rows(args.steps, args.warmup, args.batch, args.optimizer)
    write_result(args.out, environment(args), {**rows, "training_step": steps}, {**summary, **step_summary(steps)})
    assert math.isfinite(summary["bandwidth_fraction_ge_64mb"])


if __name__ == "__main__":
    main()
