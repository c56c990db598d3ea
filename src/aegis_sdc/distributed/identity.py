"""Rank identity: which host, rank and GPU a record comes from."""

from __future__ import annotations

import os
import socket

import torch

from aegis_sdc.events import RankIdentity


def gpu_uuid(device: torch.device) -> str | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


def discover(device: torch.device | str = "cpu") -> RankIdentity:
    """Identity of this process: torch.distributed if initialized, else torchrun's environment."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return RankIdentity(
        host=socket.gethostname(),
        rank=rank,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        world_size=world,
        device=str(device),
        gpu_uuid=gpu_uuid(device),
    )
