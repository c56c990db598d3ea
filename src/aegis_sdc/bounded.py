"""What the guard keeps in memory of a long run: the most recent records, and a count of the rest.

Every incident, injected fault and outlier warning of a run is in the store; the guard's own lists
are for the live run (listeners, summaries, tests) and must not grow with it — a storm of 20 000
incidents over 3 000 steps would otherwise hold every one of them until the process ends. A
`BoundedLog` keeps the last `limit` records and counts what it let go (`dropped`), so a summary
still reports the run's totals (`total`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar, overload

T = TypeVar("T")

# Records kept per log. 10 000 incidents (their evidence and verdict, ~2 KB each) are ~20 MB at most;
# a run with more is a storm, and the store has all of them.
RECORDS_KEPT = 10_000


class BoundedLog(Generic[T]):
    """An append-only log that keeps its last `limit` records; `total` counts every record appended."""

    def __init__(self, limit: int | None = None) -> None:
        limit = RECORDS_KEPT if limit is None else limit
        if limit < 1:
            raise ValueError(f"BoundedLog limit must be >= 1, got {limit}")
        self._kept: deque[T] = deque(maxlen=limit)
        self.total = 0

    @property
    def dropped(self) -> int:
        """Records appended and no longer kept (the oldest)."""
        return self.total - len(self._kept)

    def append(self, record: T) -> None:
        self._kept.append(record)
        self.total += 1

    def extend(self, records: Iterable[T]) -> None:
        for record in records:
            self.append(record)

    def since(self, total: int) -> list[T]:
        """The records appended after the log held `total` records, as far as they are still kept."""
        return list(self._kept)[max(0, len(self._kept) - (self.total - total)) :] if self.total > total else []

    def __iter__(self) -> Iterator[T]:
        return iter(self._kept)

    def __len__(self) -> int:
        return len(self._kept)

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...
    def __getitem__(self, index: int | slice) -> T | list[T]:
        """A record, or a list of them for a slice (`guard.incidents[-3:]`), as the list it replaces."""
        if isinstance(index, slice):
            return list(self._kept)[index]
        return self._kept[index]

    def __bool__(self) -> bool:
        return bool(self._kept)

    def __eq__(self, other: object) -> bool:  # as the list it replaces: `guard.incidents == []`
        if isinstance(other, (BoundedLog, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, like a list

    def __repr__(self) -> str:
        return f"BoundedLog(kept={len(self._kept)}, total={self.total})"
