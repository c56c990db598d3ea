"""Fingerprints taken on the hot path without a host sync, read once at the step's end.

`FingerprintPool.take(tensor)` returns a `Fingerprint` handle at once. On the Triton path (CUDA
tensors; CPU under TRITON_INTERPRET=1 with `use_triton`) the kernel adds the fingerprint's two lanes
into a row of an int32 [slots, SPREAD · 2] buffer that was zeroed at the start of the step; the guard reads
every used row in its one step-end transfer (`device_buffers` → `resolve`). On the reference path (CPU)
the value is computed at once in PyTorch: there is no device to wait for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from aegis_sdc.kernels import fingerprint as kfp


@dataclass(eq=False)
class Fingerprint:
    """A tensor's 64-bit fingerprint; `value` is known at once (reference path) or after `resolve`.
    `value` is None for a tensor that cannot be fingerprinted in place (not one dense block)."""

    value: int | None = None
    buffer: torch.Tensor | None = None  # int32 [slots, SPREAD · 2] on the device, until resolved
    slot: int = -1

    @property
    def pending(self) -> bool:
        return self.buffer is not None


class FingerprintPool:
    """Per device, int32 [slots, SPREAD · 2] buffers for this step's fingerprints (a row: a fingerprint's
    sub-counters, folded on the host); grown by whole buffers."""

    CACHED = 64  # launch tables kept (the update replay's slices, repeated batches of saved tensors)

    def __init__(self, slots: int = 4096, use_triton: bool = False) -> None:
        self.slots = slots
        # also on CPU tensors, but only where Triton interprets (tests): on a GPU machine a host tensor
        # among device ones (AdamW's `step` count) takes the reference path, Triton cannot launch on it
        self.use_triton = use_triton and os.environ.get("TRITON_INTERPRET") == "1"
        self._buffers: dict[torch.device, list[torch.Tensor]] = {}
        self._used: dict[torch.device, int] = {}
        self._pending: list[Fingerprint] = []
        self._launches: dict[tuple, tuple[kfp.Launch | None, list[bool]]] = {}
        self._slot_indices: dict[tuple, torch.Tensor] = {}  # (device, slots) → int64 [n] on the device

    def _triton(self, t: torch.Tensor) -> bool:
        return t.is_cuda or self.use_triton

    def _rows(self, device: torch.device, n: int) -> tuple[torch.Tensor, int]:
        """n consecutive rows of one buffer (a new buffer when the current one has fewer left; the
        rows skipped stay zero and are never read): (buffer, first row)."""
        buffers = self._buffers.get(device)
        if buffers is None:  # the device's first fingerprint: every kernel variant compiled now
            kfp.warm_up(device)
            buffers = self._buffers[device] = []
        used = self._used.get(device, 0)
        if used % self.slots + n > self.slots:
            used = -(-used // self.slots) * self.slots
        if used == len(buffers) * self.slots:
            buffers.append(torch.zeros(self.slots, kfp.ROW, dtype=torch.int32, device=device))
        self._used[device] = used + n
        return buffers[used // self.slots], used % self.slots

    def take(self, t: torch.Tensor) -> Fingerprint:
        """The fingerprint of `t` as it is now (the kernel is ordered on the current stream)."""
        return self.take_many([t])[0]

    def take_many(self, tensors: list[torch.Tensor]) -> list[Fingerprint]:
        """Fingerprints of several tensors; those on one device share one launch, into consecutive
        rows. The launch's tables are kept per list of tensor layouts (address, shape, strides): the
        same tensors fingerprinted again — parameters, optimizer state, copies in a reused block — cost
        a lookup and one launch, not a reading of each tensor's layout (tens of µs each)."""
        handles: list[Fingerprint | None] = [None] * len(tensors)
        on_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            if self._triton(t):
                on_device.setdefault(t.device, []).append(i)
            else:
                handles[i] = Fingerprint(kfp.fingerprint_reference(t) if kfp.dense_bytes(t) is not None else None)
        for device, indices in on_device.items():
            group = [tensors[i] for i in indices]
            for i, handle in zip(indices, self._take_on(device, group), strict=True):
                handles[i] = handle
        return handles  # type: ignore[return-value]

    def _take_on(self, device: torch.device, tensors: list[torch.Tensor]) -> list[Fingerprint]:
        key = (device, tuple((t.data_ptr(), t.shape, t.stride(), t.element_size()) for t in tensors))
        cached = self._launches.get(key)
        if cached is None:
            words = [kfp.as_words(t) for t in tensors]
            readable = [w for w in words if w is not None]
            if len(readable) == 1 or len(readable) > self.slots:  # one tensor: the kernel made for one
                return self._take_uncached(tensors, words)
            launch = kfp.prepare_many([(w, k) for k, w in enumerate(readable)], device) if readable else None
            cached = (launch, [w is not None for w in words])
            # a tensor copied to be read (an odd offset) is in this launch's table only
            if all(w is None or w.base.data_ptr() == t.data_ptr() for w, t in zip(words, tensors, strict=True)):
                if len(self._launches) >= self.CACHED:
                    self._launches.pop(next(iter(self._launches)))
                self._launches[key] = cached
        launch, seen = cached
        if launch is None:
            return [Fingerprint(None) for _ in tensors]
        buffer, first = self._rows(device, sum(seen))
        kfp.launch_prepared(launch, buffer[first:])
        handles, row = [], first
        for hit in seen:
            if hit:
                handle = Fingerprint(buffer=buffer, slot=row)
                self._pending.append(handle)
                row += 1
            else:
                handle = Fingerprint(None)
            handles.append(handle)
        return handles

    def _take_uncached(self, tensors: list[torch.Tensor], words: list[kfp.Words | None]) -> list[Fingerprint]:
        """One launch per tensor (a single one: its own kernel shape), or per buffer (a batch larger
        than a buffer)."""
        handles, batch = [], []
        for t, w in zip(tensors, words, strict=True):
            if w is None:
                handles.append(Fingerprint(None))
                continue
            buffer, slot = self._rows(t.device, 1)
            handle = Fingerprint(buffer=buffer, slot=slot)
            handles.append(handle)
            batch.append((w, buffer, slot))
            self._pending.append(handle)
        for buffer in {id(b): b for _, b, _ in batch}.values():
            items = [(w, s) for w, b, s in batch if b is buffer]
            if len(items) == 1:
                words_one, slot = items[0]
                kfp.launch_one(words_one, buffer[slot])
            else:
                kfp.launch_many(items, buffer)
        return handles

    def differ_on_device(self, pairs: list[tuple[Fingerprint, Fingerprint]]) -> torch.Tensor | None:
        """Whether any pair's two fingerprints differ, decided on the device before the step's read:
        bool [] on the device; None when a pair's value is already on the host (the reference path)
        or no pair can be compared (a tensor that could not be fingerprinted is never compared, as on
        the host): the host judges those.

        The rows' sub-counters are folded as `kfp.lanes_to_int` folds them (`kfp.fold_rows`), so the
        flag is exactly the host's `a.value != b.value` over the same pairs. The slots of a
        step repeat from step to step: their index tensors are built once (through pinned memory,
        no sync) and reused."""
        groups: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, list[int], list[int]]] = {}
        for a, b in pairs:
            if (a.value is None and not a.pending) or (b.value is None and not b.pending):
                continue  # not fingerprinted: never compared
            if not (a.pending and b.pending):
                return None
            group = groups.setdefault((a.buffer.data_ptr(), b.buffer.data_ptr()), (a.buffer, b.buffer, [], []))
            group[2].append(a.slot)
            group[3].append(b.slot)
        flags = []
        for first, second, first_slots, second_slots in groups.values():
            folded_first = kfp.fold_rows(first.index_select(0, self._indices(first.device, first_slots)))
            folded_second = kfp.fold_rows(second.index_select(0, self._indices(second.device, second_slots)))
            flags.append((folded_first != folded_second).any())
        if not flags:
            return None
        return flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).any()

    def _indices(self, device: torch.device, slots: list[int]) -> torch.Tensor:
        key = (device, tuple(slots))
        index = self._slot_indices.get(key)
        if index is None:
            host = torch.tensor(slots, dtype=torch.int64)
            index = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
            if len(self._slot_indices) >= self.CACHED:
                self._slot_indices.pop(next(iter(self._slot_indices)))
            self._slot_indices[key] = index
        return index

    def device_buffers(self) -> list[torch.Tensor]:
        """The rows written this step, per buffer, for the step-end transfer (in `resolve`'s order)."""
        out = []
        for device, buffers in self._buffers.items():
            used = self._used.get(device, 0)
            for i, buffer in enumerate(buffers):
                rows = min(self.slots, used - i * self.slots)
                if rows > 0:
                    out.append(buffer[:rows])
        return out

    def resolve(self, host_rows: list[torch.Tensor]) -> None:
        """Fill in the values of this step's handles from the transferred rows, then zero the device
        rows for the next step (asynchronous)."""
        by_buffer = {}
        views = self.device_buffers()
        for view, rows in zip(views, host_rows, strict=True):
            by_buffer[view.data_ptr()] = rows.tolist()
        for handle in self._pending:
            rows = by_buffer[handle.buffer.data_ptr()]
            handle.value = kfp.lanes_to_int(rows[handle.slot])
            handle.buffer = None
        self._pending = []
        for view in views:
            view.zero_()
        self._used = {}

    def now(self, t: torch.Tensor) -> int | None:
        """The fingerprint of `t` read back at once (verification, off the hot path)."""
        if not self._triton(t):
            return kfp.fingerprint_reference(t) if kfp.dense_bytes(t) is not None else None
        words = kfp.as_words(t)
        if words is None:
            return None
        out = torch.zeros(kfp.ROW, dtype=torch.int32, device=t.device)
        kfp.launch_one(words, out)
        return kfp.lanes_to_int(out.cpu())


