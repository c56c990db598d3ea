"""Registers and spills of the checked GEMM's training variants on Hopper, computed on any machine.

Compiles every variant a protected training step launches — per configuration class of
`HOPPER_TABLE`: the checked forward and dgrad with their by-product (evidence inside the launch), the
unchecked forward that only leaves its by-product, the wgrad's row+col check — for sm_90a with
Triton's bundled `ptxas` (no GPU needed: Triton compiles for a named target), and reports each
one's registers per thread and spill bytes. A spill in a persistent GEMM's epilogue is paid by
every tile; the GPU record (`gemm_diagnose.py`, `n_spills`) says the same on the device.

    python benchmarks/kernel_registers.py [--evidence totals|parts] [--out benchmarks/results/kernel_registers.json]

`--evidence parts` compiles them with `inline_totals` off (the finish sums the tiles' stored parts);
`--side-on-cuda-cores` (`--col-side-on-cuda-cores`) with the row (column) side's slices in the K loop on
the CUDA cores; `--classes` picks classes of `HOPPER_TABLE`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import triton
import triton.language as tl
from common import bundled_tool, compile_for_sm90a, write_result  # benchmarks/ is the script's directory

from aegis_sdc.kernels import triton_gemm as tg

POOL_SLOTS = 4  # ops/triton_linear.DeviceState.pool_slots
# (kind, a_t, b_t, row_check, col_check, by-product): the launches of a protected bf16 training step
KINDS = [
    ("fwd checked", False, True, True, False, True),
    ("fwd unchecked, by-product only", False, True, False, False, True),
    ("dgrad checked", False, False, True, False, True),
    ("wgrad checked (row+col)", True, False, True, True, False),
]
_BF16 = {"a_ptr", "b_ptr", "c_ptr", "side_c_ptr", "side_u_ptr", "pool_data_ptr", "side_out_ptr"}
_F32 = {"row_part_ptr", "rsq_part_ptr", "out_part_ptr", "col_part_ptr", "csq_part_ptr", "c_scale_ptr", "u_scale_ptr"}
# every other pointer is fp64 (the capture pool's `pool_f32` too), but the counters and the stats


def _signature(constexprs: dict) -> dict[str, str]:
    """The kernel's argument types as a bf16 training launch passes them (i32 shapes and strides)."""
    types = {}
    for name in tg.checked_gemm_kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            types[name] = ("*bf16" if name in _BF16 else "*fp32" if name in _F32 else
                           "*i32" if name in ("counters_ptr", "pool_counter_ptr") else
                           "*i64" if name == "stats_ptr" else "*fp64")  # fmt: skip
        else:
            types[name] = "fp32" if name in ("row_threshold", "col_threshold", "fault_delta") else "i32"
    return types


def measure(cls: str, cfg: tg.TritonGemmConfig, kind: tuple) -> dict:
    label, a_t, b_t, row_check, col_check, byproduct = kind
    constexprs = dict(A_T=a_t, B_T=b_t, HAS_BIAS=False, ROW_CHECK=row_check, ROW_SIDE=True, COL_CHECK=col_check,
                      SIDE_IN_LOOP=tg.side_in_loop_mode(cfg),
                      COL_IN_LOOP=col_check and cfg.col_side_on_cuda_cores,
                      FAULT=tg.FAULT_NONE, EVIDENCE=True, TOTALS=cfg.inline_totals, BYPRODUCT=byproduct,
                      SIDE_OUT=byproduct,
                      CAPTURE=(tg.CAPTURE_TILE if col_check else tg.CAPTURE_ROWS) if row_check else tg.CAPTURE_NONE,
                      POOL=POOL_SLOTS, DT=tl.bfloat16, UPCAST=False, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
                      GROUP_M=cfg.group_m)  # fmt: skip
    started = time.perf_counter()
    types = {k: v for k, v in _signature(constexprs).items() if v != "constexpr"}
    _, _, registers, stores, loads = compile_for_sm90a(tg.checked_gemm_kernel, types, constexprs,
                                                       num_warps=cfg.num_warps, num_stages=cfg.num_stages)  # fmt: skip
    row = {"class": cls, "kind": label, "block_m": cfg.block_m, "block_n": cfg.block_n, "num_warps": cfg.num_warps,
           "side_in_loop": cfg.side_in_loop, "side_on_cuda_cores": cfg.side_on_cuda_cores,
           "col_side_on_cuda_cores": cfg.col_side_on_cuda_cores,

           "num_stages": cfg.num_stages, "registers": registers, "spill_store_bytes": stores,
           "spill_load_bytes": loads, "inline_totals": cfg.inline_totals,
           "compile_s": round(time.perf_counter() - started, 1)}  # fmt: skip
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kernel_registers.json")
    parser.add_argument("--evidence", choices=["totals", "parts"], default="totals",
                        help="inside the launch: fp64 totals by atomics, or parts summed at the finish")  # fmt: skip
    parser.add_argument("--side-on-cuda-cores", action="store_true",
                        help="the row side's slices in the K loop on the CUDA cores (side_on_cuda_cores)")  # fmt: skip
    parser.add_argument("--col-side-on-cuda-cores", action="store_true",
                        help="the column side's slices in the K loop on the CUDA cores")  # fmt: skip
    parser.add_argument("--classes", default=",".join(tg.HOPPER_TABLE), help="which classes of HOPPER_TABLE")
    args = parser.parse_args()
    cuda_side = dict(side_on_cuda_cores=args.side_on_cuda_cores, col_side_on_cuda_cores=args.col_side_on_cuda_cores)
    configs: dict[tuple, list[str]] = {}  # one compile per distinct configuration
    for cls, cfg in tg.HOPPER_TABLE.items():
        if cls not in args.classes.split(","):
            continue
        key = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.group_m, cfg.side_in_loop)
        configs.setdefault(key, []).append(cls)
    rows = []
    for classes in configs.values():
        cfg = dataclasses.replace(tg.HOPPER_TABLE[classes[0]], inline_totals=args.evidence == "totals",
                                  **cuda_side)  # fmt: skip
        rows += [measure(",".join(classes), cfg, kind) for kind in KINDS]
    ptxas = bundled_tool("ptxas-blackwell", "ptxas").rsplit("/", 1)[-1]
    env = {"triton": triton.__version__, "target": "sm_90a", "ptxas": ptxas,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(["python", *sys.argv])}  # fmt: skip
    summary = {"variants": len(rows), "spilling_variants": sum(r["spill_store_bytes"] > 0 for r in rows),
               "max_spill_store_bytes": max(r["spill_store_bytes"] for r in rows)}  # fmt: skip
    write_result(args.out, env, rows, summary)


if __name__ == "__main__":
    main()
