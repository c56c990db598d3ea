"""Fault models: what a faulty matrix unit does to a GEMM's fp32 accumulator.

A fault is applied to one element of the fp32 accumulator *before* the checksum is taken and before
the result is rounded to the output dtype: the model of a defective MMA unit whose wrong partial
product lands in the accumulator. Two models:

- ``bitflip``: flip bit `bit` of the fp32 accumulator element (0 = mantissa LSB, 23–30 exponent,
  31 sign).
- ``perturb``: add ±`scale`·m to the element, where m is the site's median clean checksum
  difference ‖C·1 − A·(B·1)‖₂ (the AEGIS fault-injection experiment). r = `scale` = 1 is a
  corruption as large as the whole checksum noise of the GEMM, summed over all rows.

Faults fire at chosen steps or with a probability per call, reproducibly from a seed. A fired
fault is applied to the call whether or not the sampler checks it: an unsampled faulty call
corrupts training unseen, exactly as a real faulty device would.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from aegis_sdc.hashing import unit_hash

MODELS = ("bitflip", "perturb")
ATTENTION_STAGES = ("qk", "softmax", "pv", "dp", "ds", "dq", "dk")


@dataclass(frozen=True)
class FaultSpec:
    """One fault to inject. `site` is an fnmatch pattern over site names (``layers.1.mlp.*:fwd``)."""

    site: str
    model: str = "perturb"
    scale: float = 4.0  # perturb: |δ| = scale × the site's median clean checksum difference
    bit: int = 30  # bitflip: fp32 bit index; 30 is the exponent's top bit (a ×2¹²⁸-scale error)
    steps: tuple[int, ...] = ()  # fire on the first call of the site at each of these steps ...
    probability: float = 0.0  # ... or on each call with this probability
    start_step: int = 0  # probability mode: first step at which the fault may fire
    stop_step: int | None = None  # probability mode: first step at which it stops (None: never)
    row: int | None = None  # accumulator element; drawn from the seed when None
    col: int | None = None
    seed: int = 0
    affects_replay: bool = False  # a persistent fault: replays compute the same corruption
    ranks: tuple[int, ...] = ()  # the ranks whose device is faulty (empty: every rank)
    # attention sites: "qk" (a score), "softmax" (a probability), "pv" (an accumulator of O or dV);
    # backward only: "dp" (dP = dO·Vᵀ), "ds" (dS = P ∘ (dP − D)), "dq" / "dk" (their accumulators)
    stage: str = "pv"
    head: int | None = None  # attention sites: the (batch · heads + head) corrupted; drawn from the seed when None

    def __post_init__(self) -> None:
        if not isinstance(self.site, str) or not self.site:
            raise ValueError("FaultSpec.site must be a non-empty fnmatch pattern over site names")
        if self.model not in MODELS:
            raise ValueError(f"FaultSpec.model must be one of {MODELS}, got {self.model!r}")
        if not (0 <= self.bit <= 31):
            raise ValueError(f"FaultSpec.bit must be an fp32 bit index in 0..31, got {self.bit}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"FaultSpec.scale must be finite and > 0, got {self.scale}")
        if not (0.0 <= self.probability <= 1.0):
            raise ValueError(f"FaultSpec.probability must lie in [0, 1], got {self.probability}")
        object.__setattr__(self, "steps", tuple(int(s) for s in self.steps))
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        if any(s < 0 for s in self.steps):
            raise ValueError("FaultSpec.steps must be non-negative step numbers")
        if not self.steps and self.probability == 0.0:
            raise ValueError("FaultSpec needs `steps` or a `probability` > 0, or it never fires")
        if self.start_step < 0 or (self.stop_step is not None and self.stop_step <= self.start_step):
            raise ValueError("FaultSpec needs 0 <= start_step < stop_step")
        if self.stage not in ATTENTION_STAGES:
            raise ValueError(f"FaultSpec.stage must be one of {ATTENTION_STAGES}, got {self.stage!r}")
        for name in ("row", "col", "head"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"FaultSpec.{name} must be >= 0, got {value}")

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """A spec from its command-line form ``SITE@field=value,field=value``.

        Lists (`steps`, `ranks`) join items with ``+`` and take inclusive ranges ``a-b``:
        ``layers.1.mlp.up_proj:fwd@model=bitflip,bit=22,steps=40+100-104``. Every field of the
        dataclass may be given; a bursty fault is ``probability=0.5,start_step=100,stop_step=110``.
        """
        site, _, rest = text.partition("@")
        fields: dict[str, Any] = {}
        for item in filter(None, rest.split(",")):
            key, sep, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in _FIELD_PARSERS:
                known = ", ".join(sorted(_FIELD_PARSERS))
                raise ValueError(f"fault {text!r}: expected field=value with a field among {known}, got {item!r}")
            try:
                fields[key] = _FIELD_PARSERS[key](value.strip())
            except ValueError as error:
                raise ValueError(f"fault {text!r}: bad value for {key}: {value!r} ({error})") from None
        return cls(site=site.strip(), **fields)

    def matches(self, site_name: str, rank: int = 0) -> bool:
        return fnmatch.fnmatchcase(site_name, self.site) and (not self.ranks or rank in self.ranks)

    def may_fire(self, step: int) -> bool:
        """Whether any call at `step` may fire (`fires` decides per call)."""
        if self.steps:
            return step in self.steps
        return self.start_step <= step and (self.stop_step is None or step < self.stop_step)

    def fires(self, site_id: int, step: int, call_in_step: int) -> bool:
        if self.steps:
            return call_in_step == 0 and step in self.steps
        if step < self.start_step or (self.stop_step is not None and step >= self.stop_step):
            return False
        return unit_hash(self.seed, 0xFA17, site_id, step, call_in_step) < self.probability


def _int_list(text: str) -> tuple[int, ...]:
    """``40+100-104`` → (40, 100, 101, 102, 103, 104)."""
    out: list[int] = []
    for part in filter(None, text.split("+")):
        first, dash, last = part.partition("-")
        if dash:
            lo, hi = int(first), int(last)
            if hi < lo:
                raise ValueError(f"empty range {part}")
            out.extend(range(lo, hi + 1))
        else:
            out.append(int(first))
    return tuple(out)


def _optional_int(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise ValueError("expected true or false")


_FIELD_PARSERS: dict[str, Callable[[str], Any]] = {
    "model": str,
    "scale": float,
    "bit": int,
    "steps": _int_list,
    "probability": float,
    "start_step": int,
    "stop_step": _optional_int,
    "row": _optional_int,
    "col": _optional_int,
    "seed": int,
    "affects_replay": _bool,
    "ranks": _int_list,
    "stage": str,
    "head": _optional_int,
}


@dataclass(frozen=True)
class AccumulatorFault:
    """A fault resolved for one call: which accumulator element, and how it is corrupted.

    `row_u` / `col_u` in [0, 1) pick the element when the spec left it free; the kernel resolves
    them against the GEMM's shape through `element()`.
    """

    model: str
    bit: int
    delta: float | torch.Tensor  # perturb: the signed value added (a 0-d device tensor when scaled on device)
    row: int | None
    col: int | None
    row_u: float
    col_u: float
    affects_replay: bool = False

    def element(self, rows: int, cols: int) -> tuple[int, int]:
        row = self.row if self.row is not None else int(self.row_u * rows)
        col = self.col if self.col is not None else int(self.col_u * cols)
        return min(row, rows - 1), min(col, cols - 1)

    def corrupt(self, value: torch.Tensor) -> torch.Tensor:
        """Corrupt a 0-d fp32 tensor and return the corrupted value."""
        if self.model == "perturb":
            return value + self.delta
        mask = -(2**31) if self.bit == 31 else 1 << self.bit  # int32 two's complement for the sign bit
        bits = value.reshape(1).view(torch.int32) ^ mask
        return bits.view(torch.float32).reshape(())

    def describe(self) -> str:
        if self.model == "perturb":
            return f"perturb {float(self.delta):+.4g}"  # delta may be a 0-d tensor (see ops)
        return f"bitflip bit {self.bit}"


def resolve(spec: FaultSpec, site_id: int, step: int, call_in_step: int, median_l2: float) -> AccumulatorFault:
    """Draw the element and sign of one firing of `spec` (reproducible from its seed)."""
    sign = 1.0 if unit_hash(spec.seed, 0x5161, site_id, step, call_in_step) < 0.5 else -1.0
    return AccumulatorFault(
        model=spec.model,
        bit=spec.bit,
        delta=sign * spec.scale * median_l2,
        row=spec.row,
        col=spec.col,
        row_u=unit_hash(spec.seed, 0x0A11, site_id, step, call_in_step),
        col_u=unit_hash(spec.seed, 0x0C01, site_id, step, call_in_step),
        affects_replay=spec.affects_replay,
    )
