"""The fused Triton GEMM against the reference path: values, checksums, evidence, capture, replay.

On the CPU these run under TRITON_INTERPRET=1 (conftest) at small shapes in fp16/fp32 (the
interpreter computes bf16 arithmetic wrongly; one bf16 test checks the upcast that works around it).
The same checks run with bf16 at real shapes on a GPU (tests marked `gpu`).
"""

from __future__ import annotations

import dataclasses
import math
import struct

import pytest
import torch

from aegis_sdc.kernels import triton_gemm as tg
from aegis_sdc.kernels.gemm_side import SideMatrix
from aegis_sdc.kernels.reference import U32, checked_gemm
from aegis_sdc.kernels.weight_sums import weight_side_matrices, weight_sides
from aegis_sdc.ops.triton_replay import TritonGemmCall, TritonGemmCapture
from aegis_sdc.sensors.thresholds import worst_case_bound

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 operands under the interpreter only: on a GPU, tl.dot rounds them to TF32, and the GPU path
# never gives the kernel fp32 operands (ops/triton_linear.unsupported: bf16/fp16 only).
CPU_DTYPES = [
    torch.float16,
    pytest.param(torch.float32, marks=pytest.mark.skipif(DEVICE == "cuda", reason="fp32 runs on cuBLAS on a GPU")),
]


def orientation(kind: str, m: int, k: int, n: int, dtype, seed=0):
    """Storage tensors and flags for one GEMM kind, plus the logical A [M, K] and B [K, N]."""
    g = torch.Generator().manual_seed(seed)
    if kind == "fwd":  # Y = X·Wᵀ: a = X [M, K], b = W [N, K]
        a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
        flags, logical = (False, True), (a, b.t())
    elif kind == "dgrad":  # dX = dY·W: a = dY [M, K], b = W [K, N]
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        flags, logical = (False, False), (a, b)
    else:  # dW = dYᵀ·X: a = dY [K, M] (stores Aᵀ), b = X [K, N]
        a, b = torch.randn(k, m, generator=g), torch.randn(k, n, generator=g)
        flags, logical = (True, False), (a.t(), b)
    a, b = a.to(dtype).to(DEVICE), b.to(dtype).to(DEVICE)
    return a, b, flags, (logical[0].to(dtype).to(DEVICE), logical[1].to(dtype).to(DEVICE))


def launch(
    a,
    b,
    flags,
    logical,
    dtype,
    *,
    fault=None,
    thresholds=(float("inf"), float("inf")),
    col=True,
    cfg=None,
    byproduct=None,
    scratch=False,
):
    A, B = logical
    m, n = A.shape[0], B.shape[1]
    cfg = cfg or tg.config_for(m, n, A.shape[1])
    vecs = dict(cvec=B.double().sum(1), u1=A.double().sum(0) if col else None)
    out = torch.empty(m, n, dtype=dtype, device=DEVICE)
    stats = torch.zeros(tg.STATS_LEN, dtype=torch.int64, device=DEVICE)
    counters = torch.zeros(tg.counters_needed(m, n, cfg), dtype=torch.int32, device=DEVICE)
    kind = tg.CAPTURE_TILE if col else tg.CAPTURE_ROWS
    pool = tg.CapturePool.allocate(2, *tg.CapturePool.layout(m, n, A.shape[1], kind, cfg), dtype, DEVICE)
    result = tg.launch_checked_gemm(
        a, b, out, a_t=flags[0], b_t=flags[1], **vecs, row_check=True, row_side=True, col_check=col,
        stats=stats, counters=counters, pool=pool, capture=kind, row_threshold=thresholds[0],
        col_threshold=thresholds[1], fault=fault, byproduct=byproduct, cfg=cfg, scratch=scratch,
    )  # fmt: skip
    call = TritonGemmCall(
        a_t=flags[0], b_t=flags[1], m=m, n=n, k=A.shape[1], dtype=dtype, cfg=cfg, capture_kind=kind,
        b=b if kind == tg.CAPTURE_ROWS else None, bias=None, cvec=vecs["cvec"], u1=vecs["u1"], pool=pool,
        fault=None,
    )  # fmt: skip
    return out, result, stats, counters, call


def decode(stats: torch.Tensor):
    raw = stats.tolist()
    value = lambda packed: struct.unpack("<f", struct.pack("<I", (packed >> 32) & 0xFFFFFFFF))[0]  # noqa: E731
    return {
        "row": value(raw[tg.ST_ROW]),
        "row_index": raw[tg.ST_ROW] & 0xFFFFFFFF,
        "col": value(raw[tg.ST_COL]),
        "col_index": raw[tg.ST_COL] & 0xFFFFFFFF,
        "nonfinite": raw[tg.ST_NONFINITE],
        "alarm": raw[tg.ST_ALARM],
        "slot": raw[tg.ST_SLOT],
        "done": raw[tg.ST_EVIDENCE_DONE],
    }


SHAPES_CPU = [(64, 48, 96), (72, 32, 40), (32, 80, 64)]  # (M, K, N): TMA needs 16-byte rows