class FingerprintRows:
    """Fingerprints of a list of tensors, each into its row of one device buffer (int32 [capacity,
    ROW]), read with the step's transfer and decoded by `values`. The state sensors fingerprint the
    same parameters, optimizer state and gradient buckets again and again: the launch's tables are
    built once per list of storages and reused, so a call is a zeroing and one launch (on the GPU; on
    the CPU the reference, at once).
    """

    CACHED = 64  # launch tables kept (a vote's slices, the update replay's)

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.rows = torch.zeros(capacity, kfp.ROW, dtype=torch.int32, device=device)
        self._launches: dict[tuple, tuple[kfp.Launch | None, list[bool]]] = {}

    def take(self, tensors: list[torch.Tensor | None]) -> list[bool]:
        """Fingerprint `tensors[i]` into row i, as they are now (ordered on the current stream); which
        rows hold one (None, and tensors the kernel cannot read in place, do not)."""
        rows = self.rows[: len(tensors)]
        rows.zero_()
        if not rows.is_cuda:
            written = set(kfp.fingerprint_into([(t, i) for i, t in enumerate(tensors) if t is not None], rows))
            return [i in written for i in range(len(tensors))]
        key = tuple((t.data_ptr(), t.shape, t.stride(), t.element_size()) if t is not None else None for t in tensors)
        cached = self._launches.get(key)
        if cached is None:
            words = [kfp.as_words(t) if t is not None else None for t in tensors]
            items = [(w, i) for i, w in enumerate(words) if w is not None]
            cached = (kfp.prepare_many(items, rows.device) if items else None, [w is not None for w in words])
            # a tensor copied to be read (an odd offset) is in the table for this launch only
            if all(w is None or w.base.data_ptr() == t.data_ptr() for w, t in zip(words, tensors, strict=True)):
                if len(self._launches) >= self.CACHED:
                    self._launches.pop(next(iter(self._launches)))
                self._launches[key] = cached
        launch, seen = cached
        if launch is not None:
            kfp.launch_prepared(launch, rows)
        return seen

    @staticmethod
    def values(host_rows: torch.Tensor, seen: list[bool]) -> list[int]:
        """The fingerprints (unsigned 64-bit) of the rows that hold one, 0 elsewhere."""
        flat = host_rows.tolist()
        return [kfp.lanes_to_int(flat[i]) if hit else 0 for i, hit in enumerate(seen)]
