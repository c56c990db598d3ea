"""A row check that every tile completes by itself (a GPU speed probe; the interpreter runs its self-test).

Tile (i, j) compares its accumulator's row sums with A_i·c_j, c_j = B[:, block j]·1, taken as a
second narrow MMA on the A tile the K loop already holds (S_j [K, 16] per column block: c_j split
hi/lo/lo2) — or on the CUDA cores, the A tile times c_j's chunk (fp32) reduced every K step, or
accumulated as products [BM, BK] and reduced once after the loop, or with c_j's chunk taken from
the B tile the step loaded (its row sums: no vector made beforehand; with a column check too, from
the A tile's column sums) — so no cross-tile totals, no side loop after the K loop, no finishing:
each tile's largest normalized difference goes to one atomic maximum. Against cuBLAS, our kernel
unchecked and its row check (the training step's variant), in the same run; the registers and
spills of each probe.

    python benchmarks/gemm_tile_check.py [--out benchmarks/results/gemm_tile_check.json]
    TRITON_INTERPRET=1 python benchmarks/gemm_tile_check.py   # self-test on the CPU: clean 0, fault seen
"""

import argparse
import os
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from aegis_sdc.kernels import triton_gemm as tg
from aegis_sdc.kernels.gemm_side import SideMatrix

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# CHECK: where the tile's reference A_i·c_j is formed (0: no check)
# SELF_ROW / SELF_ROWCOL: c_j's chunk is the row sums of the B tile the step has loaded (no vector made
# beforehand, any GEMM kind), and for the column check u_i's chunk the column sums of the A tile.
TENSOR_CORES, CUDA_CORES_PER_STEP, CUDA_CORES_PRODUCTS, SELF_ROW, SELF_ROWCOL = 1, 2, 3, 4, 5
VARIANTS = {"exp_plain": 0, "exp_tile": TENSOR_CORES, "exp_tile_cuda_step": CUDA_CORES_PER_STEP,
            "exp_tile_cuda_products": CUDA_CORES_PRODUCTS, "exp_self_row": SELF_ROW,
            "exp_self_rowcol": SELF_ROWCOL}  # fmt: skip


