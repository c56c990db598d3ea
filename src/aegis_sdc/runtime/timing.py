"""Intervals on the device's stream, read without waiting.

A mark is an event recorded on the current stream (CUDA) or the wall clock (CPU). An interval
between two marks is taken once the device has passed its closing event: nothing waits for the
device. The budget's step timer (runtime/budget.py) and the state sensors' clock
(runtime/sensor_cost.py) both time with it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable, Iterator

import torch


class DeviceIntervals:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._open: deque = deque()  # (start, end, key) the device has not passed yet

    def mark(self) -> object:
        """Now, on the current stream."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, start: object, end: object, key: Hashable) -> None:
        """The interval between two marks, under `key`."""
        self._open.append((start, end, key))

    def finished(self) -> Iterator[tuple[Hashable, float]]:
        """(key, ms) of the intervals the device has passed, in order, each once."""
        while self._open and (not self.cuda or self._open[0][1].query()):
            start, end, key = self._open.popleft()
            yield key, (start.elapsed_time(end) if self.cuda else (end - start) * 1000.0)
