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

import bisect
import fnmatch
import numbers
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from aegis_sdc.hashing import unit_hash
from aegis_sdc.validation import (
    INT64_MAX,
    INT64_MIN,
    check_bool,
    check_choice,
    check_int,
    check_real,
    check_text,
    set_field,
    shown,
)

MODELS = ("bitflip", "perturb")
ATTENTION_STAGES = ("qk", "softmax", "pv", "dp", "ds", "dq", "dk")

# IntRanges of at most this many ints compare equal to (and hash as) the tuple of them; hashing one
# materializes that tuple, which stays small below this bound.
TUPLE_EQUAL_MAX = 1 << 16


class IntRanges:
    """A set of ints kept as sorted, disjoint, half-open ranges ``[start, stop)``.

    A fault's `steps` and `ranks`: ``steps=0-999999999`` costs two ints, and membership is a binary
    search over the ranges, never an expansion of them. Iterating yields the ints in increasing
    order; ``str()`` gives the command-line form (``40+100-104``). Immutable and hashable; equal to
    the tuple of its ints in increasing order when it holds at most `TUPLE_EQUAL_MAX` of them (a
    larger set is never expanded to be compared or hashed).
    """

    __slots__ = ("_ranges", "_starts")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        pairs = []
        for pair in ranges:
            start, stop = (check_int("IntRanges", "ranges", bound) for bound in pair)
            if start < stop:
                pairs.append((start, stop))
        merged: list[tuple[int, int]] = []
        for start, stop in sorted(pairs):
            if merged and start <= merged[-1][1]:  # overlapping or adjacent: one range
                merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
            else:
                merged.append((start, stop))
        self._ranges: tuple[tuple[int, int], ...] = tuple(merged)
        self._starts = tuple(start for start, _ in merged)

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return self._ranges

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            return False
        i = bisect.bisect_right(self._starts, value) - 1
        return i >= 0 and value < self._ranges[i][1]

    def __iter__(self) -> Iterator[int]:
        for start, stop in self._ranges:
            yield from range(start, stop)

    def _count(self) -> int:
        return sum(stop - start for start, stop in self._ranges)  # len() caps at sys.maxsize; this does not

    def __len__(self) -> int:
        return self._count()

    def __bool__(self) -> bool:
        return bool(self._ranges)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IntRanges):
            return self._ranges == other._ranges
        if isinstance(other, tuple):  # the form `FaultSpec.steps` had: its ints in increasing order
            fits = len(other) <= TUPLE_EQUAL_MAX and self._count() == len(other)
            return fits and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        # Equal to a tuple means equal hashes: the tuple's, for the sets that can equal one.
        return hash(tuple(self)) if self._count() <= TUPLE_EQUAL_MAX else hash(self._ranges)

    def __str__(self) -> str:
        return "+".join(str(a) if b == a + 1 else f"{a}-{b - 1}" for a, b in self._ranges)

    def __repr__(self) -> str:
        return f"IntRanges({self._ranges!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return IntRanges, (self._ranges,)

    def __copy__(self) -> IntRanges:
        return self  # immutable

    def __deepcopy__(self, memo: dict[int, Any]) -> IntRanges:
        return self  # immutable (dataclasses.asdict deep-copies the fields it does not recurse into)


def _check_int_set(owner: str, name: str, value: object) -> IntRanges:
    """Ints >= 0: an `IntRanges`, a `range` of step 1 (kept whole, not expanded) or an iterable of ints."""
    if isinstance(value, IntRanges):
        found = value
    elif isinstance(value, range) and value.step == 1:
        found = IntRanges([(value.start, value.stop)])
    elif isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{owner}.{name} must be a tuple of ints >= 0, a range or an IntRanges, got {shown(value)}")
    else:
        items = (check_int(owner, f"{name}[{i}]", item) for i, item in enumerate(value))
        found = IntRanges((n, n + 1) for n in items)
    if found and found.ranges[0][0] < 0:
        raise ValueError(f"{owner}.{name} must hold ints >= 0, got {found.ranges[0][0]}")
    return found


