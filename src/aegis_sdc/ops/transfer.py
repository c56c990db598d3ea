"""The step's one device-to-host transfer: many small tensors of any dtypes, one copy per device."""

from __future__ import annotations

import torch


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of `tensors`, in order. Device tensors travel as one byte buffer per device (one
    copy, hence one wait for the device, per step); CPU tensors are returned as they are."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.device.type == "cpu":
            out[i] = t
        else:
            by_device.setdefault(t.device, []).append(i)
    for indexes in by_device.values():
        parts = [tensors[i].contiguous().reshape(-1).view(torch.uint8) for i in indexes]
        host = torch.cat(parts).cpu()
        offset = 0
        for i, part in zip(indexes, parts, strict=True):
            t = tensors[i]
            out[i] = host[offset : offset + part.numel()].view(t.dtype).reshape(t.shape)
            offset += part.numel()
    return out  # type: ignore[return-value]