@triton.jit
def tile_check_kernel(a_ptr, b_ptr, c_ptr, s_ptr, scale_ptr, cj_ptr, flag_ptr, M, N, K, stride_a, stride_b, stride_c,
                      threshold, fault_row, fault_col, fault_delta, A_T: tl.constexpr, B_T: tl.constexpr,
                      CHECK: tl.constexpr, FAULT: tl.constexpr, UPCAST: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    if A_T:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[stride_a, 1], block_shape=[BK, BM])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_a, 1], block_shape=[BM, BK])
    if B_T:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_b, 1], block_shape=[BN, BK])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_b, 1], block_shape=[BK, BN])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_c, 1], block_shape=[BM, BN])
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    s_desc = tl.make_tensor_descriptor(s_ptr, shape=[tiles_n * K, 16], strides=[16, 1], block_shape=[BK, 16])
    for tile_id in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0)):
        pid_m, pid_n = tg._tile_coords(tile_id, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        side = tl.zeros((BM, 16), dtype=tl.float32)  # CHECK 1: A·S_j on the tensor cores
        side_vec = tl.zeros((BM,), dtype=tl.float32)  # CHECK 2: A·c_j on the CUDA cores, reduced per step
        products = tl.zeros((BM, BK), dtype=tl.float32)  # CHECK 3: the products, reduced after the loop
        col_vec = tl.zeros((BN,), dtype=tl.float32)  # CHECK 5: u_i·B_j on the CUDA cores
        for ki in range(k_tiles):
            a = tg._load_a(a_desc, off_m, ki * BK, A_T, UPCAST)
            b = tg._load_b(b_desc, off_n, ki * BK, B_T, UPCAST)
            acc = tl.dot(a, b, acc)
            if CHECK >= 4:
                a32 = a.to(tl.float32)
                b32 = b.to(tl.float32)
                side_vec += tl.sum(a32 * tl.sum(b32, axis=1)[None, :], axis=1)
                if CHECK == 5:
                    col_vec += tl.sum(tl.sum(a32, axis=0)[:, None] * b32, axis=0)
            elif CHECK == 1:
                s = s_desc.load([pid_n * K + ki * BK, 0])
                side = tl.dot(a, s.to(tl.float32) if UPCAST else s, side)
            elif CHECK >= 2:
                ks = ki * BK + tl.arange(0, BK)
                chunk = tl.load(cj_ptr + pid_n * K + ks, mask=ks < K, other=0.0)
                if CHECK == 2:
                    side_vec += tl.sum(a.to(tl.float32) * chunk[None, :], axis=1)
                else:
                    products += a.to(tl.float32) * chunk[None, :]
        if FAULT:  # one accumulator element goes wrong
            rows = off_m + tl.arange(0, BM)
            cols = off_n + tl.arange(0, BN)
            hit = (rows == fault_row)[:, None] & (cols == fault_col)[None, :]
            acc = tl.where(hit, acc + fault_delta, acc)
        out = acc.to(c_ptr.dtype.element_ty)
        if CHECK:
            if CHECK == 1:
                col = tl.arange(0, 16)[None, :]
                scale_j = tl.load(scale_ptr + pid_n).to(tl.float64)  # 2ᵉ of S_j (1 for bf16)
                ref = tl.sum(tl.where(col < 3, side, 0.0).to(tl.float64), axis=1) / scale_j
            elif CHECK == 2 or CHECK >= 4:
                ref = side_vec.to(tl.float64)
            else:
                ref = tl.sum(products, axis=1).to(tl.float64)
            total = tl.sum(acc, axis=1)
            sq = tl.sum(acc * acc, axis=1)
            out_total = tl.sum(out.to(tl.float32), axis=1)
            scale = tl.sqrt(sq.to(tl.float64)) + 1e-30
            # the output's row sums are formed (as the kernel's check does) but judged elsewhere
            d = tl.abs(total.to(tl.float64) - ref) / scale + 0.0 * out_total.to(tl.float64)
            worst = tl.max(d, axis=0)
            if CHECK == 5:
                col_total = tl.sum(acc, axis=0)
                col_scale = tl.sqrt(tl.sum(acc * acc, axis=0).to(tl.float64)) + 1e-30
                d_col = tl.abs(col_total.to(tl.float64) - col_vec.to(tl.float64)) / col_scale
                worst = tl.maximum(worst, tl.max(d_col, axis=0))
            # one flag per launch, touched only by a tile that alarms (rare)
            tl.atomic_max(flag_ptr, worst.to(tl.float32), mask=worst > threshold, sem="relaxed")
        c_desc.store([off_m, off_n], out)


def side_blocks(b, b_t, bn, dtype):
    """S_j [tiles_n·K, 16]: per column block j of B, S of c_j = B[:, block j]·1."""
    bk = b.t() if b_t else b  # logical B [K, N]
    k, n = bk.shape
    tiles_n = -(-n // bn)
    pad = tiles_n * bn - n
    bb = torch.nn.functional.pad(bk.double(), (0, pad))
    cj = bb.view(k, tiles_n, bn).sum(2).t().contiguous()  # [tiles_n, K]
    sides = [SideMatrix.of(cj[j], dtype) for j in range(tiles_n)]
    return torch.cat([x.matrix for x in sides]), torch.cat([x.scale for x in sides]), cj.float().contiguous()


def launch(a, b, out, s, flag, a_t, b_t, check: int, cfg, threshold=1e30, fault=None):
    M, N = out.shape
    K = a.shape[0] if a_t else a.shape[1]
    tiles = -(-M // cfg.block_m) * -(-N // cfg.block_n)
    grid = (min(tg.num_sms(a.device), tiles),)
    return tile_check_kernel[grid](a, b, out, *s, flag, M, N, K, a.stride(0), b.stride(0), out.stride(0), threshold,
                            *(fault or (0, 0, 0.0)), A_T=a_t, B_T=b_t, CHECK=check, FAULT=fault is not None,
                            UPCAST=INTERPRET, BM=cfg.block_m, BN=cfg.block_n,
                            BK=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
                            num_stages=cfg.num_stages)  # fmt: skip


def selftest():
    torch.manual_seed(0)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    cfg = tg.INTERPRETER_CONFIG
    for a_t, b_t in [(False, True), (True, False), (False, False)]:
        M, N, K = 64, 96, 48
        A = torch.randn(M, K, dtype=torch.float16)
        B = torch.randn(K, N, dtype=torch.float16)
        a = A.t().contiguous() if a_t else A
        b = B.t().contiguous() if b_t else B
        out = torch.empty(M, N, dtype=torch.float16)
        s = side_blocks(b, b_t, cfg.block_n, torch.float16)
        for check in (TENSOR_CORES, CUDA_CORES_PER_STEP, CUDA_CORES_PRODUCTS, SELF_ROW, SELF_ROWCOL):
            flag = torch.zeros(1)
            launch(a, b, out, s, flag, a_t, b_t, check, cfg, threshold=1e-5)
            ref = A.float() @ B.float()
            assert (out.float() - ref).abs().max().item() < 0.05, "fp16 output rounding"
            assert flag.item() == 0.0, (check, flag)
            launch(a, b, out, s, flag, a_t, b_t, check, cfg, threshold=1e-5, fault=(37, 70, 0.5))
            assert flag.item() > 1e-3, (check, flag)
            print(a_t, b_t, check, "clean: no alarm; fault: normalized difference", flag.item())


def _probe(case, s, flag, check: int):
    return lambda: launch(case.a, case.b, case.out, s, flag, case.a_t, case.b_t, check, case.cfg)


def bench(out_path: Path):
    from common import device_ms, gpu_environment, write_result
    from gemm import Case
    from gemm_diagnose import variants

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    shapes = [
        ("gate_up", 8192, 2048, 5632),
        ("q_o", 8192, 2048, 2048),
        ("kv", 8192, 2048, 256),
        ("8b.o", 8192, 4096, 4096),
        ("lm_head", 8192, 2048, 32000),
    ]
    rows = []
    for name, m, k, n in shapes:
        for kind in ("fwd", "dgrad", "wgrad"):
            case = Case(kind, m, k, n)
            cfg = case.cfg
            s = side_blocks(case.b, case.b_t, cfg.block_n, case.a.dtype)
            flag = torch.zeros(1, device="cuda")
            clean_max = {}  # every tile reports: the largest clean normalized difference
            registers = {}  # registers and spills of each compiled probe
            for label, check in VARIANTS.items():
                flag.zero_()
                compiled = launch(case.a, case.b, case.out, s, flag, case.a_t, case.b_t, check, cfg, threshold=-1.0)
                registers[label] = [getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None)]
                if check:
                    clean_max[label] = flag.item()
            r = {"cublas": device_ms(case.cublas)}
            ours = variants(case)
            r["ours_unchecked"] = device_ms(ours["unchecked"])
            r["ours_row"] = device_ms(ours["row_byproduct_inline"])
            for label, check in VARIANTS.items():
                r[label] = device_ms(_probe(case, s, flag, check))
            ratios = {f"{key}_ratio": r["cublas"] / v for key, v in r.items() if key != "cublas"}
            rows.append(
                {
                    "layer": name,
                    "gemm": kind,
                    "shape": list(case.shape),
                    "tile": [cfg.block_m, cfg.block_n],
                    **{f"{key}_ms": v for key, v in r.items()},
                    **ratios,
                    **{f"{label}_clean_max_difference": v for label, v in clean_max.items()},
                    "registers_spills": registers,
                }
            )
            print(name, kind, {key: round(v, 3) for key, v in ratios.items()}, clean_max, registers, flush=True)
    summary = {}
    for key in ("ours_unchecked", "ours_row", *VARIANTS):
        values = [row[f"{key}_ratio"] for row in rows]
        summary[f"median_ratio_{key}"] = statistics.median(values)
        summary[f"min_ratio_{key}"] = min(values)
    for label, check in VARIANTS.items():
        if check:
            summary[f"{label}_clean_max_difference"] = max(row[f"{label}_clean_max_difference"] for row in rows)
    write_result(out_path, gpu_environment(), rows, summary)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gemm_tile_check.json")
    args = parser.parse_args()
    selftest() if INTERPRET else bench(args.out)