@dataclass(frozen=True)
class FaultSpec:
    """One fault to inject. `site` is an fnmatch pattern over site names (``layers.1.mlp.*:fwd``)."""

    site: str
    model: str = "perturb"
    scale: float = 4.0  # perturb: |δ| = scale × the site's median clean checksum difference
    bit: int = 30  # bitflip: fp32 bit index; 30 is the exponent's top bit (a ×2¹²⁸-scale error)
    # fire on the first call of the site at each of these steps — of a backward site, the first that
    # runs (FaultInjector.fire) — (ints, a range or an IntRanges; stored as IntRanges: a range of a
    # billion steps is two ints) ...
    steps: IntRanges | Iterable[int] = ()
    probability: float = 0.0  # ... or on each call with this probability
    start_step: int = 0  # probability mode: first step at which the fault may fire
    stop_step: int | None = None  # probability mode: first step at which it stops (None: never)
    row: int | None = None  # accumulator element; drawn from the seed when None
    col: int | None = None
    seed: int = 0
    affects_replay: bool = False  # a persistent fault: replays compute the same corruption
    ranks: IntRanges | Iterable[int] = ()  # the ranks whose device is faulty (empty: every rank); as `steps`
    # attention sites: "qk" (a score), "softmax" (a probability), "pv" (an accumulator of O or dV);
    # backward only: "dp" (dP = dO·Vᵀ), "ds" (dS = P ∘ (dP − D)), "dq" / "dk" (their accumulators)
    stage: str = "pv"
    head: int | None = None  # attention sites: the (batch · heads + head) corrupted; drawn from the seed when None

    def __post_init__(self) -> None:
        set_field(self, "site", check_text)
        set_field(self, "model", check_choice, choices=MODELS)
        set_field(self, "scale", check_real, gt=0.0)
        set_field(self, "bit", check_int, ge=0, le=31)  # an fp32 bit index
        set_field(self, "steps", _check_int_set)
        set_field(self, "probability", check_real, ge=0.0, le=1.0)
        set_field(self, "start_step", check_int, ge=0)
        set_field(self, "stop_step", check_int, ge=0, optional=True)
        if self.stop_step is not None and self.stop_step <= self.start_step:
            raise ValueError(
                f"FaultSpec.stop_step must be > start_step ({self.start_step}) or None, got {self.stop_step}"
            )
        for name in ("row", "col", "head"):
            set_field(self, name, check_int, ge=0, optional=True)
        set_field(self, "seed", check_int, ge=INT64_MIN, le=INT64_MAX)
        set_field(self, "affects_replay", check_bool)
        set_field(self, "ranks", _check_int_set)
        set_field(self, "stage", check_choice, choices=ATTENTION_STAGES)
        if not self.steps and self.probability == 0.0:
            raise ValueError("FaultSpec.steps is empty and FaultSpec.probability is 0: the fault never fires")

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """A spec from its command-line form ``SITE@field=value,field=value``.

        Lists (`steps`, `ranks`) join items with ``+`` and take inclusive ranges ``a-b``, kept as
        ranges (`IntRanges`): ``layers.1.mlp.up_proj:fwd@model=bitflip,bit=22,steps=40+100-104``.
        Every field of the dataclass may be given, once; a bursty fault is
        ``probability=0.5,start_step=100,stop_step=110``. A bad spec raises ValueError naming the
        field (``FaultSpec.bit``) and quoting `text`.
        """
        if not isinstance(text, str):
            raise TypeError(f"FaultSpec.parse takes the text SITE@field=value,..., got {shown(text)}")
        site, _, rest = text.partition("@")
        fields: dict[str, Any] = {}
        for item in filter(None, rest.split(",")):
            key, sep, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in _FIELD_PARSERS:
                known = ", ".join(sorted(_FIELD_PARSERS))
                raise ValueError(f"fault {text!r}: expected field=value with a field among {known}, got {item!r}")
            if key in fields:  # the last one winning would hide a typo
                raise ValueError(f"fault {text!r}: FaultSpec.{key} given twice")
            try:
                fields[key] = _FIELD_PARSERS[key](value.strip())
            except ValueError as error:
                raise ValueError(
                    f"bad value for {key} in fault {text!r}: FaultSpec.{key} cannot be {value!r} ({error})"
                ) from None
        try:
            return cls(site=site.strip(), **fields)
        except ValueError as error:  # the parsers give every field its type: only ranges are left
            raise ValueError(f"fault {text!r}: {error}") from None

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


def _int_ranges(text: str) -> IntRanges:
    """``40+100-104`` → the ints 40 and 100 to 104 (inclusive), kept as ranges: never expanded."""
    ranges = []
    for part in filter(None, text.split("+")):
        first, dash, last = part.partition("-")
        lo = int(first)
        hi = int(last) if dash else lo
        if hi < lo:
            raise ValueError(f"empty range {part}")
        ranges.append((lo, hi + 1))
    return IntRanges(ranges)


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
    "steps": _int_ranges,
    "probability": float,
    "start_step": int,
    "stop_step": _optional_int,
    "row": _optional_int,
    "col": _optional_int,
    "seed": int,
    "affects_replay": _bool,
    "ranks": _int_ranges,
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
