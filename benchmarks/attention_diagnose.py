"""Where the checked attention kernels' time goes (GPU): per kernel, and with parts of the checks removed.

The checks cost our kernels 11–23% (`results/attention.json`, `invariant_cost_*`) against a target of
2%. Two measurements say where:

    kernels   one call's forward and backward, checked and unchecked, under torch.profiler: GPU time
              per kernel (the side passes `attention_sums_kernel`, the main kernels, the finishes),
              the mean over `--calls` calls
    parts     `kernels/triton_attention.py` loaded again from its source with one part of the checks
              removed, or the dQ kernel's blocks changed (`PARTS`), each variant's checked forward and
              backward timed beside the unchanged checked and unchecked kernels (`do_bench` medians,
              same inputs)

Cases: 32 query / 8 key-value heads, D 128, bf16; 4 × 2048 causal and 1 × 8192 full (the two ends of
`benchmarks/attention.py`'s table).

    python benchmarks/attention_diagnose.py [--calls 20] [--out benchmarks/results/attention_diagnose.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from attention import DIM, HEADS, KV_HEADS
from common import gpu_environment, module_with_edits, write_result
from triton.testing import do_bench

from aegis_sdc.kernels import triton_attention as ta

CASES = ((4, 2048, True), (1, 8192, False))  # (batch, seq, causal)

# part → (anchor, replacement, count) edits of kernels/triton_attention.py's source
PARTS = {
    # the forward's side MMA p·W_V (its accumulator still rescaled: the running-max bookkeeping stays)
    "fwd_no_side_mma": [
        (
            "            ref = tl.dot(p_op, _side(w_ptr, offs_n, Sk, EVEN, UPCAST), ref * alpha[:, None])",
            "            ref = ref * alpha[:, None]",
            1,
        )
    ],
    # the forward's side MMA against a constant W (no loads of W): what its loads cost
    "fwd_side_no_load": [
        (
            "            ref = tl.dot(p_op, _side(w_ptr, offs_n, Sk, EVEN, UPCAST), ref * alpha[:, None])",
            "            ref = tl.dot(p_op, tl.full((BN, 16), 1.0, p_op.dtype), ref * alpha[:, None])",
            1,
        )
    ],
    # the forward's side MMA without rescaling its accumulator (wrong values: the cost of the rescale's
    # wait for the previous side MMA)
    "fwd_side_no_rescale": [
        (
            "            ref = tl.dot(p_op, _side(w_ptr, offs_n, Sk, EVEN, UPCAST), ref * alpha[:, None])",
            "            ref = tl.dot(p_op, _side(w_ptr, offs_n, Sk, EVEN, UPCAST), ref)",
            1,
        )
    ],
    # the dK/dV kernel's two side MMAs (Pᵀ·W_dO, dSᵀ·W_Q)
    "kv_no_side_mma": [
        ("            dv_ref = tl.dot(p_op, _side(wdo_ptr, offs_m, Sq, EVEN, UPCAST), dv_ref)\n", "", 1),
        (
            "            dk_ref = tl.dot(ds_op, _side(wq_ptr, offs_m, Sq, EVEN, UPCAST), dk_ref)\n",
            "            pass\n",
            1,
        ),
    ],
    # the dQ kernel's side MMA (dS·W_K)
    "q_no_side_mma": [
        ("            dq_ref = tl.dot(ds_op, _side(wk_ptr, offs_n, Sk, EVEN, UPCAST), dq_ref)\n", "", 1),
    ],
    # the dQ kernel's comparisons after its loop — and with them, as dead code, all that feeds them: the
    # references before the loop, the row sums and the side MMA in it, i.e. the dQ kernel unchecked
    # while the dK/dV kernel and the side passes stay checked
    "q_no_epilogue": [("    if CHECK:\n        dp_raw = ", "    if False:\n        dp_raw = ", 1)],
    # the dQ kernel's three row sums per key block (dP, dS, P)
    "q_no_row_sums": [
        (
            "            dp_sum += tl.sum(dp, axis=1)\n            ds_sum += tl.sum(ds, axis=1)\n"
            "            p_sum += tl.sum(p, axis=1)\n",
            "",
            1,
        )
    ],
    # the dQ kernel's blocks (the checked kernel only; the unchecked stays at GPU_CONFIG's): narrower key
    # blocks, or fewer query rows per program, for the registers its checks add to the loop
    "q_bn64": [("q=Blocks(128, 128, 8, 2))", "q=Blocks(128, 64, 8, 2))", 1)],
    "q_bn64_s3": [("q=Blocks(128, 128, 8, 2))", "q=Blocks(128, 64, 8, 3))", 1)],
    "q_bm64": [("q=Blocks(128, 128, 8, 2))", "q=Blocks(64, 128, 4, 2))", 1)],
}


def _module_changed(part: str):
    """triton_attention loaded again from its source with `PARTS[part]` made."""
    return module_with_edits(Path(ta.__file__), PARTS[part], f"triton_attention_{part}", "triton_attention")


def _operands(b: int, s: int):
    q = torch.randn(b * HEADS, s, DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b * KV_HEADS, s, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, torch.randn_like(q)


def _calls(module, q, k, v, do, causal: bool, check: bool):
    """(forward, backward) of `module`'s kernels as the op runs them (flattened heads, GQA in place)."""
    scale = DIM**-0.5
    fwd = module.forward(q, k, v, scale, causal, heads=HEADS, check=check)

    def forward():
        return module.forward(q, k, v, scale, causal, heads=HEADS, check=check)

    def backward():
        return module.backward(q, k, v, fwd.out, fwd.lse, do, scale, causal, heads=HEADS, check=check)

    return forward, backward


