"""The quarantine list: devices with confirmed SDC, one JSON object per line.

Written atomically — under an exclusive lock, the whole file is rewritten to a temporary file,
fsynced and renamed over the old one — so ranks sharing the file never interleave lines, and a
crash leaves either the old or the new list, never a torn one. Schedulers and health checks read
it to drain the named GPU (host + GPU UUID) before the next job lands on it.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def read_quarantine(path: str | os.PathLike) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        return []
    entries = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if line:
            entries.append(json.loads(line))
    return entries


def append_quarantine(path: str | os.PathLike, entries: Iterable[dict[str, Any]]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    new = [json.dumps(e, sort_keys=True) for e in entries]
    if not new:
        return
    with open(p.with_name(p.name + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            old = p.read_text() if p.exists() else ""
            if old and not old.endswith("\n"):
                old += "\n"
            tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
            with open(tmp, "w") as f:
                f.write(old + "\n".join(new) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
            dir_fd = os.open(p.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # make the rename itself durable
            finally:
                os.close(dir_fd)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