@pytest.mark.parametrize("kind", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", SHAPES_CPU)
def test_values_and_checksums_match_the_reference_path(kind, dtype, shape):
    m, k, n = shape
    a, b, flags, logical = orientation(kind, m, k, n, dtype)
    out, result, stats, counters, _ = launch(a, b, flags, logical, dtype)
    ref = checked_gemm(logical[0].cpu(), logical[1].cpu(), out_dtype=dtype, col_check=True)
    A64, B64 = logical[0].double().cpu(), logical[1].double().cpu()
    magnitude = A64.abs() @ B64.abs()
    # Values: both accumulate in fp32 (each within γ_K·Σ|A||B| of exact) and round once to dtype.
    u_out = torch.finfo(dtype).eps / 2
    gamma = k * U32 / (1 - k * U32)
    bound = 2 * gamma * magnitude + 2 * u_out * ref.out.double().abs() + torch.finfo(dtype).tiny
    assert torch.all((out.double().cpu() - ref.out.double()).abs() <= bound)
    # Row checksums: the kernel sums each tile's row in fp32 (a tree of ≤ BN terms, error ≤ log2(BN)·u
    # relative to the magnitudes), the reference in fp64; both carry the same accumulation error γ_K.
    tree = 8 * U32
    row_sum = result.row_part.double().sum(0).cpu()
    row_bound = (2 * gamma + tree) * magnitude.sum(1) + 1e-30
    assert torch.all((row_sum - ref.row_sum).abs() <= row_bound)
    col_sum = result.col_part.double().sum(0).cpu()
    assert torch.all((col_sum - ref.col_sum).abs() <= (2 * gamma + tree) * magnitude.sum(0) + 1e-30)
    # Reference side A·(B·1) on the tensor cores: products of A with the three parts of c are exact
    # in fp32 and accumulate in fp32 (γ_K of the |A|·|c| magnitudes); the parts represent c to 3×
    # the operand precision (fp16: 2⁻³³ of max|c|·2ᵉ ≤ 2¹⁴, i.e. below 2⁻¹⁹·max|c|).
    c = B64.sum(1)
    part_err = (2.0**-33 if dtype == torch.float16 else 2.0**-60) * 2 * c.abs().max()
    ref_bound = 2 * gamma * (A64.abs() @ c.abs()) + (A64.abs().sum(1) * part_err) + 1e-30
    assert torch.all((result.rowref.cpu() - ref.row_ref).abs() <= ref_bound)
    # Scale: the accumulator rows' own norms (the reference path's s_i only in expectation).
    exact = A64 @ B64
    row_norm = result.rsq_part.double().sum(0).sqrt().cpu()
    assert torch.allclose(row_norm, exact.norm(dim=1), rtol=1e-4)
    # By-product for a later wgrad: A·1 (ones column: exact products, fp32 accumulation).
    assert torch.all((result.rowones.cpu() - A64.sum(1)).abs() <= gamma * A64.abs().sum(1) + 1e-30)
    # Column side u1ᵀB, the same way on Bᵀ's tiles.
    u1 = A64.sum(0)
    u_err = (2.0**-33 if dtype == torch.float16 else 2.0**-60) * 2 * u1.abs().max()
    col_bound = 2 * gamma * (u1.abs() @ B64.abs()) + B64.abs().sum(0) * u_err + 1e-30
    assert torch.all((result.colref.cpu() - ref.col_ref).abs() <= col_bound)
    assert torch.allclose(result.csq_part.double().sum(0).sqrt().cpu(), exact.norm(dim=0), rtol=1e-4)
    # Evidence: clean, small, finished by exactly one program; counters left zero for the next launch.
    ev = decode(stats)
    assert ev["done"] == 1 and ev["alarm"] == 0 and ev["nonfinite"] == 0 and ev["slot"] == 0
    assert 0 < ev["row"] < 100 and 0 <= ev["col"] < 100
    assert counters.abs().sum() == 0


def with_side(cfg: tg.TritonGemmConfig, side: int | str) -> tg.TritonGemmConfig:
    """`cfg` with its row side after the K loop in slices of `side` tiles (TritonGemmConfig.side_group),
    or, "loop", inside the K loop (side_in_loop) as a second MMA; "cuda_loop" both sides' slices
    inside the K loop on the CUDA cores (side_on_cuda_cores, col_side_on_cuda_cores; "cuda_loop_2":
    every other tile a slice twice as long; "cuda_row": the row side's only)."""
    if side == "loop":
        return dataclasses.replace(cfg, side_in_loop=True)
    if isinstance(side, str) and side.startswith("cuda_"):
        return dataclasses.replace(cfg, side_on_cuda_cores=True, col_side_on_cuda_cores=side != "cuda_row",
                                   side_group=2 if side == "cuda_loop_2" else 1)  # fmt: skip
    return dataclasses.replace(cfg, side_group=side)


@pytest.mark.parametrize("kind", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize(
    ("model", "side"),
    [(tg.FAULT_PERTURB, 1), (tg.FAULT_BITFLIP, 1), (tg.FAULT_BITFLIP, 2), (tg.FAULT_BITFLIP, "loop"),
     (tg.FAULT_BITFLIP, "cuda_loop"), (tg.FAULT_BITFLIP, "cuda_loop_2"), (tg.FAULT_BITFLIP, "cuda_row")],
)  # fmt: skip
# A flipped exponent bit can make the corrupted element overflow in the bf16 output cast: that inf is
# the corruption itself, and the interpreter warns about it in numpy.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_a_fault_is_detected_located_captured_and_replayed(kind, model, side):
    # side 2: every other tile computes a reference-side slice twice as long; "loop": every tile the
    # whole row side inside its K loop (TritonGemmConfig)
    m, k, n = 64, 48, 96
    dtype = torch.float16
    a, b, flags, logical = orientation(kind, m, k, n, dtype, seed=4)
    fault = (model, 41, 70, 3.0, 1 << 27)
    cfg = with_side(tg.config_for(m, n, k), side)
    _, _, stats, _, call = launch(a, b, flags, logical, dtype, fault=fault, thresholds=(40.0, 40.0), cfg=cfg)
    ev = decode(stats)
    assert ev["alarm"] == 3 and ev["slot"] == 1
    assert ev["row_index"] == 41 and ev["col_index"] == 70
    assert ev["row"] > 1000  # far above clean values of 1–50
    capture = TritonGemmCapture(call, 0, ev["row_index"], ev["col_index"])
    bm, bn = call.cfg.block_m, call.cfg.block_n
    assert (capture.region.row_start, capture.region.col_start) == ((41 // bm) * bm, (70 // bn) * bn)
    replay = capture.replay()  # the same kernel without the fault: differs exactly in the faulted tile
    diff = capture.diff(capture.saved, replay)
    assert len(diff.tiles) == 1 and diff.tiles[0].row_start <= 41 < diff.tiles[0].row_stop
    assert diff.tiles[0].col_start <= 70 < diff.tiles[0].col_stop
    again = capture.replay()
    assert capture.diff(replay, again).equal  # two clean replays agree bit for bit


@pytest.mark.parametrize("kind", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize(
    ("dtype", "side"),
    [(torch.float16, 1), (torch.float16, 3), (torch.float16, "loop"), (torch.float16, "cuda_loop"),
     (torch.float16, "cuda_loop_2"), (torch.float16, "cuda_row"),
     pytest.param(torch.float32, 1, marks=pytest.mark.skipif(DEVICE == "cuda", reason="fp32 runs on cuBLAS on a GPU"))],
)  # fmt: skip
def test_clean_captures_replay_bit_for_bit(kind, dtype, side):
    m, k, n = 72, 32, 64
    a, b, flags, logical = orientation(kind, m, k, n, dtype, seed=9)
    cfg = with_side(tg.config_for(m, n, k), side)
    _, _, stats, _, call = launch(a, b, flags, logical, dtype, thresholds=(0.0, 0.0), cfg=cfg)  # force a capture
    ev = decode(stats)
    assert ev["alarm"] != 0 and ev["slot"] == 1
    capture = TritonGemmCapture(call, 0, ev["row_index"], ev["col_index"])
    assert capture.diff(capture.saved, capture.replay()).equal
    assert capture.exact_violations() == 0
    capture.saved.row_part[0, 0] += 0.5  # a saved accumulator sum no correct execution gives
    assert capture.exact_violations() == 1


def output_checksums(out: torch.Tensor, bn: int) -> torch.Tensor:
    """The kernel's `out_part` of a 16-bit output [M, N] computed on the host: per row and column
    tile, the wrapping int32 sum of the elements' bit patterns taken two at a time (columns 2i and
    2i + 1, the first in the low half), the top byte XORed into the low 24 bits, as fp32 [tiles_n, M]."""
    bits = out.cpu().view(torch.int16).to(torch.int64) & 0xFFFF
    pairs = bits[:, 0::2] | (bits[:, 1::2] << 16)  # [M, N/2]
    sums = torch.stack([pairs[:, j // 2 : (j + bn) // 2].sum(1) for j in range(0, out.shape[1], bn)])
    total = sums & 0xFFFFFFFF  # int32 wrap-around
    return ((total & 0xFFFFFF) ^ ((total >> 24) & 0xFF)).to(torch.float32)


@pytest.mark.parametrize("kind", ["fwd", "wgrad"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_output_checksums_are_the_sums_of_the_rounded_outputs_bits(kind, dtype):
    # out_part per tile against the host's checksum of the output the launch stored: equal exactly
    # (integer sums), whatever order the kernel summed in.
    m, k, n = 64, 48, 96
    a, b, flags, logical = orientation(kind, m, k, n, dtype, seed=5)
    cfg = tg.config_for(m, n, k)
    out, res = launch(a, b, flags, logical, dtype, cfg=cfg)[:2]
    assert torch.equal(res.out_part.cpu(), output_checksums(out, cfg.block_n))


def test_one_changed_output_element_always_moves_its_rows_checksum():
    # Every single-bit flip of every element of a row of 32 bf16 values (all 16 bit positions, at
    # even and odd columns: low and high halves of a pair) moves the row's checksum, from rows whose
    # sums sit at the fold's edges (2²⁴ − 1, carries into the top byte) as well as ordinary ones.
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(32, generator=gen).to(torch.bfloat16).view(torch.int16) for _ in range(3)]
    rows += [torch.full((32,), -1, dtype=torch.int16), torch.full((32,), 0x7FFF, dtype=torch.int16)]
    for row in rows:
        base = output_checksums(row.view(torch.bfloat16)[None], 32)
        for col in range(32):
            for bit in range(16):
                flipped = row.clone()
                flipped[col] ^= torch.tensor(1 << bit, dtype=torch.int32).to(torch.int16)
                assert not torch.equal(output_checksums(flipped.view(torch.bfloat16)[None], 32), base), (col, bit)


def test_launches_are_deterministic_and_counters_reset():
    a, b, flags, logical = orientation("fwd", 64, 48, 96, torch.float16)
    first = launch(a, b, flags, logical, torch.float16)
    second = launch(a, b, flags, logical, torch.float16)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1].row_part, second[1].row_part)
    assert torch.equal(first[2], second[2])  # the evidence slot too


_FEW_TILES, _MANY_TILES = (64, 48, 96), (288, 32, 640)


# every kind and way on few tiles; on many (10 s each on the interpreter), the atomic totals both kinds,
# the stored parts the wgrad, whose launch finishes row and column blocks from them
@pytest.mark.parametrize(
    ("kind", "mkn", "totals", "side"),
    [(kind, _FEW_TILES, totals, 1) for kind in ("fwd", "wgrad") for totals in (True, False)]
    + [("fwd", _MANY_TILES, True, 1), ("wgrad", _MANY_TILES, True, 1), ("wgrad", _MANY_TILES, False, 1),
       ("wgrad", _MANY_TILES, False, 4), ("fwd", _FEW_TILES, True, "loop"), ("wgrad", _FEW_TILES, False, "loop")],
    ids=["few-fwd-totals", "few-fwd-parts", "few-wgrad-totals", "few-wgrad-parts", "many-fwd-totals",
         "many-wgrad-totals", "many-wgrad-parts", "many-wgrad-parts-side-group-4", "few-fwd-totals-side-in-loop",
         "few-wgrad-parts-side-in-loop"],
)  # fmt: skip
def test_inline_and_separate_evidence_agree(kind, mkn, totals, side):
    # The verdict, indices and capture are the same whether the programs that complete the blocks
    # judge them inside the launch or a second launch sums the tiles' parts. From fp64 totals the
    # tiles add atomically in arrival order (`totals`), the maxima agree to fp64 rounding of that
    # order: a row's difference |Σ − ref| (here ≥ 2.0, the fault) moves by ~1e-16 of Σ — far below
    # 1e-6 of it; from the tiles' stored parts (`parts`) the finish sums them in the second launch's
    # order, so the slot's maxima and verdict are the same bit for bit. Many tiles: 180 tiles of
    # 32×32 on the interpreter's 4 programs, 45 each, so a program counts its tiles in several
    # vectors and completes several blocks.
    a, b, flags, logical = orientation(kind, *mkn, torch.float16, seed=3)
    fault = (tg.FAULT_PERTURB, 17, 50, 2.0, 0)
    base = with_side(tg.default_config(), side)
    inline_cfg = dataclasses.replace(base, inline_evidence=True, inline_totals=totals)
    separate_cfg = dataclasses.replace(base, inline_evidence=False)
    runs = [launch(a, b, flags, logical, torch.float16, fault=fault, thresholds=(40.0, 40.0), cfg=cfg)
            for cfg in (inline_cfg, separate_cfg)]  # fmt: skip
    (out1, _, stats1, counters1, call1), (out2, _, stats2, counters2, call2) = runs
    assert torch.equal(out1, out2)
    ev1, ev2 = decode(stats1), decode(stats2)
    for key in ("row_index", "col_index", "nonfinite", "alarm", "slot", "done"):
        assert ev1[key] == ev2[key], key
    for key in ("row", "col"):
        assert ev1[key] == pytest.approx(ev2[key], rel=1e-6), key
    if not totals:  # all but the L2 statistics, which every block adds to by an atomic (any order)
        assert torch.equal(stats1[: tg.ST_ROW_L2SQ], stats2[: tg.ST_ROW_L2SQ])
    assert ev1["alarm"] == 3 and ev1["row_index"] == 17
    assert counters1.abs().sum() == 0 and counters2.abs().sum() == 0
    assert torch.equal(call1.pool.f32[0], call2.pool.f32[0]) and torch.equal(call1.pool.data[0], call2.pool.data[0])


@pytest.mark.parametrize("checked", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_byproduct_is_the_same_whoever_finishes_it(checked, dtype):
    # A·1 (and, for bf16 operands, its S) for a later wgrad check: the slices added to fp64 totals by
    # the tiles (inline: in arrival order) or summed in slice order by the second launch — equal to
    # fp64 rounding of that order (the sum of a few exact-in-fp64 fp32 chains: a few ulps of fp64) —
    # and within an fp32 chain's bound of the exact row sums (each slice is one fp32 chain of exact
    # products of A with the ones column).
    m, k, n = 64, 80, 96
    a, b, flags, logical = orientation("fwd", m, k, n, dtype, seed=7)
    A64 = logical[0].double().cpu()
    got = []
    for inline, totals in ((True, True), (False, True), (True, False)):
        cfg = dataclasses.replace(tg.default_config(), inline_evidence=inline, inline_totals=totals)
        out = torch.empty(m, n, dtype=dtype, device=DEVICE)
        vec = torch.full((m,), float("nan"), dtype=torch.float64, device=DEVICE)
        side = torch.zeros(m, 16, dtype=dtype, device=DEVICE) if dtype == torch.bfloat16 else None
        counters = torch.zeros(tg.counters_needed(m, n, cfg), dtype=torch.int32, device=DEVICE)
        stats = torch.zeros(tg.STATS_LEN, dtype=torch.int64, device=DEVICE) if checked else None
        tg.launch_checked_gemm(
            a, b, out, a_t=flags[0], b_t=flags[1], cvec=logical[1].double().sum(1), row_check=checked, row_side=True,
            stats=stats, counters=counters, byproduct=vec, byproduct_side=side, cfg=cfg,
        )  # fmt: skip
        assert counters.abs().sum() == 0  # left zero for the next launch
        got.append((vec.cpu(), None if side is None else side.cpu()))
    (vec1, side1), (vec2, side2), (vec3, side3) = got
    # inside the launch from the stored slices: the second launch's sums, bit for bit
    assert torch.equal(vec3, vec2) and (side3 is None or torch.equal(side3, side2))
    ulps = 8 * torch.finfo(torch.float64).eps * vec2.abs()
    assert torch.all((vec1 - vec2).abs() <= ulps)
    if side1 is not None:  # S's parts are the bf16 roundings of the fp64 value: equal unless a rounding
        # boundary lies within those ulps (hi: never at these magnitudes; lo2 carries ~2⁻²⁴ of it)
        assert torch.equal(side1[:, :2], side2[:, :2])
        assert torch.allclose(side1.double()[:, 2], side2.double()[:, 2], rtol=0, atol=1e-12 * float(vec2.abs().max()))
    if dtype == torch.float16 or torch.cuda.is_available():  # bf16 arithmetic is wrong under the interpreter
        exact = A64.sum(1)
        assert torch.all((vec1 - exact).abs() <= k * U32 * A64.abs().sum(1) + 1e-30)


def test_inline_evidence_leaves_its_totals_zero():
    # The tiles' fp64 totals live in a workspace every launch shares; the program whose count
    # completes a block puts back to zero what the launch added to it, and every counter goes back to
    # zero (here a faulted wgrad with row and column checks and a by-product, a row-only launch after
    # it), so the next launch starts clean and judges only its own sums.
    a, b, flags, logical = orientation("wgrad", 64, 48, 96, torch.float16, seed=5)
    A, B = logical
    cfg = dataclasses.replace(tg.default_config(), inline_evidence=True)
    out = torch.empty(64, 96, dtype=torch.float16, device=DEVICE)
    vecs = dict(cvec=B.double().sum(1), u1=A.double().sum(0))
    for fault, col in (((tg.FAULT_PERTURB, 3, 4, 50.0, 0), True), (None, False)):
        stats = torch.zeros(tg.STATS_LEN, dtype=torch.int64, device=DEVICE)
        counters = torch.zeros(tg.counters_needed(64, 96, cfg), dtype=torch.int32, device=DEVICE)
        vec = torch.empty(64, dtype=torch.float64, device=DEVICE)
        tg.launch_checked_gemm(a, b, out, a_t=flags[0], b_t=flags[1], **vecs, row_check=True, row_side=True,
                               col_check=col, stats=stats, counters=counters, row_threshold=40.0, col_threshold=40.0,
                               fault=fault, byproduct=vec, cfg=cfg, scratch=True)  # fmt: skip
        totals = tg._WORKSPACES[(out.device, "totals", torch.float64)]
        assert torch.count_nonzero(totals) == 0 and counters.abs().sum() == 0
        assert decode(stats)["alarm"] == (3 if fault else 0), decode(stats)


def test_nonfinite_operands_raise_the_nonfinite_flag():
    a, b, flags, logical = orientation("fwd", 64, 48, 96, torch.float32)
    a[5, 3] = float("nan")
    _, _, stats, _, _ = launch(a, b, flags, (a, logical[1]), torch.float32, thresholds=(40.0, 40.0))
    ev = decode(stats)
    assert ev["nonfinite"] == 1 and ev["alarm"] & 1 and ev["row_index"] == 5


@pytest.mark.parametrize("kind", ["fwd", "wgrad"])
def test_the_reference_side_is_spread_over_the_tiles_by_k_slices(kind):
    # Tile j of a row block computes K slice j of tiles_n of A·c (tile i of a column block slice i of
    # u1ᵀB): as many slices as tiles, each within an fp32 chain's bound of its exact slice sum, and
    # the same whatever the tiling (two column-tile widths give 3 and 2 slices of 5 K tiles).
    # With side_group g every g-th tile computes one of ⌈tiles/g⌉ longer slices (3 column tiles, g = 2:
    # 2 slices; 2 row tiles: 1). With the row side in the K loop, one slice of all of K.
    m, k, n = 64, 80, 96  # 5 K tiles of 16
    a, b, flags, logical = orientation(kind, m, k, n, torch.float16, seed=5)
    A64, B64 = logical[0].double().cpu(), logical[1].double().cpu()
    c, u1 = B64.sum(1), A64.sum(0)
    for block_n, side in ((32, 1), (64, 1), (32, 2), (32, "loop"), (32, "cuda_loop"), (32, "cuda_loop_2"),
                          (32, "cuda_row")):  # fmt: skip
        cfg = with_side(dataclasses.replace(tg.default_config(), block_n=block_n), side)
        _, res, stats, *_ = launch(a, b, flags, logical, torch.float16, cfg=cfg)
        tiles_m, tiles_n = -(-m // cfg.block_m), -(-n // block_n)
        group = 2 if side == "cuda_loop_2" else 1 if side in ("cuda_loop", "cuda_row") else side
        parts = 1 if side == "loop" else -(-tiles_n // group)
        col_parts = -(-tiles_m // cfg.side_group)  # (the column side's slices follow side_group too)
        assert res.rowref_parts.shape == (parts, m) and res.colref_parts.shape == (col_parts, n)
        k_tiles = -(-k // cfg.block_k)
        for j in range(parts):  # slice j: K tiles [j·k_tiles/parts, (j+1)·k_tiles/parts)
            ks = slice(j * k_tiles // parts * cfg.block_k, (j + 1) * k_tiles // parts * cfg.block_k)
            exact = A64[:, ks] @ c[ks]
            # an fp32 chain of at most k products, each exact (three dtype parts of c; fp32 products)
            bound = 3 * k * U32 * (A64[:, ks].abs() @ c[ks].abs()) + 1e-30
            assert torch.all((res.rowref_parts[j].cpu() - exact).abs() <= bound)
        exact = u1 @ B64
        bound = 3 * k * U32 * (u1.abs() @ B64.abs()) + 1e-30
        assert torch.all((res.colref.cpu() - exact).abs() <= bound)
        assert decode(stats)["alarm"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only regression check")
def test_bf16_operands_are_upcast_under_the_interpreter():
    # Triton's interpreter multiplies bf16 bit patterns; the kernel upcasts after loading there.
    a, b, flags, logical = orientation("fwd", 32, 32, 32, torch.bfloat16)
    out, *_ = launch(a, b, flags, logical, torch.bfloat16)
    exact = logical[0].double() @ logical[1].double()
    assert torch.allclose(out.double(), exact, rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize(
    "dtype",
    [*CPU_DTYPES, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)],  # bf16 arithmetic is wrong interpreted
)
def test_the_side_matrix_splits_its_vector_into_three_exact_parts(dtype):
    g = torch.Generator().manual_seed(3)
    for n, magnitude in ((1, 1.0), (1500, 3e4), (2049, 1e-3), (7, 0.0)):
        vec = (torch.randn(n, generator=g, dtype=torch.float64) * magnitude).to(DEVICE)
        side = SideMatrix.of(vec, dtype)
        s = side.matrix.double().cpu()
        scale = float(side.scale)
        assert torch.equal(s[:, 3], torch.ones(n, dtype=torch.float64)) and not s[:, 4:].any()
        # hi + lo + lo2 carries three times the dtype's precision p (bf16 8, fp16 11, fp32 24 bits):
        # each part is the previous remainder rounded, so what is left is at most 2^-3p of |v·2ᵉ| (fp32
        # stops at fp64's 53 bits), or half the dtype's subnormal spacing where a part underflows.
        bits = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[dtype]
        finfo = torch.finfo(dtype)
        left = (s[:, :3].sum(dim=1) - vec.cpu() * scale).abs()
        bound = vec.cpu().abs() * scale * 2.0 ** -min(3 * bits, 52) + finfo.smallest_normal * finfo.eps / 2
        assert bool((left <= bound).all())
        if dtype == torch.float16 and magnitude:
            # 2ᵉ brings max|v| into [2¹³, 2¹⁴]: fp16 holds it (max 65504) with room for the parts' sums
            top = float(vec.abs().max()) * scale
            assert 2.0**13 <= top <= 2.0**14 and math.log2(scale).is_integer()
        else:
            assert scale == 1.0 or magnitude == 0.0


@pytest.mark.parametrize(
    "dtype",
    [*CPU_DTYPES, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)],  # bf16 arithmetic is wrong interpreted
)
def test_a_weights_sums_and_side_matrices_come_from_two_deterministic_launches(dtype):
    # (Wᵀ·1, W·1) against fp64 torch sums, every shape's programs and chunks exercised (ragged N and K),
    # twice bit for bit (a replay recomputes them); bf16 S matrices written by the same launches.
    g = torch.Generator().manual_seed(5)
    for n, k in ((37, 70), (300, 33), (5, 1)):
        w = (torch.randn(n, k, generator=g) * 3).to(dtype).to(DEVICE)
        col_sum, row_sum, s_col, s_row = weight_sides(w)
        w64 = w.double()
        # fp64 sums of at most max(n, k) terms in another order: apart by n·u64 of the absolute sums
        assert torch.allclose(col_sum, w64.sum(0), rtol=0, atol=n * 2**-52 * float(w64.abs().sum(0).max()))
        assert torch.allclose(row_sum, w64.sum(1), rtol=0, atol=k * 2**-52 * float(w64.abs().sum(1).max()))
        again = weight_sides(w)
        assert torch.equal(again[0], col_sum) and torch.equal(again[1], row_sum)
        if dtype != torch.bfloat16:
            assert s_col is None and s_row is None  # fp16 needs a scale: SideMatrix.of
            continue
        for vec, s in ((col_sum, s_col), (row_sum, s_row)):
            s = s.double()
            assert torch.equal(s[:, 3], torch.ones_like(vec)) and not s[:, 4:].any()
            # three bf16 parts, each rounded from fp32: what is left is under 2^-24 of |v| (fp32's
            # rounding of the last remainder) plus bf16's smallest subnormal
            left = (s[:, :3].sum(dim=1) - vec).abs()
            assert bool((left <= vec.abs() * 2.0**-23 + 2.0**-133).all())
        fwd, dgrad = weight_side_matrices(w)
        assert torch.equal(fwd.matrix, s_col) and torch.equal(dgrad.vec, row_sum)


def test_a_group_of_weights_gets_the_sums_each_would_get_alone():
    # One pair of launches for the weights of one shape (a step's active Linears): each weight's sums
    # and S are bit for bit those of its own launches (same blocks, same part order), in its slot.
    from aegis_sdc.kernels.weight_sums import GroupSums

    g = torch.Generator().manual_seed(11)
    weights = [(torch.randn(40, 70, generator=g) * 3).to(torch.bfloat16).to(DEVICE) for _ in range(3)]
    group = GroupSums.empty(4, 40, 70, torch.device(DEVICE))
    group.s_row.zero_()
    slots = {0: 3, 2: 1}  # weights 0 and 2 are active; slots 0 and 2 stay untouched
    table = torch.tensor([[weights[i].data_ptr(), slot] for i, slot in slots.items()], dtype=torch.int64)
    group.compute(weights[0], table.to(DEVICE))
    for i, slot in slots.items():
        col_sum, row_sum, s_col, s_row = weight_sides(weights[i])
        mine = group.buffers(slot)
        assert torch.equal(mine.col_sum, col_sum) and torch.equal(mine.row_sum, row_sum)
        assert torch.equal(mine.s_col, s_col) and torch.equal(mine.s_row, s_row)
    assert not group.s_row[0].any() and not group.s_row[2].any()


def test_launches_take_the_direct_path_unless_a_launch_hook_is_installed():
    # Triton keeps its launch hooks in chains that are never None (3.5+): an empty chain is no hook,
    # and treating it as one sent every launch through Triton's per-call binding (~40 µs more).
    import triton

    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if knobs is None:
        pytest.skip("this Triton has no launch-hook knobs")
    assert not tg._hooked()
    hook = lambda metadata: None  # noqa: E731
    chain = knobs.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            assert tg._hooked()
        finally:
            chain.remove(hook)
    assert not tg._hooked() and not tg._installed(None) and tg._installed(hook)


@pytest.mark.gpu
def test_a_known_variant_is_launched_through_its_compiled_handle(monkeypatch):
    # Triton's own launch binds and specializes every argument in Python per call; once a variant is
    # compiled the launch goes to its handle, with the same results.
    a, b, flags, logical = orientation("fwd", 256, 128, 256, torch.bfloat16, seed=2)
    first = launch(a, b, flags, logical, torch.bfloat16)
    through_triton = []
    real = tg.checked_gemm_kernel.run
    monkeypatch.setattr(tg.checked_gemm_kernel, "run", lambda *a, **kw: through_triton.append(1) or real(*a, **kw))
    second = launch(a, b, flags, logical, torch.bfloat16)
    assert not through_triton and tg._direct_launch
    assert torch.equal(first[0], second[0]) and torch.equal(first[2], second[2])


def test_integer_arguments_that_need_64_bits_are_a_variant_of_their_own():
    # The direct launch path (GPU) reuses a compiled variant by constexprs, dtypes and this flag:
    # Triton compiles an integer argument as i64 once it leaves the i32 range.
    assert not tg._wide(5, 7, 2**31 - 1, -(2**31))
    assert tg._wide(5, 2**31) and tg._wide(-(2**31) - 1, 3)


def test_tma_compatibility_is_checked_on_the_host():
    assert tg.tma_compatible(torch.empty(16, 8, dtype=torch.float16))
    assert not tg.tma_compatible(torch.empty(16, 7, dtype=torch.float16))  # 14-byte rows
    assert not tg.tma_compatible(torch.empty(8, 16, dtype=torch.float16).t())  # last stride ≠ 1


# -- real shapes on a GPU --------------------------------------------------------------------------
GPU_SHAPES = [(4096, 4096, 4096), (2048, 14336, 4096), (4096, 4096, 6144)]
# (tokens, in-features, out-features) of real Linears, covering every shape class of the table:
# GQA key/value projections (N = 256, 128, 512), square, a row-parallel shard, an lm_head.
SHAPE_TABLE = [(2048, 2048, 256), (2048, 8192, 128), (8192, 3584, 512), (4096, 4096, 4096), (2048, 1024, 8192),
               (2048, 2048, 32000)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("side", [1, 4, "loop", "cuda_loop"])
@pytest.mark.parametrize("kind", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize("shape", SHAPE_TABLE, ids=lambda s: "x".join(map(str, s)))
def test_gpu_replay_is_bit_exact_across_the_shape_table(kind, shape, side):
    # A fault in the last tile (neither row block 0 nor column block 0, where they exist: that tile ran
    # the plain K loop, its replay the loop with both reference sides) is detected at its row (and, with
    # a column check, its column); the replay differs from the capture in the faulted row and column
    # only: every other accumulator sum and both reference sides are bit for bit the original's. With
    # side 4, every fourth tile of a block computes the side's slices; "loop", every tile the row side
    # in its K loop ("cuda_loop": both sides' slices in it on the CUDA cores; TritonGemmConfig). The
    # output's checksums are the host's of the stored output (the pairs as the rounding packs them).
    m, k, n = shape
    dtype = torch.bfloat16
    a, b, flags, logical = orientation(kind, m, k, n, dtype, seed=11)
    rows, cols = logical[0].shape[0], logical[1].shape[1]
    col = kind != "dgrad"  # wgrad's default column check, and the forward's optional one
    cfg = with_side(tg.config_for(rows, cols, logical[0].shape[1]), side)
    out, res, stats, _, _ = launch(a, b, flags, logical, dtype, thresholds=(1e9, 1e9), col=col, cfg=cfg)
    clean = decode(stats)
    assert clean["alarm"] == 0 and clean["nonfinite"] == 0, clean
    assert torch.equal(res.out_part.cpu(), output_checksums(out, cfg.block_n))
    fault_row, fault_col = rows - 1, cols - 1
    fault = (tg.FAULT_BITFLIP, fault_row, fault_col, 0.0, 1 << 26)
    thresholds = (4 * clean["row"], 4 * clean["col"] if col else 1e9)
    _, _, stats, counters, call = launch(a, b, flags, logical, dtype, fault=fault, thresholds=thresholds, col=col,
                                         cfg=cfg)  # fmt: skip
    ev = decode(stats)
    assert ev["alarm"] & 1 and ev["row_index"] == fault_row and ev["slot"] == 1, ev
    if col:
        assert ev["alarm"] & 2 and ev["col_index"] == fault_col, ev
    assert counters.abs().sum() == 0
    capture = TritonGemmCapture(call, 0, ev["row_index"], ev["col_index"])
    saved, replay = capture.saved, capture.replay()
    local_row = fault_row - capture.region.row_start
    keep = torch.ones(saved.row_part.shape[1], dtype=torch.bool)
    keep[local_row] = False
    assert torch.equal(saved.row_part[:, keep], replay.row_part[:, keep])
    assert torch.equal(saved.out_part[:, keep], replay.out_part[:, keep])
    assert not torch.equal(saved.row_part[:, local_row], replay.row_part[:, local_row])
    assert torch.equal(saved.ref_part, replay.ref_part) and torch.equal(saved.colref_part, replay.colref_part)
    if col:
        local_col = fault_col - capture.region.col_start
        keep_c = torch.ones(saved.col_part.shape[1], dtype=torch.bool)
        keep_c[local_col] = False
        assert torch.equal(saved.col_part[:, keep_c], replay.col_part[:, keep_c])
    assert capture.diff(replay, capture.replay()).equal  # two clean replays agree bit for bit


@pytest.mark.gpu
@pytest.mark.parametrize("totals", [True, False], ids=["totals", "parts"])
def test_gpu_evidence_inside_the_launch_agrees_with_a_second_launch_back_to_back(totals):
    # The training step's way of launching: checked GEMMs of every shape class and kind (forwards
    # with their by-product, dgrads, wgrads with the column check) queued back to back on one stream
    # with the shared workspaces (`scratch`), nothing synchronized between them — then each launch's
    # evidence against the same GEMM's evidence from a second launch (fresh buffers, fixed-order sums).
    # The maxima may differ by fp64 rounding of the sums' order (1e-6 of them is far above it), the
    # indices and verdicts not at all; the by-products to a few fp64 ulps.
    dtype = torch.bfloat16
    inline_runs, separate_runs = [], []
    for rep in range(3):
        for shape in SHAPE_TABLE:
            for kind in ("fwd", "dgrad", "wgrad"):
                a, b, flags, logical = orientation(kind, *shape, dtype, seed=rep)
                rows, inner, cols = logical[0].shape[0], logical[0].shape[1], logical[1].shape[1]
                base = tg.config_for(rows, cols, inner)
                for inline, runs in ((True, inline_runs), (False, separate_runs)):
                    vec = torch.empty(rows, dtype=torch.float64, device=DEVICE) if kind == "fwd" else None
                    cfg = dataclasses.replace(base, inline_evidence=inline, inline_totals=totals)
                    _, _, stats, _, _ = launch(a, b, flags, logical, dtype, thresholds=(1e30, 1e30),
                                               col=kind == "wgrad", byproduct=vec, scratch=inline, cfg=cfg)  # fmt: skip
                    runs.append((shape, kind, stats, vec))
    torch.cuda.synchronize()
    for (shape, kind, stats1, vec1), (_, _, stats2, vec2) in zip(inline_runs, separate_runs, strict=True):
        ev1, ev2 = decode(stats1), decode(stats2)
        label = f"{kind} {shape}"
        for key in ("row_index", "col_index", "nonfinite", "alarm", "done"):
            assert ev1[key] == ev2[key], (label, key, ev1, ev2)
        for key in ("row", "col"):
            assert ev1[key] == pytest.approx(ev2[key], rel=1e-6), (label, key, ev1, ev2)
        if vec1 is not None:
            assert torch.all((vec1 - vec2).abs() <= 8 * torch.finfo(torch.float64).eps * vec2.abs()), label


@pytest.mark.gpu
@pytest.mark.parametrize("totals", [True, False], ids=["totals", "parts"])
def test_gpu_evidence_inside_the_launch_holds_at_a_training_steps_scale(totals):
    # The 1.1B model's row-checked launches at 8192 tokens — forwards with their by-product, dgrads —
    # 12 of each shape back to back on the shared workspaces, against the second launch's evidence.
    # Small grids (the shape table above) never showed it, but at this size a last program that read
    # its totals with plain loads saw ~30% of the forwards disagree (gemm_evidence.take_totals). The
    # last token of each sequence has no label, so its dY row is zero: a row whose sum of squares is
    # 0, where any total not fully arrived or left behind reads as a normalized difference of ~1e28.
    dtype, tokens, seq = torch.bfloat16, 8192, 2048
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    inline_runs, separate_runs = [], []
    for rep in range(12):
        for kind, k, n in (("fwd", 2048, 2048), ("fwd", 2048, 5632), ("dgrad", 5632, 2048)):
            a = torch.randn(tokens, k, device=DEVICE, generator=gen).to(dtype)
            a[seq - 1 :: seq] = 0
            b = torch.randn((n, k) if kind == "fwd" else (k, n), device=DEVICE, generator=gen).to(dtype)
            flags, logical = ((False, True), (a, b.t())) if kind == "fwd" else ((False, False), (a, b))
            base = tg.config_for(tokens, n, k)
            for inline, runs in ((True, inline_runs), (False, separate_runs)):
                vec = torch.empty(tokens, dtype=torch.float64, device=DEVICE) if kind == "fwd" else None
                cfg = dataclasses.replace(base, inline_evidence=inline, inline_totals=totals)
                _, _, stats, _, _ = launch(a, b, flags, logical, dtype, thresholds=(1e30, 1e30), col=False,
                                           byproduct=vec, scratch=inline, cfg=cfg)  # fmt: skip
                runs.append((f"{kind} {k}->{n} #{rep}", stats, vec))
    torch.cuda.synchronize()
    for (label, stats1, vec1), (_, stats2, vec2) in zip(inline_runs, separate_runs, strict=True):
        ev1, ev2 = decode(stats1), decode(stats2)
        for key in ("row_index", "nonfinite", "alarm", "done"):
            assert ev1[key] == ev2[key], (label, key, ev1, ev2)
        # the same fp64 sums in another order: equal to far better than 1e-6 of a clean value
        assert ev1["row"] == pytest.approx(ev2["row"], rel=1e-6), (label, ev1, ev2)
        if vec1 is not None:
            assert torch.all((vec1 - vec2).abs() <= 8 * torch.finfo(torch.float64).eps * vec2.abs()), label


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_bf16_values_checksums_and_faults(kind, shape):
    m, k, n = shape
    dtype = torch.bfloat16
    a, b, flags, logical = orientation(kind, m, k, n, dtype)
    col = kind == "wgrad"  # the production configuration: only wgrad takes its column side in-kernel
    out, result, stats, counters, call = launch(a, b, flags, logical, dtype, thresholds=(1e9, 1e9), col=col)
    A, B = logical
    exact = A.double() @ B.double()
    magnitude = A.double().abs() @ B.double().abs()
    gamma = 2 * k * U32  # tensor-core accumulation: allow truncation (2u per addition)
    excess = ((out.double() - exact).abs() - (gamma * magnitude + 2**-8 * exact.abs())).max().item()
    assert excess <= 0, f"output off by {excess:.3g} beyond the fp32-accumulation + bf16-rounding bound"
    diff = (result.row_part.double().sum(0) - exact.sum(1)).abs()
    excess = (diff - (gamma + 16 * U32) * magnitude.sum(1)).max().item()
    assert excess <= 0, f"row checksum off by {excess:.3g} beyond its bound"
    ev = decode(stats)
    assert ev["alarm"] == 0 and counters.abs().sum() == 0, ev
    # Hopper's tensor cores accumulate with less care than IEEE fp32 (about 20× the noise of an fp32
    # FMA loop on random data, benchmarks/noise_gpu.py): clean values are larger than on the CPU, yet
    # orders of magnitude under the exact worst-case bound.
    assert 0 < ev["row"] < worst_case_bound(k, n) / 1000, f"clean normalized row difference {ev['row']}"
    fault = (tg.FAULT_BITFLIP, m // 3, n // 2, 0.0, 1 << 25)
    _, _, stats, _, call = launch(a, b, flags, logical, dtype, fault=fault, thresholds=(4 * ev["row"], 1e9), col=col)
    ev2 = decode(stats)
    assert ev2["alarm"] & 1 and ev2["row_index"] == m // 3 and ev2["slot"] == 1, ev2
    capture = TritonGemmCapture(call, 0, ev2["row_index"], ev2["col_index"])
    d = capture.diff(capture.saved, capture.replay())
    assert len(d.tiles) == 1 and d.tiles[0].row_start <= m // 3 < d.tiles[0].row_stop, d
    assert d.tiles[0].col_start <= n // 2 < d.tiles[0].col_stop, d


@pytest.mark.parametrize("kind", ["fwd", "dgrad"])
def test_forward_and_dgrad_column_checks_take_u1_into_the_kernel(kind):
    m, k, n = 64, 48, 96
    dtype = torch.float16
    a, b, flags, logical = orientation(kind, m, k, n, dtype, seed=2)
    cfg = tg.default_config()
    A, B = logical
    out = torch.empty(m, n, dtype=dtype, device=DEVICE)
    ref = checked_gemm(A.cpu(), B.cpu(), out_dtype=dtype, col_check=True)
    for fault, expect_alarm in ((None, 0), ((tg.FAULT_PERTURB, 9, 77, 4.0, 0), 2)):
        stats = torch.zeros(tg.STATS_LEN, dtype=torch.int64, device=DEVICE)
        counters = torch.zeros(tg.counters_needed(m, n, cfg), dtype=torch.int32, device=DEVICE)
        tg.launch_checked_gemm(
            a, b, out, a_t=flags[0], b_t=flags[1], cvec=B.double().sum(1), u1=A.double().sum(0),
            row_check=True, row_side=True, col_check=True, stats=stats, counters=counters,
            row_threshold=1e9, col_threshold=60.0, fault=fault, cfg=cfg,
        )  # fmt: skip
        ev = decode(stats)
        assert ev["alarm"] == expect_alarm
        if fault is None:
            # same column statistic as the reference path, to the noise of the fp32 tile sums
            ref_col = float(((ref.col_sum - ref.col_ref).abs() / (U32 * ref.col_scale)).max())
            assert 0 < ev["col"] < 60 and abs(ev["col"] - ref_col) < 40
        else:
            assert ev["col_index"] == 77 and ev["col"] > 1000
