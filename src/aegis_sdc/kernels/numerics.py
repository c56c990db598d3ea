"""The numerics every checked op and every replay runs under, whatever the caller has set.

A replay is compared bit for bit with what the training step computed, and an fp64 recomputation
bounds every correct fp32 result; both hold only if the checked computation always runs with the
same arithmetic. Two global settings would change it behind the op's back:

- autocast: `torch.mm` inside a checked op would run in bf16/fp16 under the caller's autocast, and
  the replay (at the step's end, outside it) in fp32 — different bits, and a healthy device blamed;
- the fp32 matmul precision (`torch.set_float32_matmul_precision("high"/"medium")`,
  `torch.backends.cuda.matmul.allow_tf32`, Hugging Face `tf32=True`): fp32 GEMMs then round their
  operands to TF32 (CUDA) or bf16 (oneDNN on the CPU), so the products are no longer exact and the
  fp64 error bound would call correct results wrong.

`exact_fp32(device_type)` switches both off for the duration of a checked computation and restores the
caller's settings afterwards. It sets the per-backend precision (`torch.backends.{cuda,mkldnn}.matmul
.fp32_precision`), which accepts settings made through either the legacy or the new API.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

EXACT = "ieee"  # full fp32 precision in the per-backend API


def _matmul_backends() -> tuple:
    backends = torch.backends
    return tuple(b.matmul for b in (backends.cuda, backends.mkldnn) if hasattr(b.matmul, "fp32_precision"))


@contextlib.contextmanager
def exact_fp32(device_type: str) -> Iterator[None]:
    """No autocast, and fp32 matmuls in full fp32 precision, inside; the caller's settings restored after."""
    backends = _matmul_backends()
    saved = tuple(b.fp32_precision for b in backends)
    changed = [b for b, value in zip(backends, saved, strict=True) if value not in (EXACT, "none")]
    with torch.autocast(device_type, enabled=False):
        if not changed:
            yield
            return
        for b in changed:
            b.fp32_precision = EXACT
        try:
            yield
        finally:
            for b, value in zip(backends, saved, strict=True):
                if b in changed:
                    b.fp32_precision = value