def kernel_times(b: int, s: int, causal: bool, calls: int) -> dict:
    """GPU microseconds per call of each kernel, forward and backward, checked and unchecked."""
    q, k, v, do = _operands(b, s)
    out = {}
    for check in (False, True):
        for name, fn in zip(("fwd", "bwd"), _calls(ta, q, k, v, do, causal, check), strict=True):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
            per_kernel: dict[str, float] = defaultdict(float)
            for event in prof.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    per_kernel[event.name] += event.device_time / calls
            key = f"{'checked' if check else 'unchecked'}_{name}"
            out[key] = {n: round(t, 2) for n, t in sorted(per_kernel.items(), key=lambda kv: -kv[1])}
            out[f"{key}_total_us"] = round(sum(per_kernel.values()), 2)
            print(f"  {key}: {out[f'{key}_total_us']:.0f} us " + ", ".join(
                f"{n[:28]} {t:.0f}" for n, t in list(out[key].items())[:5]), flush=True)  # fmt: skip
    return out


def part_times(b: int, s: int, causal: bool, parts: list[str]) -> dict:
    """do_bench medians (ms) of the checked forward and backward with each part removed, beside the
    unchanged kernels checked and unchecked."""
    q, k, v, do = _operands(b, s)
    variants = {"unchecked": (ta, False), "checked": (ta, True)}
    variants |= {part: (_module_changed(part), True) for part in parts}
    out = {}
    for label, (module, check) in variants.items():
        forward, backward = _calls(module, q, k, v, do, causal, check)
        out[f"{label}_fwd_ms"] = do_bench(forward)
        out[f"{label}_bwd_ms"] = do_bench(backward)
    for label in variants:
        for phase in ("fwd", "bwd"):
            out[f"{label}_{phase}_cost"] = out[f"{label}_{phase}_ms"] / out[f"unchecked_{phase}_ms"] - 1
    print("  " + " | ".join(f"{label} +{out[f'{label}_fwd_cost']:.3f} / +{out[f'{label}_bwd_cost']:.3f}"
                            for label in variants), flush=True)  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "attention_diagnose.json")
    parser.add_argument("--calls", type=int, default=20, help="profiled calls per kernel measurement")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts: {sorted(unknown)}")
    torch.manual_seed(0)
    started = time.time()
    rows = []
    for b, s, causal in CASES:
        print(f"B={b} S={s} {'causal' if causal else 'full'}", flush=True)
        row = {"batch": b, "seq": s, "causal": causal, "heads": HEADS, "kv_heads": KV_HEADS, "dim": DIM}
        row |= kernel_times(b, s, causal, args.calls)
        row |= part_times(b, s, causal, parts)
        rows.append(row)
        write_result(args.out, gpu_environment(seconds=round(time.time() - started, 1)), rows)
    labels = ["checked", *parts]
    summary = {
        f"median_{label}_{phase}_cost": statistics.median(r[f"{label}_{phase}_cost"] for r in rows)
        for label in labels
        for phase in ("fwd", "bwd")
    }
    summary["cost"] = "variant's time / unchecked kernels' time - 1"
    write_result(args.out, gpu_environment(seconds=round(time.time() - started, 1)), rows, summary)


if __name__ == "__main__":
    main()
