"""What a check adds to a GEMM, timed on the device: the input of sampling to an overhead budget.

For a site of shape C[M, N] = A[M, K]·B[K, N] in its orientation (forward, dgrad or wgrad) the
checked launch — the path the training step takes when the site is sampled — is timed against the
unchecked GEMM (cuBLAS on a GPU, the plain matmul on the CPU) on random operands of that shape;
forward and dgrad also pay the per-step weight statistics of their weight, wgrad the passes over
its operands that give its reference side when the forward and dgrad were not checked. The difference, never
below zero, is the check's cost. Timings are medians over a few runs after a warm-up, with CUDA
events on a GPU (nothing but this measurement synchronizes) and the wall clock on the CPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from aegis_sdc.kernels import triton_gemm as tg
from aegis_sdc.kernels.gemm_side import SideMatrix
from aegis_sdc.kernels.reference import Tiling, checked_gemm
from aegis_sdc.kernels.weight_sums import WeightSideBuffers, weight_side_matrices
from aegis_sdc.ops.checked_attention import attention_flops, checked_attention
from aegis_sdc.ops.triton_linear import column_sums, row_sums

ORIENTATION = {"fwd": (False, True), "dgrad": (False, False), "wgrad": (True, False)}  # (A stored ᵀ, B stored ᵀ)
WARMUP, REPEATS = 2, 7
TIMED_ELEMENTS = 1 << 26  # 128 MiB of bf16 per timed operand
# Before each timed run the GPU spins this many cycles (about a millisecond on an H200), so that the
# run's launches are queued behind it and the events measure the GPU's work alone — as in a training
# step, whose queue runs ahead of the GPU. Timed from an idle GPU, a run of two launches would also
# count the host's time to issue the second (tens of microseconds: more than a small GEMM takes). What
# checks cost the host is paid from the budget through the plan's measured cost (runtime/budget.py).
QUEUE_AHEAD_CYCLES = 2_000_000


def _median_ms(fn: Callable[[], object], device: torch.device) -> float:
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(REPEATS):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(times)


def check_cost_ms(
    kind: str, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device, *, col_check: bool, triton: bool,
    tiling: Tiling,
) -> float:  # fmt: skip
    """Milliseconds a checked call of this site adds over an unchecked one (see the module docstring)."""
    return sum(check_cost_parts(kind, shape, dtype, device, col_check=col_check, triton=triton, tiling=tiling))


def check_cost_parts(
    kind: str, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device, *, col_check: bool, triton: bool,
    tiling: Tiling,
) -> tuple[float, float]:  # fmt: skip
    """`check_cost_ms` in its two parts: (what grows with the call's tokens — the checked GEMM over the
    plain one, the passes over an activation —, the pass over the weight, which does not)."""
    m, k, n = shape
    # Time at most TIMED_ELEMENTS per token-sized operand (a 128K-vocabulary lm_head at 16K tokens
    # would need gigabytes at the user's peak memory) and extrapolate: GEMM time is linear in the
    # tokens plus what a launch costs whatever its size (the evidence's finish, a short last wave),
    # so a capped site is timed at two token counts and the line through them carried to the call's —
    # scaled in proportion instead, a 32K-vocabulary head at 8K tokens was charged that fixed part ×3.9.
    tokens = k if kind == "wgrad" else m
    width = max(m, n) if kind == "wgrad" else max(k, n)
    timed = min(tokens, max(256, TIMED_ELEMENTS // max(width, 1)))

    def at(count: int) -> tuple[float, float]:
        return _timed_parts(kind, (count, k, n) if kind != "wgrad" else (m, count, n), dtype, device,
                            col_check=col_check, triton=triton, tiling=tiling, weight=count == timed)  # fmt: skip

    grows, weight_ms = at(timed)
    if timed < tokens:
        half = timed // 2
        slope = (grows - at(half)[0]) / (timed - half)
        grows = grows * tokens / timed if slope <= 0 else grows + slope * (tokens - timed)
    return max(0.0, grows), weight_ms


def _timed_parts(
    kind: str, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device, *, col_check: bool, triton: bool,
    tiling: Tiling, weight: bool,
) -> tuple[float, float]:  # fmt: skip
    """(checked GEMM + activation passes − plain GEMM, the weight's pass if `weight`) in ms at this shape."""
    m, k, n = shape
    a_t, b_t = ORIENTATION[kind]
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn((k, m) if a_t else (m, k), generator=gen, device=device).to(dtype)
    b = torch.randn((n, k) if b_t else (k, n), generator=gen, device=device).to(dtype)
    a_log = a.t() if a_t else a  # the logical A [M, K] and B [K, N]
    b_log = b.t() if b_t else b
    plain = _median_ms(lambda: a_log @ b_log, device)
    extra = 0.0  # passes over an activation: they grow with the tokens, as the GEMM does
    weight_ms = 0.0  # the pass over the weight: its size is the weight's whatever the tokens
    if triton and kind != "wgrad":  # the weight is B (stored [N, K] in forward, [K, N] in dgrad): its
        # sums and side matrices, once per step (shared by forward and dgrad: counted with each), into
        # buffers kept from step to step; alone, as the upper bound of its share of a grouped pass
        if weight:
            buffers = WeightSideBuffers.empty(b)
            weight_ms = _median_ms(lambda: weight_side_matrices(b, out=buffers), device)
        if col_check:  # u1 = 1ᵀA: a pass over the activation
            extra = _median_ms(lambda: SideMatrix.of(column_sums(a), dtype), device)
    if triton and kind == "wgrad":  # X·1 (and dY·1 for the column side): a pass over each operand
        # when no checked forward (dgrad) made it as a by-product
        extra = _median_ms(lambda: (row_sums(b), row_sums(a) if col_check else None), device)
    if triton:
        out = torch.empty(m, n, dtype=dtype, device=device)
        c_side = SideMatrix.of(torch.randn(k, generator=gen, device=device, dtype=torch.float64), dtype)
        u_side = c_side if col_check else None
        stats = torch.zeros(tg.STATS_LEN, dtype=torch.int64, device=device)
        cfg = tg.config_for(m, n, k)
        counters = torch.zeros(tg.counters_needed(m, n, cfg), dtype=torch.int32, device=device)

        def checked() -> None:
            tg.launch_checked_gemm(
                a, b, out, a_t=a_t, b_t=b_t, c_side=c_side, u_side=u_side, row_check=True, row_side=True,
                col_check=col_check, stats=stats, counters=counters, cfg=cfg, scratch=True,
            )  # fmt: skip
    else:

        def checked() -> None:
            checked_gemm(a_log, b_log, out_dtype=dtype, col_check=col_check, tiling=tiling)

    return _median_ms(checked, device) + extra - plain, weight_ms


ATTENTION_TIMED_FLOPS = 1 << 36  # per timed call: a few milliseconds on a GPU; larger calls scale by heads


class _TimedHooks:
    """Hooks that check every call and keep nothing: the op's own cost."""

    def plan(self, heads: int) -> object:
        return object()

    def fault_for(self, plan: object, backward: bool) -> None:
        return None

    def observe(self, plan: object, backward: bool, values: torch.Tensor, capture: object) -> None:
        return None


def attention_check_cost_ms(
    heads: int, queries: int, keys: int, dim: int, dtype: torch.dtype, causal: bool, device: torch.device
) -> float:
    """Milliseconds a checked attention call (forward and backward, ops/checked_attention.py on the
    kernels it would run) adds over SDPA's default backend, timed on random operands [1, heads, S, D]
    — at most ATTENTION_TIMED_FLOPS per call, scaled by heads (each head costs alike)."""
    timed = max(1, min(heads, int(ATTENTION_TIMED_FLOPS // max(attention_flops(1, queries, keys, dim, causal), 1))))
    gen = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(1, timed, queries, dim, generator=gen, device=device).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, timed, keys, dim, generator=gen, device=device).to(dtype) for _ in range(2))
    inputs = [t.requires_grad_() for t in (q, k, v)]
    sdpa = torch._C._nn.scaled_dot_product_attention  # SDPA itself, whatever a guard patched over it
    hooks = _TimedHooks()

    def step(attention: Callable[..., torch.Tensor]) -> Callable[[], object]:
        return lambda: torch.autograd.grad(attention(*inputs), inputs, dout)

    plain = _median_ms(step(lambda q, k, v: sdpa(q, k, v, is_causal=causal)), device)
    checked = _median_ms(step(lambda q, k, v: checked_attention(q, k, v, causal=causal, hooks=hooks)), device)
    return max(0.0, checked - plain) * heads / timed
