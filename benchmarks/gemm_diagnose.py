"""Where a checked GEMM's time goes (GPU diagnostic): the parts of a check switched on one by one.

For a few shapes, device time (`common.device_ms`: CUDA-graph replays) of: cuBLAS; our kernel
unchecked; with the reference side only (no partials, no evidence); with the epilogue partials only
(no side, no evidence); the full row check with evidence inside the launch and in a second launch;
the row check with the by-product (the training step's checked forward and dgrad), its evidence
inside the launch from fp64 totals the tiles add by atomics or from their stored parts; the by-product
A·1 alone, inside and in a second launch; the wgrad's row+col check (both ways inside). Then the host
time per launch (launches queued back to back, no synchronization), and the registers and spills of
every compiled variant.

`--evidence-parts`: the training step's checked launch with one part of its evidence switched off or
changed at a time (the kernel's module loaded again from patched source; `--parts` picks which of
`_EVIDENCE_CHANGES`, each with counters of its own), beside the same launch whole, with a second
launch, and with no evidence. `--warp-specialized`: the kernel's parts with Triton's warp
specialization of the tile loop, and whether its output is bit-identical.

`--rowcol-parts`: the wgrad's row+col launch with one column part left out at a time (the column side,
the column partials, their sums of squares, the column blocks' finish: `_COLUMN_CHANGES`), wgrads only.

`--side-groups 1,2,4,8`: the reference side's slices taken by every g-th tile of a block, g times as
long (TritonGemmConfig.side_group), for each g: the side and partials alone, the training step's
checked launch, and the wgrad's row+col. The value `loop` is the row side inside every tile's K loop
instead (TritonGemmConfig.side_in_loop), `cuda` its slices in the K loop on the CUDA cores
(side_on_cuda_cores), `cuda_rc` the column side's too (col_side_on_cuda_cores):
`--layers kv,7b.kv,70b.kv,q_o --side-groups 1,loop,cuda,cuda_rc`.

    python benchmarks/gemm_diagnose.py [--layers gate_up,q_o] [--evidence-parts [--parts a,b] | --warp-specialized
        | --side-groups 1,2,4 | --rowcol-parts] [--out benchmarks/results/gemm_diagnose.json]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from pathlib import Path

import torch
from common import device_ms, gpu_environment, host_us, module_with_edits, write_result
from gemm import Case

from aegis_sdc.kernels import triton_gemm as tg

SHAPES = [("gate_up", 8192, 2048, 5632), ("q_o", 8192, 2048, 2048), ("kv", 8192, 2048, 256), ("8b.o", 8192, 4096, 4096),
          ("7b.kv", 8192, 3584, 512), ("70b.kv", 8192, 8192, 128)]  # fmt: skip


def variants(case: Case, warp_specialized: bool = False, stages: int | None = None, side_group: int | str = 1) -> dict:
    """The variants by name; with `warp_specialized`, the same parts on the kernel with its tile loop
    warp-specialized (`_KERNEL_CHANGES["warp_specialized"]`: Triton's Hopper partitioning, a producer
    warp group for the TMA loads and two consumer warp groups that split the tile's rows; one warp
    group per consumer: num_warps = 4). `side_group`: TritonGemmConfig.side_group (every g-th tile
    computes a reference-side slice g times as long), or "loop": the row side in the K loop
    (TritonGemmConfig.side_in_loop) as a second MMA, "cuda": its slices there on the CUDA cores
    (side_on_cuda_cores), "cuda_rc": the column side's too (col_side_on_cuda_cores)."""
    a, b, out = case.a, case.b, case.out
    in_loop = side_group in ("loop", "cuda", "cuda_rc")
    cfg = dataclasses.replace(case.cfg, side_group=1 if in_loop else side_group, side_in_loop=side_group == "loop",
                              side_on_cuda_cores=side_group in ("cuda", "cuda_rc"),
                              col_side_on_cuda_cores=side_group == "cuda_rc")  # fmt: skip
    kernels = tg
    if warp_specialized:
        kernels = _kernel_module_changed("warp_specialized")
        cfg = kernels.TritonGemmConfig(**{**dataclasses.asdict(cfg), "num_warps": 4,
                                          "num_stages": stages or cfg.num_stages})  # fmt: skip
    common = dict(a_t=case.a_t, b_t=case.b_t, cfg=cfg, scratch=True)

    def launch(**kw):
        return lambda: kernels.launch_checked_gemm(a, b, out, **{**common, **kw})

    checked = dict(c_side=case.c_side, row_check=True, row_side=True, stats=case.stats, counters=case.counters,
                   pool=case.pools[tg.CAPTURE_ROWS], capture=tg.CAPTURE_ROWS, row_threshold=1e30)  # fmt: skip
    inline = dataclasses.replace(cfg, inline_evidence=True)
    parts = dataclasses.replace(cfg, inline_evidence=True, inline_totals=False)  # inside, from the stored parts
    separate = dataclasses.replace(cfg, inline_evidence=False)
    parts_of_check = {
        "unchecked": launch(),
        "side_only": launch(c_side=case.c_side, row_side=True, evidence=False),
        "partials_only": launch(row_check=True, evidence=False),
        "side_and_partials": launch(c_side=case.c_side, row_side=True, row_check=True, evidence=False),
    }
    row_separate = launch(cfg=separate, **checked)
    if warp_specialized:  # what the warp-specialized kernel compiles (evidence in a second launch)
        return {f"ws_{key}": fn for key, fn in parts_of_check.items()} | {"ws_row_separate": row_separate}
    # The by-product A·1 (and its S) a later wgrad reads: alone (no check: what finishing it costs),
    # and with the row check (the training step's checked forward and dgrad).
    rows = case.out.shape[0]
    outputs = dict(byproduct=torch.empty(rows, dtype=torch.float64, device=a.device),
                   byproduct_side=torch.empty(rows, 16, dtype=a.dtype, device=a.device))  # fmt: skip
    byproduct = dict(c_side=case.c_side, row_side=True, counters=case.counters, **outputs)
    training = dict(checked, **outputs)
    return parts_of_check | {
        "row_inline": launch(cfg=inline, **checked),
        "row_separate": row_separate,
        "row_byproduct_inline": launch(cfg=inline, **training),
        "row_byproduct_parts": launch(cfg=parts, **training),
        "byproduct_inline": launch(cfg=inline, **byproduct),
        "byproduct_separate": launch(cfg=separate, **byproduct),
        "rowcol": case.ours("rowcol", cfg),
        "rowcol_parts": case.ours("rowcol", parts),
    }


