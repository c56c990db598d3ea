"""CUTLASS's own Hopper GEMM beside ours (GPU probe): could another kernel language check faster?

Runs, in one process and on the same operands (benchmarks/gemm.Case, M = 8 192 tokens, bf16, the
layouts of a Linear's forward, dgrad and wgrad): cuBLAS; our Triton kernel unchecked, with the
epilogue partials only, and with the training step's row check; and the CuTe DSL
(`nvidia-cutlass-dsl`) persistent dense GEMM for Hopper from CUTLASS's examples
(`examples/python/CuTeDSL/cute/hopper/kernel/dense_gemm/dense_gemm_persistent.py`): unchecked; with
the same epilogue partials as ours — the per-tile row sums and sums of squares of the fp32
accumulator, stored to [2·tiles_n, M]; and with those partials and a reference-side MMA in every K
step — a second wgmma of N = 16 on the A tile in shared memory, issued in the same wgmma group as the
main one, against 16 rows of the B tile (the timing of a tile-local A_i·S_j, whose S_j would add a
[BK, 16] load per stage; its values are not a checksum here). `_with_checks` adds these to the
example's source at run time (the example is not part of this project: pass its path). Each CUTLASS
variant takes the best of 128×256 tiles in 1×1 and 2×1 clusters and 128×128 tiles. GPU time from CUDA-graph
replays.

    python benchmarks/cutlass_probe.py --example PATH/dense_gemm_persistent.py \
        [--out benchmarks/results/cutlass_probe.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import device_ms, gpu_environment, module_with_edits, write_result
from gemm import Case
from gemm_diagnose import variants

SHAPES = [
    ("gate_up", 8192, 2048, 5632),
    ("q_o", 8192, 2048, 2048),
    ("kv", 8192, 2048, 256),
    ("8b.o", 8192, 4096, 4096),
    ("8b.down", 8192, 14336, 4096),
    ("lm_head", 8192, 2048, 32000),
]
CONFIGS = [((128, 256), (1, 1)), ((128, 256), (2, 1)), ((128, 128), (1, 1))]

# The epilogue partials, inserted before the example's epilogue. The wgmma accumulator of one warp
# group holds, per thread, values (c, h, j) at column 2t + c + 8j and row +8h of its 64-row slab
# (t = lane % 4): each thread sums its values of a row, then the 4 lanes of a quad combine.
_ROW_PARTIALS = """
                if cutlass.const_expr(self.row_sums):
                    lane = tidx % 32
                    warp_in_wg = (tidx // 32) % 4
                    wg = warp_group_idx - self.num_dma_warp_groups
                    atom_vals = cute.size(accumulators, mode=[0])
                    for m in cutlass.range_constexpr(cute.size(accumulators, mode=[1])):
                        row0 = (tile_coord_mnl[0] * self.tile_shape_mnk[0] + m * 64 * self.num_mma_warp_groups
                                + wg * 64 + warp_in_wg * 16 + lane // 4)
                        for h in cutlass.range_constexpr(2):
                            s = cutlass.Float32(0.0)
                            q = cutlass.Float32(0.0)
                            for j in cutlass.range_constexpr(atom_vals // 4):
                                for c in cutlass.range_constexpr(2):
                                    x = accumulators[m * atom_vals + c + 2 * h + 4 * j]
                                    s = s + x
                                    q = q + x * x
                            s = cute.arch.warp_reduction_sum(s, threads_in_group=4)
                            q = cute.arch.warp_reduction_sum(q, threads_in_group=4)
                            if lane % 4 == 0:
                                mPart[tile_coord_mnl[1] * 2, row0 + 8 * h] = s
                                mPart[tile_coord_mnl[1] * 2 + 1, row0 + 8 * h] = q

                # Epilogue
"""
# (anchor in the example, what replaces it): a `row_sums` switch, the partials tensor threaded from
# the host call into the kernel, and the partials before the epilogue; then the side MMA's
_EDITS = [
    ("        raster_along_m: bool,\n    ):", "        raster_along_m: bool,\n        row_sums: bool = False,\n    ):\n"
     "        self.row_sums = row_sums"),
    ("        c: cute.Tensor,\n        max_active_clusters: cutlass.Constexpr,",
     "        c: cute.Tensor,\n        part: cute.Tensor,\n        max_active_clusters: cutlass.Constexpr,"),
    ("            tma_tensor_c,\n            self.tiled_mma,", "            tma_tensor_c,\n            part,\n"
     "            self.tiled_mma,"),
    ("        mC_mnl: cute.Tensor,\n        tiled_mma: cute.TiledMma,",
     "        mC_mnl: cute.Tensor,\n        mPart: cute.Tensor,\n        tiled_mma: cute.TiledMma,"),
    ("\n                # Epilogue\n", _ROW_PARTIALS),
]  # fmt: skip
_SIDE_INIT = """
        # the side: the same A tile against the B tile's first 16 rows (N), a wgmma of N = 16
        thr_mma_side = tiled_mma_side.get_slice(
            mma_warp_group_thread_layout(warp_group_idx - self.num_dma_warp_groups)
        )
        sB_side = cute.local_tile(sB, (16, self.tile_shape_mnk[2], self.ab_stage), (0, 0, 0))
        tCrA_side = tiled_mma_side.make_fragment_A(thr_mma_side.partition_A(sA))
        tCrB_side = tiled_mma_side.make_fragment_B(thr_mma_side.partition_B(sB_side))
        acc_side = cute.make_rmem_tensor(
            tiled_mma_side.partition_shape_C((self.tile_shape_mnk[0], 16)), self.acc_dtype
        )
"""
_SIDE_MMA = """
        self.tiled_mma_side = sm90_utils.make_trivial_tiled_mma(
            self.a_dtype,
            self.b_dtype,
            self.a_layout.sm90_mma_major_mode(),
            self.b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            self.atom_layout_mnk,
            tiler_mn=(64, 16),
        )
"""
_SIDE_ZERO = """
                if cutlass.const_expr(self.side_mma):
                    acc_side.fill(0.0)
                    tiled_mma_side.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
"""
_ACCUMULATE = """\
                accumulators.fill(0.0)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
"""
_MMA_K = "        mma_inst_shape_k = cute.size(self.tiled_mma.shape_mnk, mode=[2])\n"
_FRAGMENT_B = "        tCrB = tiled_mma.make_fragment_B(tCsB)\n"
# a `side_mma` switch, the side's tiled MMA threaded into the kernel, its fragments, its zeroing per tile
_SIDE_EDITS = [
    ("        row_sums: bool = False,\n    ):\n        self.row_sums = row_sums",
     "        row_sums: bool = False,\n        side_mma: bool = False,\n    ):\n        self.row_sums = row_sums\n"
     "        self.side_mma = side_mma"),
    (_MMA_K, _SIDE_MMA.lstrip("\n") + _MMA_K),
    ("            part,\n            self.tiled_mma,",
     "            part,\n            self.tiled_mma,\n            self.tiled_mma_side,"),
    ("        mPart: cute.Tensor,\n        tiled_mma: cute.TiledMma,",
     "        mPart: cute.Tensor,\n        tiled_mma: cute.TiledMma,\n        tiled_mma_side: cute.TiledMma,"),
    (_FRAGMENT_B, _FRAGMENT_B + _SIDE_INIT.lstrip("\n")),
    (_ACCUMULATE, _ACCUMULATE + _SIDE_ZERO.lstrip("\n")),
]  # fmt: skip
# the main wgmma of each k-block (in the prologue and the main loop), followed by the side's
_GEMM_CALL = """\
                        cute.gemm(
                            tiled_mma,
                            accumulators,
                            tCrA[k_block_coord],
                            tCrB[k_block_coord],
                            accumulators,
                        )
"""
_SIDE_GEMM = """\
                        if cutlass.const_expr(self.side_mma):
                            cute.gemm(
                                tiled_mma_side,
                                acc_side,
                                tCrA_side[k_block_coord],
                                tCrB_side[k_block_coord],
                                acc_side,
                            )
"""
# the side's values enter the row partials (so they are live; subtracted, as a check's reference is)
_SIDE_USE = "                            for j in cutlass.range_constexpr(atom_vals // 4):\n"
_SIDE_USE_NEW = (
    """\
                            if cutlass.const_expr(self.side_mma):
                                side_vals = cute.size(acc_side, mode=[0])
                                for j2 in cutlass.range_constexpr(side_vals // 4):
                                    for c2 in cutlass.range_constexpr(2):
                                        s = s - acc_side[m * side_vals + c2 + 2 * h + 4 * j2]
"""
    + _SIDE_USE
)


def _with_checks(example: Path):
    """The example's module with the partials and the side MMA added (each anchor must occur as often as
    expected: a changed example fails here, not with a wrong measurement)."""
    edits = [(a, r, 1) for a, r in _EDITS + _SIDE_EDITS] + [(_GEMM_CALL, _GEMM_CALL + _SIDE_GEMM, 2),
                                                            (_SIDE_USE, _SIDE_USE_NEW, 1)]  # fmt: skip
    # (the DSL reads its kernels' source back (inspect) to stage their control flow)
    return module_with_edits(example, edits, "cutlass_gemm_with_row_partials", f"{example}: the CuTe DSL example")


def _cute_operands(case: Case):
    """A [M, K, 1], B [N, K, 1] and C [M, N, 1] as the example takes them (k-/m-major A, k-/n-major B)."""
    from cutlass.cute.runtime import from_dlpack

    a = case.a.t() if case.a_t else case.a  # logical A [M, K]
    b = case.b if case.b_t else case.b.t()  # logical B as [N, K]
    tensors = [t.unsqueeze(2) for t in (a, b, case.out)]
    cute = [
        from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=1 if t.stride(1) == 1 else 0) for t in tensors
    ]
    return (*cute, a, b)


def _stream():
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def _cutlass_rows(module, case: Case, row: dict) -> None:
    """Both CUTLASS variants at each configuration into `row` (ms, ratio, output and row-sum error)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack

    a_c, b_c, c_c, a, b = _cute_operands(case)
    ref = a.float() @ b.float().t()
    hardware = cutlass.utils.HardwareInfo()
    m, n = case.out.shape
    for tile, cluster in CONFIGS:
        part = torch.zeros(2 * -(-n // tile[1]), m, device="cuda", dtype=torch.float32)
        p_c = from_dlpack(part, assumed_align=16).mark_layout_dynamic(leading_dim=1)
        for variant, rows, side in (("unchecked", False, False), ("rows", True, False), ("rows_side", True, True)):
            tag = f"cutlass_{variant}_{tile[0]}x{tile[1]}_c{cluster[0]}{cluster[1]}"
            gemm = module.HopperWgmmaGemmPersistentKernel(cutlass.Float32, tile, cluster, 1, True, rows, side)
            started = time.perf_counter()
            active = hardware.get_max_active_clusters(cluster[0] * cluster[1])
            fn = cute.compile(gemm, a_c, b_c, c_c, p_c, active, _stream())
            row[f"{tag}_compile_s"] = time.perf_counter() - started
            fn(a_c, b_c, c_c, p_c, _stream())
            torch.cuda.synchronize()
            row[f"{tag}_relerr"] = ((case.out.float() - ref).norm() / ref.norm()).item()
            if rows and not side:
                sums = part[0::2].sum(0)
                row[f"{tag}_rowsum_relerr"] = ((sums - ref.sum(1)).norm() / ref.sum(1).norm()).item()
            row[f"{tag}_ms"] = device_ms(lambda fn=fn, p_c=p_c: fn(a_c, b_c, c_c, p_c, _stream()))
    for variant in ("unchecked", "rows", "rows_side"):
        times = [row.get(f"cutlass_{variant}_{t[0]}x{t[1]}_c{c[0]}{c[1]}_ms", float("inf")) for t, c in CONFIGS]
        row[f"cutlass_{variant}_best_ms"] = min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", type=Path, required=True, help="CUTLASS's dense_gemm_persistent.py (CuTe DSL)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cutlass_probe.json")
    args = parser.parse_args()
    module = _with_checks(args.example)
    torch.zeros(1, device="cuda")  # the driver context, which CUTLASS's HardwareInfo needs
    rows = []
    for name, m, k, n in SHAPES:
        for kind in ("fwd", "wgrad", "dgrad"):
            case = Case(kind, m, k, n)
            row = {"layer": name, "gemm": kind, "shape": list(case.shape), "cublas_ms": device_ms(case.cublas)}
            ours = variants(case)
            for label in ("unchecked", "partials_only", "row_byproduct_inline"):
                row[f"triton_{label}_ms"] = device_ms(ours[label])
            _cutlass_rows(module, case, row)
            for key in [key for key in row if key.endswith("_ms") and key != "cublas_ms"]:
                row[key.removesuffix("_ms") + "_ratio"] = row["cublas_ms"] / row[key]
            rows.append(row)
            print(
                name,
                kind,
                {key: round(v, 3) for key, v in row.items() if key.endswith(("best_ratio", "inline_ratio"))},
                flush=True,
            )
    summary = {}
    for name, key in (
        ("triton_unchecked", "triton_unchecked"),
        ("triton_epilogue_partials", "triton_partials_only"),
        ("triton_row_check", "triton_row_byproduct_inline"),
        ("cutlass_dsl_unchecked", "cutlass_unchecked_best"),
        ("cutlass_dsl_epilogue_partials", "cutlass_rows_best"),
        ("cutlass_dsl_partials_and_side_mma", "cutlass_rows_side_best"),
    ):
        values = [row[f"{key}_ratio"] for row in rows]
        summary[f"median_ratio_{name}"] = statistics.median(values)
        summary[f"min_ratio_{name}"] = min(values)
    import cutlass

    write_result(args.out, gpu_environment(cutlass_dsl=getattr(cutlass, "__version__", "unknown")), rows, summary)


if __name__ == "__main__":
    main()
