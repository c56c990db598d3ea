"""Field checks of the frozen dataclasses (configuration, fault specs): each takes the owner's and
the field's names for its message, raises TypeError for a value of the wrong type and ValueError for
one out of range, and returns the value normalized (a numpy scalar becomes a Python number)."""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Callable
from typing import Any

# Seeds key the vectorized hashes as int64 (hashing.unit_hash_array): wider ints cannot be keys.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def shown(value: object) -> str:
    return reprlib.repr(value)  # bounded: a million-element list must not become the message


def _number(bound: float) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def _range_text(ge: float | None = None, gt: float | None = None, le: float | None = None) -> str:
    low = f"[{_number(ge)}" if ge is not None else f"({_number(gt)}" if gt is not None else None
    if low is not None and le is not None:
        return f" in {low}, {_number(le)}]"
    if ge is not None:
        return f" >= {_number(ge)}"
    if gt is not None:
        return f" > {_number(gt)}"
    return f" <= {_number(le)}" if le is not None else ""


def check_int(
    owner: str, name: str, value: object, *, ge: int | None = None, le: int | None = None, optional: bool = False
) -> int | None:
    """An int (a bool or a float is not one) within [ge, le]; None too when `optional`."""
    if optional and value is None:
        return None
    expected = "an int" + _range_text(ge=ge, le=le) + (" or None" if optional else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}.{name} must be {expected}, got {shown(value)}")
    number = int(value)
    if (ge is not None and number < ge) or (le is not None and number > le):
        raise ValueError(f"{owner}.{name} must be {expected}, got {number}")
    return number


def check_real(
    owner: str,
    name: str,
    value: object,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    optional: bool = False,
) -> float | None:
    """A finite real number (an int is one, a bool is not) within the bounds; None too when `optional`."""
    if optional and value is None:
        return None
    expected = "a finite number" + _range_text(ge=ge, gt=gt, le=le) + (" or None" if optional else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}.{name} must be {expected}, got {shown(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        number = math.inf
    if (
        not math.isfinite(number)
        or (ge is not None and number < ge)
        or (gt is not None and number <= gt)
        or (le is not None and number > le)
    ):
        raise ValueError(f"{owner}.{name} must be {expected}, got {shown(value)}")
    return number


def check_bool(owner: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):  # 0/1 or "false" would silently mean something else
        raise TypeError(f"{owner}.{name} must be a bool, got {shown(value)}")
    return value


def check_choice(owner: str, name: str, value: object, *, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{owner}.{name} must be one of {choices}, got {shown(value)}")
    if value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {choices}, got {value!r}")
    return value


def check_text(owner: str, name: str, value: object) -> str:
    """A non-empty str."""
    if not isinstance(value, str):
        raise TypeError(f"{owner}.{name} must be a non-empty str, got {shown(value)}")
    if not value:
        raise ValueError(f"{owner}.{name} must be a non-empty str, got ''")
    return value


def set_field(obj: Any, name: str, check: Callable[..., Any], **options: Any) -> None:
    """Check field `name` of the frozen dataclass `obj` with `check` and store its normalized value."""
    object.__setattr__(obj, name, check(type(obj).__name__, name, getattr(obj, name), **options))