# The kernel's module loaded again from its source with one change (anchor, replacement, how often the
# anchor occurs). Diagnostic only. First, Triton's warp specialization of the tile loop (it compiles
# only launches without evidence inside and without a column check: docs/gpu.md); then, where the
# evidence inside the launch costs, one part of it changed at a time (`--evidence-parts`).
_SIDE_ADDS = "M, True, A_T, True, TOTALS and ROW_CHECK,\n" + " " * 27 + "TOTALS and (BYPRODUCT or SIDE_OUT)"
_FINISH = "    if EVIDENCE:\n        # A block is finished"
_TILE_LOOP = "    for tile_id in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0)):"
_WARP_SPECIALIZED = {"warp_specialized": [(_TILE_LOOP, _TILE_LOOP[:-2] + ", warp_specialize=True):", 1)]}
_EVIDENCE_CHANGES = {
    # the tiles add nothing to the totals (the finish then reads zeros)
    "no_additions": [
        ("row_sq_total, TOTALS)", "row_sq_total, False)", 2),
        ("col_sq_total, TOTALS)", "col_sq_total, False)", 1),
        (_SIDE_ADDS, "M, True, A_T, True, False,\n" + " " * 27 + "False", 1),
    ],
    # nothing after the tile loop (the additions land, nobody judges)
    "no_finish": [(_FINISH, "    if False:\n        # A block", 1)],
    # compiled in, never run (M is a runtime argument): the cost of its presence alone
    "finish_never_run": [(_FINISH, "    if EVIDENCE and M < 0:\n        # A", 1)],
    # the finish's three steps one at a time: the program's first fence, its blocks, the launch's verdict
    "no_first_fence": [("        fence_gpu(UPCAST)  # UPCAST is set", "        # UPCAST is set", 1)],
    "no_block_finish": [("    for c0 in range(0, mine, CHUNK):", "    for c0 in range(0, 0, CHUNK):", 1)],
    # the tiles counted into their blocks, no block finished (a ticket is never negative)
    "tickets_only": [("(valid & (ticket == tiles_n - 1), index, pid_m", "(valid & (ticket < 0), index, pid_m", 1)],
    # the counters packed side by side, as before they took a line each
    "counters_packed": [("COUNTER_STRIDE = tl.constexpr(32)", "COUNTER_STRIDE = tl.constexpr(1)", 1)],
    # counts (and the finish of the blocks they complete) in vectors of 16 tiles instead of 8: fewer
    # rounds, vectors of 16·BLOCK rows at the finish
    "chunk_16": [
        (
            "INTERPRETED: tl.constexpr, CHUNK: tl.constexpr = 8)",
            "INTERPRETED: tl.constexpr, CHUNK: tl.constexpr = 16)",
            1,
        )
    ],
    # the rounded output's row sums in fp32 (each element unpacked and added: the kernel before its
    # integer checksums of the output's bits, `_output_checksums`)
    "out_sums_values": [("_output_checksums(out, UPCAST, BN)", "tl.sum(out.to(tl.float32), axis=1)", 1)],
    # no launch verdict at all
    "no_verdict": [
        ("        if ROW_CHECK or COL_CHECK:\n            fence", "        if False:\n            fence", 1)
    ],
    # the launch's count without the fence and barrier before it (the slot's atomics are scalar: the
    # counting thread's own)
    "verdict_unfenced": [
        (
            "            fence_gpu(UPCAST)\n            tl.debug_barrier()\n            if count_done",
            "            if count_done",
            1,
        )
    ],
}


