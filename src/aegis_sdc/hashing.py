"""Counter-based hashing: reproducible random decisions without shared RNG state.

Sampling and fault decisions must be identical on every data-parallel rank for the same step and
independent of the order in which sites are called, so they are a pure function of their keys
(seed, site, step, call) instead of draws from a stateful generator.
"""

from __future__ import annotations

import numpy as np

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


def unit_hash_array(*keys) -> np.ndarray:
    """`unit_hash` over numpy arrays of keys (broadcast), bit for bit: the decisions of many sites
    in one vectorized pass (uint64 arithmetic wraps modulo 2⁶⁴, as `_MASK` does above)."""
    h = np.full(np.broadcast_shapes(*(np.shape(k) for k in keys)), 0x243F6A8885A308D3, dtype=np.uint64)
    for key in keys:
        h = _splitmix64_array(h ^ np.asarray(key, dtype=np.int64).astype(np.uint64))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
