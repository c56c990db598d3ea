"""What a sampled wgrad's reference vectors cost when no checked forward or dgrad made them: X·1 and dY·1
in fp64, torch's `t.sum(dim=1, dtype=torch.float64)` (which first converts the whole bf16 tensor to
fp64) against the library's one-read kernel (kernels/row_sums.py), same run, GPU time from CUDA-graph
replays (`common.device_ms`), random bf16 activations of the 1.1B Llama's widths at 8192 tokens.

    python benchmarks/activation_sums.py [--out benchmarks/results/activation_sums.json]

`summary`: `median_speedup` (torch's time ÷ the kernel's) and the GB/s each reaches on the widest case.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from common import device_ms, gpu_environment, write_result  # benchmarks/ is the script's directory

from aegis_sdc.ops.triton_linear import row_sums

TOKENS = 8192
WIDTHS = {"hidden (X of q/k/v/o, gate/up)": 2048, "k/v output (dY)": 256, "SwiGLU (X of down, dY of gate/up)": 5632,
          "vocabulary (dY of lm_head)": 32000}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "activation_sums.json")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, width in WIDTHS.items():
        t = torch.randn(TOKENS, width, generator=gen, device="cuda").to(torch.bfloat16)
        reference = t.sum(dim=1, dtype=torch.float64)
        ours = row_sums(t)
        # both are fp64 sums of exact values: they differ only in the order of additions
        worst = float(((ours - reference).abs() / t.double().abs().sum(dim=1).clamp_min(1e-300)).max())
        torch_ms = device_ms(lambda t=t: t.sum(dim=1, dtype=torch.float64))
        kernel_ms = device_ms(lambda t=t: row_sums(t))
        gb = t.numel() * t.element_size() / 1e9
        rows.append({"case": name, "shape": [TOKENS, width], "torch_ms": torch_ms, "kernel_ms": kernel_ms,
                     "speedup": torch_ms / kernel_ms, "kernel_gb_per_s": gb / (kernel_ms / 1e3),
                     "torch_gb_per_s": gb / (torch_ms / 1e3), "max_relative_difference": worst})  # fmt: skip
        print(f"{name:40s} torch {torch_ms * 1e3:8.1f} µs  kernel {kernel_ms * 1e3:8.1f} µs  "
              f"×{torch_ms / kernel_ms:5.1f}  diff {worst:.1e}", flush=True)  # fmt: skip
    widest = rows[-1]
    summary = {
        "median_speedup": statistics.median(r["speedup"] for r in rows),
        "kernel_gb_per_s_widest": widest["kernel_gb_per_s"],
        "torch_gb_per_s_widest": widest["torch_gb_per_s"],
        "max_relative_difference": max(r["max_relative_difference"] for r in rows),
    }
    write_result(args.out, gpu_environment(tokens=TOKENS), rows, summary)


if __name__ == "__main__":
    main()