# Where a wgrad's column check costs (`--rowcol-parts`): its row+col launch with one column part left
# out at a time (the verdict then compares against what is missing: timing only).
_COLUMN_CHANGES = {
    # no column side: the tiles' slices of Bᵀ·S(u1) after their K loops
    "no_col_side": [
        (
            "        if COL_CHECK:\n            first, stop = _slices_of(pid_m",
            "        if False:\n            first, stop = _slices_of(pid_m",
            1,
        )
    ],
    # no column partials: the accumulator's column sums and sums of squares in the epilogue
    "no_col_partials": [
        (
            "            _store_partials(acc, 0, col_part_ptr",
            "            if False:\n                _store_partials(acc, 0, col_part_ptr",
            1,
        )
    ],
    # no column sums of squares (the column partials' sums alone)
    "no_col_squares": [
        ("    sq = tl.sum(acc * acc, axis=AXIS)", "    sq = tl.sum(acc * acc, axis=AXIS) if AXIS == 1 else total", 1)
    ],
    # no column block finished inside the launch (the tiles add their totals, nobody judges the columns)
    "no_col_finish": [
        (
            "        if COL_CHECK:\n            ticket = tl.atomic_add(col_done",
            "        if False:\n            ticket = tl.atomic_add(col_done",
            1,
        )
    ],
}
_KERNEL_CHANGES = _WARP_SPECIALIZED | _EVIDENCE_CHANGES | _COLUMN_CHANGES


def _kernel_module_changed(change: str):
    """triton_gemm loaded again from its source with `_KERNEL_CHANGES[change]` made."""
    return module_with_edits(Path(tg.__file__), _KERNEL_CHANGES[change], f"triton_gemm_{change}", "triton_gemm")


def evidence_part_variants(case: Case, parts: list[str]) -> dict:
    """The training step's checked launch (row check, by-product, evidence inside) with each named
    change of `_EVIDENCE_CHANGES`."""
    inline = dataclasses.replace(case.cfg, inline_evidence=True)
    rows = case.out.shape[0]
    kw = dict(a_t=case.a_t, b_t=case.b_t, scratch=True, c_side=case.c_side, row_check=True, row_side=True,
              stats=case.stats, counters=case.counters, pool=case.pools[tg.CAPTURE_ROWS], capture=tg.CAPTURE_ROWS,
              row_threshold=1e30, byproduct=torch.empty(rows, dtype=torch.float64, device=case.a.device),
              byproduct_side=torch.empty(rows, 16, dtype=case.a.dtype, device=case.a.device))  # fmt: skip
    out = {}
    for part in parts:
        module = _kernel_module_changed(part)
        cfg = module.TritonGemmConfig(**dataclasses.asdict(inline))
        # Counters of its own: a variant that counts without finishing (`tickets_only`) leaves its
        # counters climbing, and a later variant sharing them would never complete a block — it would
        # time a launch that finishes nothing (an earlier run of this script did exactly that).
        own = dict(kw, counters=torch.zeros_like(case.counters))
        out[f"row_byproduct_inline_{part}"] = lambda m=module, cfg=cfg, own=own: m.launch_checked_gemm(
            case.a, case.b, case.out, cfg=cfg, **own
        )
    return out


