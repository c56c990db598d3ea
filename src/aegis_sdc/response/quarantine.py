"""The quarantine list: devices with confirmed SDC, one JSON object per line.

Written atomically — under an exclusive lock, the whole file is rewritten to a temporary file,
fsynced and renamed over the old one — so ranks sharing the file never interleave lines, and a
crash leaves either the old or the new list, never a torn one. Schedulers and health checks read
it to drain the named GPU (host + GPU UUID) before the next job lands on it.

The directory may be shared and writable by others (a cluster's common scratch): nothing here
follows a symbolic link. The lock file and the list are opened with `O_NOFOLLOW`, and the temporary
file is created with `O_CREAT | O_EXCL | O_NOFOLLOW` under a name nobody can predict, so a link
planted beside the list can neither be written through nor read from. Temporary files are only ever
written under the lock, so one found while holding it was left by a process killed mid-write: it
is removed.

The list is a view of the store, which is committed first: when a guard opens a run directory
again, the devices of committed incidents the list does not name (a process killed between the two
writes) are appended (response/policies.Responder).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _read_text_nofollow(path: Path) -> str | None:
    """The file's text, or None when it does not exist; a symbolic link is refused (OSError ELOOP)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "r", encoding="utf-8", errors="replace") as f:
        return f.read()


def read_quarantine(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every entry of the list (lines that are not JSON objects are skipped: a list edited by hand
    must not hide the entries around a bad line)."""
    text = _read_text_nofollow(Path(path))
    entries = []
    for line in (text or "").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def device_key(entry: dict[str, Any]) -> tuple[str, str]:
    """What names one device in a cluster: its host and its GPU UUID (else its device string)."""
    return (str(entry.get("host")), str(entry.get("gpu_uuid") or entry.get("device")))


def quarantine_entry(record: dict[str, Any]) -> dict[str, Any]:
    """The list's line for a confirmed incident, from its record (`Incident.to_dict()`, as stored)."""
    who = record["identity"]
    wrong = record["verdict"].get("wrong_execution")
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record["created_wall"])),
        "host": who["host"],
        "rank": who["rank"],
        "local_rank": who["local_rank"],
        "device": who["device"],
        "gpu_uuid": who.get("gpu_uuid"),
        "site": record["site"],
        "step": record["step"],
        "incident_id": record["id"],
        "reason": f"confirmed SDC (wrong execution: {wrong or '?'})",
    }


def append_quarantine(path: str | os.PathLike, entries: Iterable[dict[str, Any]]) -> None:
    """Append `entries` atomically (see the module's docstring). Raises OSError when the list cannot
    be written (disk full, no permission, a symbolic link in the way): the caller decides."""
    p = Path(path)
    new = [json.dumps(e, sort_keys=True) for e in entries]
    if not new:
        return
    p.parent.mkdir(parents=True, exist_ok=True)
    lock_fd = os.open(p.with_name(p.name + ".lock"), os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        _remove_orphans(p)
        old = _read_text_nofollow(p) or ""
        if old and not old.endswith("\n"):
            old += "\n"
        tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(old + "\n".join(new) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)  # replaces a link planted at `p` itself, never its target
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        dir_fd = os.open(p.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
    finally:
        os.close(lock_fd)  # releases the lock


def _remove_orphans(path: Path) -> None:
    """Temporary files of writers killed mid-write (only writers holding the lock make them)."""
    for orphan in path.parent.glob(f".{path.name}.*.tmp"):
        with contextlib.suppress(OSError):
            orphan.unlink()
