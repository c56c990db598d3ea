"""Host-side launch arithmetic on plain integers.

`triton.cdiv` is a constexpr function in recent Triton releases: it unwraps its arguments as
constexprs on every call, microseconds each — and a checked GEMM computes a dozen grid sizes per
launch on the training step's host path.
"""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """⌈a / b⌉ for integers, b > 0."""
    return -(-a // b)