def column_part_variants(case: Case) -> dict:
    """A wgrad's row+col launch whole, then with each of `_COLUMN_CHANGES` (counters of its own)."""
    out = {"rowcol": case.ours("rowcol")}
    for part in _COLUMN_CHANGES:
        module = _kernel_module_changed(part)
        cfg = module.TritonGemmConfig(**dataclasses.asdict(case.cfg))
        own = copy.copy(case)
        own.counters = torch.zeros_like(case.counters)
        out[f"rowcol_{part}"] = own.ours("rowcol", cfg, launch=module.launch_checked_gemm)
    return out


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
    parser.add_argument(
        "--evidence-parts",
        action="store_true",
        help="the evidence inside the launch with one part changed at a time, beside a few others",
    )
    parser.add_argument("--parts", default=",".join(_EVIDENCE_CHANGES),
                        help="with --evidence-parts: which of its changes (default: all)")  # fmt: skip
    parser.add_argument("--rowcol-parts", action="store_true",
                        help="the wgrad's row+col launch with one column part left out at a time")  # fmt: skip
    parser.add_argument("--warp-specialized", action="store_true",
                        help="the warp-specialized variants, and whether their output is bit-identical")  # fmt: skip
    parser.add_argument("--side-groups", default=None,
                        help="side_group values to sweep, comma-separated (TritonGemmConfig)")  # fmt: skip
    args = parser.parse_args()
    if args.profile_host:
        profile_host()
        return
    rows = []
    for name, m, k, n in [shape for shape in SHAPES if shape[0] in args.layers.split(",")]:
        for kind in ("wgrad",) if args.rowcol_parts else ("fwd", "wgrad"):
            case = Case(kind, m, k, n)
            row = {"layer": name, "M": m, "K": k, "N": n, "gemm": kind}
            row["cublas_ms"] = device_ms(case.cublas)
            row["cublas_host_us"] = host_us(case.cublas)
            chosen = variants(case)
            if args.warp_specialized and case.cfg.block_m == 128:  # (Triton 3.6 aborts on BM = 64 tiles)
                chosen = {key: chosen[key] for key in ("unchecked", "side_and_partials", "row_separate",
                                                       "row_byproduct_inline")}  # fmt: skip
                chosen["unchecked"]()
                expected = case.out.clone()
                try:
                    chosen |= variants(case, warp_specialized=True)
                    # two stages: what fits the side's own load buffers beside the K loop's in shared memory
                    chosen |= {key.replace("ws_", "ws2_"): fn
                               for key, fn in variants(case, warp_specialized=True, stages=2).items()}  # fmt: skip
                    chosen["ws_unchecked"]()
                    row["ws_output_bit_identical"] = bool(torch.equal(case.out.view(torch.int16),
                                                                      expected.view(torch.int16)))  # fmt: skip
                except RuntimeError as error:
                    row["ws_error"] = str(error).splitlines()[0][:200]
            if args.side_groups:
                swept = ("side_and_partials", "row_byproduct_inline", "rowcol")
                groups = (v if v in ("loop", "cuda", "cuda_rc") else int(v) for v in args.side_groups.split(","))
                chosen = {"unchecked": chosen["unchecked"]} | {
                    f"{key}_g{g}": fn for g in groups
                    for key, fn in variants(case, side_group=g).items() if key in swept
                }  # fmt: skip
            if args.rowcol_parts:
                chosen = {"unchecked": chosen["unchecked"], "row_inline": chosen["row_inline"]}
                chosen |= column_part_variants(case)
            if args.evidence_parts:
                chosen = {key: chosen[key] for key in ("unchecked", "side_and_partials", "row_separate",
                                                       "row_byproduct_inline")}  # fmt: skip
                unknown = set(args.parts.split(",")) - set(_EVIDENCE_CHANGES)
                if unknown:
                    raise SystemExit(f"unknown --parts {sorted(unknown)}; known: {list(_EVIDENCE_CHANGES)}")
                chosen |= evidence_part_variants(case, args.parts.split(","))
            for label, fn in chosen.items():
                try:
                    row[f"{label}_ms"] = device_ms(fn)
                except Exception as error:  # a variant this Triton cannot compile or fit: recorded, not fatal
                    row[f"{label}_error"] = str(error).splitlines()[0][:200]
                    print(name, kind, label, "failed:", row[f"{label}_error"], flush=True)
                    continue
                row[f"{label}_ratio"] = row["cublas_ms"] / row[f"{label}_ms"]
                row[f"{label}_host_us"] = host_us(fn)
            rows.append(row)
            write_result(args.out, gpu_environment(), rows)  # so far: a run cut short keeps what it measured
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
