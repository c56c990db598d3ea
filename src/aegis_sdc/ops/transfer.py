"""The step's one device-to-host transfer: many small tensors of any dtypes, one copy per device.

`start_to_host` packs the device tensors of each device into one byte buffer and copies it into
pinned host memory without waiting; `PendingTransfer.wait()` waits for that copy alone (an event
recorded after it), so the GPU keeps running whatever was queued behind it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PendingTransfer:
    tensors: list[torch.Tensor]
    # per device: (indexes into tensors, pinned host bytes, the event after the copy)
    copies: list[tuple[list[int], torch.Tensor, torch.cuda.Event | None]] = field(default_factory=list)
    _done: list[torch.Tensor] | None = None

    def wait(self) -> list[torch.Tensor]:
        """CPU copies of the tensors, in order (CPU tensors are returned as they are)."""
        if self._done is not None:
            return self._done
        out: list[torch.Tensor] = list(self.tensors)
        for indexes, host, event in self.copies:
            if event is not None:
                event.synchronize()
            offset = 0
            for i in indexes:
                t = self.tensors[i]
                size = t.numel() * t.element_size()
                out[i] = host[offset : offset + size].view(t.dtype).reshape(t.shape)
                offset += size
        self._done, self.tensors, self.copies = out, [], []
        return out


def start_to_host(tensors: list[torch.Tensor]) -> PendingTransfer:
    """Begin copying `tensors` to the host (see the module docstring); nothing waits here."""
    pending = PendingTransfer(list(tensors))
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.device.type != "cpu":
            by_device.setdefault(t.device, []).append(i)
    for device, indexes in by_device.items():
        packed = torch.cat([tensors[i].contiguous().reshape(-1).view(torch.uint8) for i in indexes])
        if device.type == "cuda":
            host = torch.empty(packed.numel(), dtype=torch.uint8, pin_memory=True)  # the caching host allocator
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:  # other accelerators: a plain (waiting) copy
            host, event = packed.cpu(), None
        pending.copies.append((indexes, host, event))
    return pending
