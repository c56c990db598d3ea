"""The fused Triton GEMM against the reference path: values, checksums, evidence, capture, replay.

On the CPU these run under TRITON_INTERPRET=1 (conftest) at small shapes in fp16/fp32 (the
interpreter computes bf16 arithmetic wrongly; one bf16 test checks the upcast that works around it).
The same checks run with bf16 at real shapes on a GPU (tests marked `gpu`).
"""

from __future__ import annotations

import struct

import pytest
import torch

from aegis_sdc.kernels import triton_gemm as tg
from aegis_sdc.kernels.reference import U32, checked_gemm
from aegis_sdc.ops.triton_replay import TritonGemmCall, TritonGemmCapture
from aegis_sdc.sensors.thresholds import worst_case_bound

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float16, torch.float32]


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


def launch(a, b, flags, logical, dtype, *, fault=None, thresholds=(float("inf"), float("inf")), col=True, cfg=None):
    cfg = cfg or tg.default_config()
    A, B = logical
    m, n = A.shape[0], B.shape[1]
    A32, B32 = A.float(), B.float()
    vecs = dict(
        cvec=B.double().sum(1),
        beta=(B32 * B32).sum(1),
        u1=A.double().sum(0) if col else None,
        u2=(A32 * A32).sum(0) if col else None,
    )
    out = torch.empty(m, n, dtype=dtype, device=DEVICE)
    stats = torch.zeros(tg.STATS_LEN, dtype=torch.int64, device=DEVICE)
    counters = torch.zeros(-(-m // cfg.block_m) + -(-n // cfg.block_n) + 1, dtype=torch.int32, device=DEVICE)
    kind = tg.CAPTURE_TILE if col else tg.CAPTURE_ROWS
    pool = tg.CapturePool.allocate(2, *tg.CapturePool.layout(m, n, A.shape[1], kind, cfg), dtype, DEVICE)
    result = tg.launch_checked_gemm(
        a, b, out, a_t=flags[0], b_t=flags[1], **vecs, row_check=True, row_side=True, col_check=col,
        stats=stats, counters=counters, pool=pool, capture=kind, row_threshold=thresholds[0],
        col_threshold=thresholds[1], fault=fault, cfg=cfg,
    )  # fmt: skip
    call = TritonGemmCall(
        a_t=flags[0], b_t=flags[1], m=m, n=n, k=A.shape[1], dtype=dtype, cfg=cfg, capture_kind=kind,
        b=b if kind == tg.CAPTURE_ROWS else None, bias=None, cvec=vecs["cvec"], beta=vecs["beta"],
        u1=vecs["u1"], u2=vecs["u2"], pool=pool, fault=None,
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
    # Reference side A·(B·1) (fp32 products of fp32 vectors: γ_K of the |A|·|B·1| magnitudes) and scales.
    rowvec = result.rowvec.double().sum(1).cpu()  # the tiles' K sub-range partials, summed
    ref_bound = 2 * gamma * (A64.abs() @ B64.sum(1).abs()) + 2 * U32 * ref.row_ref.abs() + 1e-30
    assert torch.all((rowvec[0] - ref.row_ref).abs() <= ref_bound)
    assert torch.allclose(rowvec[1].sqrt(), ref.row_scale, rtol=1e-5)
    # By-products for a later wgrad: A·1 and ‖A_i‖²; column side u1ᵀB and u2ᵀB².
    s1, s2 = result.byproducts()
    assert torch.allclose(s1.double().cpu(), A64.sum(1), rtol=1e-5, atol=1e-4)
    assert torch.allclose(s2.double().cpu(), (A64 * A64).sum(1), rtol=1e-5)
    assert torch.allclose(result.colvec[0].double().sum(0).cpu(), ref.col_ref, rtol=1e-5, atol=1e-3)
    # Evidence: clean, small, finished by exactly one program; counters left zero for the next launch.
    ev = decode(stats)
    assert ev["done"] == 1 and ev["alarm"] == 0 and ev["nonfinite"] == 0 and ev["slot"] == 0
    assert 0 < ev["row"] < 100 and 0 <= ev["col"] < 100
    assert counters.abs().sum() == 0


@pytest.mark.parametrize("kind", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize("model", [tg.FAULT_PERTURB, tg.FAULT_BITFLIP])
# A flipped exponent bit can make the corrupted element overflow in the bf16 output cast: that inf is
# the corruption itself, and the interpreter warns about it in numpy.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_a_fault_is_detected_located_captured_and_replayed(kind, model):
    m, k, n = 64, 48, 96
    dtype = torch.float16
    a, b, flags, logical = orientation(kind, m, k, n, dtype, seed=4)
    fault = (model, 41, 70, 3.0, 1 << 27)
    _, _, stats, _, call = launch(a, b, flags, logical, dtype, fault=fault, thresholds=(40.0, 40.0))
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
def test_clean_captures_replay_bit_for_bit(kind):
    m, k, n = 72, 32, 64
    a, b, flags, logical = orientation(kind, m, k, n, torch.float32, seed=9)
    _, _, stats, _, call = launch(a, b, flags, logical, torch.float32, thresholds=(0.0, 0.0))  # force a capture
    ev = decode(stats)
    assert ev["alarm"] != 0 and ev["slot"] == 1
    capture = TritonGemmCapture(call, 0, ev["row_index"], ev["col_index"])
    assert capture.diff(capture.saved, capture.replay()).equal
    assert capture.exact_violations() == 0
    capture.saved.row_part[0, 0] += 0.5  # a saved accumulator sum no correct execution gives
    assert capture.exact_violations() == 1


def test_launches_are_deterministic_and_counters_reset():
    a, b, flags, logical = orientation("fwd", 64, 48, 96, torch.float16)
    first = launch(a, b, flags, logical, torch.float16)
    second = launch(a, b, flags, logical, torch.float16)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1].row_part, second[1].row_part)
    assert torch.equal(first[2], second[2])  # the evidence slot too


def test_nonfinite_operands_raise_the_nonfinite_flag():
    a, b, flags, logical = orientation("fwd", 64, 48, 96, torch.float32)
    a[5, 3] = float("nan")
    _, _, stats, _, _ = launch(a, b, flags, (a, logical[1]), torch.float32, thresholds=(40.0, 40.0))
    ev = decode(stats)
    assert ev["nonfinite"] == 1 and ev["alarm"] & 1 and ev["row_index"] == 5


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only regression check")
def test_bf16_operands_are_upcast_under_the_interpreter():
    # Triton's interpreter multiplies bf16 bit patterns; the kernel upcasts after loading there.
    a, b, flags, logical = orientation("fwd", 32, 32, 32, torch.bfloat16)
    out, *_ = launch(a, b, flags, logical, torch.bfloat16)
    exact = logical[0].double() @ logical[1].double()
    assert torch.allclose(out.double(), exact, rtol=2**-7, atol=1e-2)


def test_tma_compatibility_is_checked_on_the_host():
    assert tg.tma_compatible(torch.empty(16, 8, dtype=torch.float16))
    assert not tg.tma_compatible(torch.empty(16, 7, dtype=torch.float16))  # 14-byte rows
    assert not tg.tma_compatible(torch.empty(8, 16, dtype=torch.float16).t())  # last stride ≠ 1


# -- real shapes on a GPU --------------------------------------------------------------------------
GPU_SHAPES = [(4096, 4096, 4096), (2048, 14336, 4096), (4096, 4096, 6144)]


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
def test_forward_and_dgrad_column_checks_run_after_the_kernel(kind):
    m, k, n = 64, 48, 96
    dtype = torch.float16
    a, b, flags, logical = orientation(kind, m, k, n, dtype, seed=2)
    cfg = tg.default_config()
    A, B = logical
    out = torch.empty(m, n, dtype=dtype, device=DEVICE)
    ref = checked_gemm(A.cpu(), B.cpu(), out_dtype=dtype, col_check=True)
    for fault, expect_alarm in ((None, 0), ((tg.FAULT_PERTURB, 9, 77, 4.0, 0), 2)):
        stats = torch.zeros(tg.STATS_LEN, dtype=torch.int64, device=DEVICE)
        counters = torch.zeros(-(-m // cfg.block_m) + -(-n // cfg.block_n) + 1, dtype=torch.int32, device=DEVICE)
        tg.launch_checked_gemm(
            a, b, out, a_t=flags[0], b_t=flags[1], cvec=B.double().sum(1), beta=(B.float() ** 2).sum(1),
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
