"""Chunk sums of the collective checks: the fused Triton pass (CUDA, or the interpreter on the CPU)
against the plain-torch one and against exact fp64 sums, and the rounding bound they rely on."""

from __future__ import annotations

import pytest
import torch

from aegis_sdc.distributed.comm_check import SUB, chunk_size, chunk_sums, rounding_bound
from aegis_sdc.kernels.triton_chunk_sums import triton_chunk_sums

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def exact(flat: torch.Tensor, chunks: int, size: int) -> torch.Tensor:
    """[2, chunks] fp64 sums of fp64 values, chunk by chunk: the truth both versions approximate."""
    out = torch.zeros(2, chunks, dtype=torch.float64)
    values = flat.double().cpu()
    for c in range(chunks):
        part = values[c * size : (c + 1) * size]
        out[0, c], out[1, c] = part.sum(), part.abs().sum()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,chunks", [(10_000, 8), (64 * 37 + 5, 3), (100, 64)])
def test_triton_chunk_sums_match_exact_sums(dtype, n, chunks):
    # bf16 only loads and converts to fp32 in this kernel: exact under the interpreter too (GPU.md).
    g = torch.Generator().manual_seed(n)
    flat = (torch.randn(n, generator=g) * 3 + 0.5).to(dtype)
    size = chunk_size(n, chunks)
    got = triton_chunk_sums(flat.to(DEVICE), chunks, size, SUB).cpu()
    truth = exact(flat, chunks, size)
    # Each SUB-group is summed in fp32 (relative error ≤ SUB·u₃₂ of its magnitudes), groups in fp64
    # (≤ chunks-size·u₆₄, negligible): |error| ≤ SUB·u₃₂·Σ|x| per chunk. Half the bound's own
    # allowance (4·SUB·u₃₂), so a wrong kernel cannot hide in it.
    allowed = SUB * 2.0**-24 * truth[1] + 1e-300
    assert torch.all((got - truth).abs() <= allowed), (got - truth).abs() / allowed
    # The plain-torch path on the CPU cuts the same chunks.
    ref = chunk_sums(flat, chunks)
    assert torch.all((ref - truth).abs() <= allowed)
    # Past the data, chunks are zero (n = 100 with 64 chunks of 64 elements fills two).
    assert torch.all(got[:, -(-n // size) :] == 0)


def test_triton_chunk_sums_see_one_flipped_element():
    flat = torch.randn(50_000, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    chunks, size = 16, chunk_size(50_000, 16)
    clean = triton_chunk_sums(flat.to(DEVICE), chunks, size, SUB).cpu()
    # One element off by 16: 0.6% of the chunk's magnitude (~2500), above the fp16 reduction bound
    # (2·γ₂ + 4·SUB·u₃₂ ≈ 0.1% of it)
    flat[31_000] += 16
    dirty = triton_chunk_sums(flat.to(DEVICE), chunks, size, SUB).cpu()
    bound = rounding_bound(torch.float16, 2, clean[1])
    ratio = (dirty[0] - clean[0]).abs() / bound
    assert int(ratio.argmax()) == 31_000 // size and float(ratio.max()) > 1.0
    assert torch.all(ratio[torch.arange(chunks) != 31_000 // size] == 0)  # deterministic elsewhere
