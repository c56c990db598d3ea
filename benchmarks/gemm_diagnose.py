"""Where a checked GEMM's time goes (GPU diagnostic): the parts of a check switched on one by one.

For a few shapes, device time (`common.device_ms`: CUDA-graph replays) of: cuBLAS; our kernel
unchecked; with the reference side only (no partials, no evidence); with the epilogue partials only
(no side, no evidence); the full row check with evidence inside the launch and in a second launch;
the row check with the by-product (the training step's checked forward and dgrad), its evidence
inside the launch from fp64 totals the tiles add by atomics or from their stored parts; the by-product
A·1 alone, inside and in a second launch; the wgrad's row+col check (both ways inside). Then the host
time per launch (launches queued back to back, no synchronization), and the registers and spills of
every compiled variant.

    python benchmarks/gemm_diagnose.py [--layers gate_up,q_o] [--out benchmarks/results/gemm_diagnose.json]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
from common import device_ms, gpu_environment, host_us, write_result
from gemm import Case

from aegis_sdc.kernels import triton_gemm as tg

SHAPES = [("gate_up", 8192, 2048, 5632), ("q_o", 8192, 2048, 2048), ("kv", 8192, 2048, 256), ("8b.o", 8192, 4096, 4096)]


def variants(case: Case) -> dict:
    a, b, out, cfg = case.a, case.b, case.out, case.cfg
    common = dict(a_t=case.a_t, b_t=case.b_t, cfg=cfg, scratch=True)

    def launch(**kw):
        return lambda: tg.launch_checked_gemm(a, b, out, **common, **kw)

    checked = dict(c_side=case.c_side, row_check=True, row_side=True, stats=case.stats, counters=case.counters,
                   pool=case.pools[tg.CAPTURE_ROWS], capture=tg.CAPTURE_ROWS, row_threshold=1e30)  # fmt: skip
    inline = dataclasses.replace(cfg, inline_evidence=True)
    parts = dataclasses.replace(cfg, inline_evidence=True, inline_totals=False)  # inside, from the stored parts
    separate = dataclasses.replace(cfg, inline_evidence=False)
    # The by-product A·1 (and its S) a later wgrad reads: alone (no check: what finishing it costs),
    # and with the row check (the training step's checked forward and dgrad).
    rows = case.out.shape[0]
    outputs = dict(byproduct=torch.empty(rows, dtype=torch.float64, device=a.device),
                   byproduct_side=torch.empty(rows, 16, dtype=a.dtype, device=a.device))  # fmt: skip
    byproduct = dict(c_side=case.c_side, row_side=True, counters=case.counters, **outputs)
    training = dict(checked, **outputs)
    return {
        "unchecked": launch(),
        "side_only": launch(c_side=case.c_side, row_side=True, evidence=False),
        "partials_only": launch(row_check=True, evidence=False),
        "side_and_partials": launch(c_side=case.c_side, row_side=True, row_check=True, evidence=False),
        "row_inline": lambda: tg.launch_checked_gemm(a, b, out, **{**common, "cfg": inline}, **checked),
        "row_separate": lambda: tg.launch_checked_gemm(a, b, out, **{**common, "cfg": separate}, **checked),
        "row_byproduct_inline": lambda: tg.launch_checked_gemm(a, b, out, **{**common, "cfg": inline}, **training),
        "row_byproduct_parts": lambda: tg.launch_checked_gemm(a, b, out, **{**common, "cfg": parts}, **training),
        "byproduct_inline": lambda: tg.launch_checked_gemm(a, b, out, **{**common, "cfg": inline}, **byproduct),
        "byproduct_separate": lambda: tg.launch_checked_gemm(a, b, out, **{**common, "cfg": separate}, **byproduct),
        "rowcol": case.ours("rowcol"),
        "rowcol_parts": case.ours("rowcol", parts),
    }


def _variant_of(compiled) -> str:
    """The constexprs that tell a compiled variant apart (which checks, tile), as far as Triton shows them."""
    try:
        names = compiled.src.fn.arg_names
        constants = {names[key[0]]: value for key, value in compiled.src.constants.items()}
        wanted = (
            "ROW_CHECK",
            "ROW_SIDE",
            "COL_CHECK",
            "EVIDENCE",
            "TOTALS",
            "BYPRODUCT",
            "SIDE_OUT",
            "BM",
            "BN",
            "A_T",
        )
        return " ".join(f"{name}={constants[name]}" for name in wanted if name in constants)
    except (AttributeError, IndexError, KeyError, TypeError):
        return "?"


def profile_host() -> None:
    """Where the host time of a launch goes: cProfile over 300 queued launches of two variants."""
    import cProfile
    import pstats

    case = Case("fwd", 8192, 2048, 2048)
    for label in ("unchecked", "row_separate"):
        fn = variants(case)[label]
        fn()
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(300):
            fn()
        profiler.disable()
        torch.cuda.synchronize()
        print(f"--- {label}: host profile of 300 launches (cumulative) ---", flush=True)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
        print(f"--- {label}: (tottime) ---", flush=True)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gemm_diagnose.json")
    parser.add_argument("--profile-host", action="store_true", help="cProfile the host side of launches, then stop")
    parser.add_argument("--layers", default=",".join(name for name, *_ in SHAPES), help="which of SHAPES to run")
    args = parser.parse_args()
    if args.profile_host:
        profile_host()
        return
    rows = []
    for name, m, k, n in [shape for shape in SHAPES if shape[0] in args.layers.split(",")]:
        for kind in ("fwd", "wgrad"):
            case = Case(kind, m, k, n)
            row = {"layer": name, "M": m, "K": k, "N": n, "gemm": kind}
            row["cublas_ms"] = device_ms(case.cublas)
            row["cublas_host_us"] = host_us(case.cublas)
            for label, fn in variants(case).items():
                try:
                    row[f"{label}_ms"] = device_ms(fn)
                except RuntimeError as error:  # a variant this Triton cannot compile: recorded, not fatal
                    row[f"{label}_error"] = str(error).splitlines()[0][:200]
                    print(name, kind, label, "failed:", row[f"{label}_error"], flush=True)
                    continue
                row[f"{label}_ratio"] = row["cublas_ms"] / row[f"{label}_ms"]
                row[f"{label}_host_us"] = host_us(fn)
            rows.append(row)
            print(
                name, kind, {key: round(v, 3) for key, v in row.items() if key.endswith(("_ratio", "_us"))}, flush=True
            )
    kernels = []
    for device_cache in tg.checked_gemm_kernel.device_caches.values():
        for compiled in device_cache[0].values():
            entry = {key: getattr(compiled, key, None) for key in ("n_regs", "n_spills", "shared")}
            entry["variant"] = _variant_of(compiled)
            kernels.append(entry)
    for entry in kernels:
        print(f"kernel regs {entry['n_regs']} spills {entry['n_spills']}: {entry['variant']}", flush=True)
    write_result(args.out, gpu_environment(), rows, kernels=kernels)


if __name__ == "__main__":
    main()
