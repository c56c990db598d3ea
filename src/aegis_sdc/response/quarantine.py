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
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from aegis_sdc.response.files import write_atomically

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


def read_quarantine(path: str | os.PathLike, skipped: list[int] | None = None) -> list[dict[str, Any]]:
    """Every entry of the list. Lines that are not JSON objects are skipped — a list edited by hand,
    or a line torn by a full disk, must not hide the entries around it — and their numbers (from 1)
    appended to `skipped` when given, for the caller to name."""
    text = _read_text_nofollow(Path(path))
    entries = []
    for number, line in enumerate((text or "").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        if isinstance(entry, dict):
            entries.append(entry)
        elif skipped is not None:
            skipped.append(number)
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
        text = (old + "\n".join(new) + "\n").encode()
        # the rename replaces a link planted at `p` itself, never its target
        write_atomically(p, lambda f: f.write(text))
    finally:
        os.close(lock_fd)  # releases the lock


def _remove_orphans(path: Path) -> None:
    """Temporary files of writers killed mid-write (only writers holding the lock make them)."""
    for orphan in path.parent.glob(f".{path.name}.*.tmp"):
        with contextlib.suppress(OSError):
            orphan.unlink()


# -- what a scheduler consumes: the devices to drain, as JSON, a Slurm exclude list or kubectl commands ----

# A host name printed into a line a shell or a scheduler parses: letters, digits, '.', '-', '_', and a
# letter or digit first (a leading '-' would read as an option). Anything else is refused, never printed.
_SAFE_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
# A Kubernetes label (and taint) value: at most 63 characters of [A-Za-z0-9._-], alphanumeric at both ends.
_LABEL_VALUE_MAX = 63
TAINT_KEY = "aegis-sdc/sdc"
LABEL_KEY = "aegis-sdc/quarantined"


class UnsafeHostError(ValueError):
    """A host name that may not be printed into a scheduler's command line."""

    def __init__(self, hosts: list[Any]) -> None:
        super().__init__(f"{len(hosts)} host name(s) outside [A-Za-z0-9._-]")
        self.hosts = hosts


def _step_order(value: Any) -> tuple:
    """A sort key for a step of any type (a hand-written list may hold anything): numbers first."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, value)
    return (1, str(value))


def scheduler_devices(
    entries: Iterable[dict[str, Any]], incident_records: Iterable[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The devices to drain: the union of the quarantine list's `entries` and the devices of the
    stores' `incident_records` (`read_incidents` rows), one per `device_key`, ordered by their first
    incident's step. Each holds the device's identity (host, gpu_uuid, device, rank, local_rank), its
    first incident (step, site, incident_id), `incidents` (the distinct incidents known of it, by rank
    and incident id, in the stores or the list) and `listed` (whether the list names it: False for a
    device whose incident was committed but whose list entry was never written)."""
    devices: dict[tuple[str, str], dict[str, Any]] = {}
    seen: dict[tuple[str, str], set[tuple[str, str]]] = {}

    def add(source: dict[str, Any], listed: bool, index: int) -> None:
        key = device_key(source)
        incident_id = source.get("incident_id") if listed else source.get("id")
        ident = (str(source.get("rank")), str(incident_id)) if incident_id is not None else ("list", str(index))
        first = {"step": source.get("step"), "site": source.get("site"), "incident_id": incident_id}
        device = devices.get(key)
        if device is None:
            device = devices[key] = {
                "host": source.get("host"),
                "gpu_uuid": source.get("gpu_uuid"),
                "device": source.get("device"),
                "rank": source.get("rank"),
                "local_rank": source.get("local_rank"),
                **first,
                "incidents": 0,
                "listed": False,
            }
            seen[key] = set()
        elif _step_order(first["step"]) < _step_order(device["step"]):
            device.update(first)
        device["listed"] = device["listed"] or listed
        if ident not in seen[key]:
            seen[key].add(ident)
            device["incidents"] += 1

    for index, entry in enumerate(entries):
        add(entry, True, index)
    for record in incident_records:
        add(record, False, 0)
    return sorted(devices.values(), key=lambda d: (_step_order(d["step"]), str(d["host"]), str(d["device"])))


def scheduler_hosts(devices: Iterable[dict[str, Any]]) -> list[Any]:
    """The distinct hosts of `devices`, as stored (not validated), sorted by their text."""
    hosts: dict[str, Any] = {}
    for device in devices:
        hosts.setdefault(str(device["host"]), device["host"])
    return [hosts[name] for name in sorted(hosts)]


def is_safe_host(host: object) -> bool:
    """Whether `host` may be printed into a scheduler's or a shell's command line."""
    return isinstance(host, str) and _SAFE_HOST.fullmatch(host) is not None


def split_unsafe(devices: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """`devices` on hosts with safe names, and the unsafe host names (distinct) of the others."""
    safe, unsafe = [], []
    for device in devices:
        if is_safe_host(device["host"]):
            safe.append(device)
        elif device["host"] not in unsafe:
            unsafe.append(device["host"])
    return safe, unsafe


def _checked_hosts(devices: Iterable[dict[str, Any]]) -> list[str]:
    devices = list(devices)
    _, unsafe = split_unsafe(devices)
    if unsafe:
        raise UnsafeHostError(unsafe)
    return scheduler_hosts(devices)


def slurm_exclude(devices: Iterable[dict[str, Any]]) -> str:
    """The hosts of `devices` joined by commas, what `sbatch --exclude=` and `scontrol update
    NodeName=... State=DRAIN` take ("" for none). Raises `UnsafeHostError` for an unsafe host name."""
    return ",".join(_checked_hosts(devices))


def label_value(text: object) -> str:
    """`text` as a Kubernetes label value: characters outside [A-Za-z0-9._-] become '-', at most 63
    characters, a letter or digit at both ends ('cuda:0' → 'cuda-0'); "unknown" when nothing is left."""
    value = re.sub(r"[^A-Za-z0-9._-]", "-", str(text))[:_LABEL_VALUE_MAX]
    value = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)
    return value or "unknown"


def k8s_commands(devices: Iterable[dict[str, Any]]) -> list[str]:
    """For each host of `devices`, a `kubectl taint` (NoSchedule, valued by the GPU UUID, else the
    device string, of its first quarantined device) and a `kubectl label` command. A taint's key holds
    one value per node: a node with several quarantined GPUs is tainted once. Raises
    `UnsafeHostError` for an unsafe host name."""
    devices = list(devices)
    hosts = _checked_hosts(devices)
    first: dict[str, dict[str, Any]] = {}
    for device in devices:  # ordered by first step: the first device of each host
        first.setdefault(device["host"], device)
    lines = []
    for host in hosts:
        gpu = label_value(first[host]["gpu_uuid"] or first[host]["device"] or "")
        lines.append(f"kubectl taint nodes {host} {TAINT_KEY}={gpu}:NoSchedule --overwrite")
        lines.append(f"kubectl label nodes {host} {LABEL_KEY}=true --overwrite")
    return lines
