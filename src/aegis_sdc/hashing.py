"""Counter-based hashing: reproducible random decisions without shared RNG state.

Sampling and fault decisions must be identical on every data-parallel rank for the same step and
independent of the order in which sites are called, so they are a pure function of their keys
(seed, site, step, call) instead of draws from a stateful generator.
"""

from __future__ import annotations

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def unit_hash(*keys: int) -> float:
    """A uniform number in [0, 1) determined by the integer keys."""
    h = 0x243F6A8885A308D3
    for key in keys:
        h = _splitmix64(h ^ (key & _MASK))
    return (h >> 11) * (1.0 / (1 << 53))
