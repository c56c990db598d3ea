"""Certified checkpoints: a checkpoint is certified when nothing the guard knows of can have corrupted it.

A checkpoint of step `s` holds the state after the updates of steps `< s` (`guard.step_number` when it
is saved, after the optimizer's step). It is **certified** when

- every vTask raised at a step `< s` is verified (none still pending),
- no confirmed SDC (nor a corruption pinned on no device) is open: none since the run began or since
  the last rollback, at a step `< s` — a `warn` policy lets a corrupted update land, and every later
  state carries it,
- and, where the replicas vote on their state, the vote that covers exactly this state (taken at the
  end of step `s`, read a step later) was judged without a finding.

Until all of it is known the certificate is **pending**; the guard decides it at a later step end, or
at `close()` — never silently: a certificate whose vote was never judged, or that an incident makes
unsafe, is **uncertified** with the reason. The certificate (step, verified-through step, 64-bit
fingerprints of every saved tensor, the run and the device) is written beside the checkpoint
(`<file>.aegis-certificate.json`, or `aegis-certificate.json` in a directory checkpoint) and
committed to the store; both are rewritten when the status changes. Only a certificate that says
`certified` names a state to restart from (`latest_certified`).

`save_checkpoint` writes the model, the optimizer, the RNG states, the step and the caller's own
state with `torch.save` into a temporary file, fsyncs it and renames it over the target: a process
killed meanwhile leaves the old checkpoint or the new one, never a torn one, and a certificate is
only ever written for a complete file. `load_checkpoint` reads it with `weights_only=True` (no
arbitrary unpickling) and checks the fingerprints against the certificate.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aegis_sdc.kernels.fingerprint import FUNCTION, fingerprint_reference
from aegis_sdc.response.files import write_atomically

CERTIFIED, PENDING, UNCERTIFIED = "certified", "pending", "uncertified"
CERTIFICATE_NAME = "aegis-certificate.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete, or not what its certificate says."""


@dataclass(frozen=True)
class Certificate:
    path: str  # the checkpoint: a file (torch.save) or a directory (torch.distributed.checkpoint)
    step: int  # the state after the updates of steps < step
    status: str  # certified | pending | uncertified
    reason: str  # why it is not certified (yet), "" when it is
    verified_through: int  # every vTask raised at a step <= this was verified when decided (-1: none)
    fingerprints: dict[str, str] = field(default_factory=dict)  # tensor name → 64-bit fingerprint, hex
    identity: dict[str, Any] = field(default_factory=dict)  # host, rank, device, GPU UUID
    run_dir: str = ""
    saved_by: str = "aegis"  # "aegis": guard.save_checkpoint's file; "caller": certified with guard.certify
    # the fingerprint function that made `fingerprints` (kernels/fingerprint.FUNCTION); certificates
    # written before the field existed hold function 1, and are checked with it
    fingerprint_function: int = FUNCTION
    created_wall: float = field(default_factory=time.time)
    decided_wall: float | None = None

    @property
    def certified(self) -> bool:
        return self.status == CERTIFIED

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Certificate:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{"fingerprint_function": 1, **{k: v for k, v in data.items() if k in known}})

    def decided(self, status: str, reason: str, verified_through: int) -> Certificate:
        return replace(self, status=status, reason=reason, verified_through=verified_through,
                       decided_wall=time.time())  # fmt: skip


def certificate_path(checkpoint: str | os.PathLike) -> Path:
    path = Path(checkpoint)
    return path / CERTIFICATE_NAME if path.is_dir() else path.with_name(path.name + ".aegis-certificate.json")


def _tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a nested state (dicts, lists, tuples), named by its path."""
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, Mapping):
        for key in sorted(state, key=str):
            yield from _tensors(state[key], f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(state, (list, tuple)):
        for i, item in enumerate(state):
            yield from _tensors(item, f"{prefix}.{i}" if prefix else str(i))


def fingerprints(state: Any, function: int = FUNCTION) -> dict[str, str]:
    """64-bit fingerprints of every tensor of `state` (kernels/fingerprint.py), by name; a save is
    rare, so the host's reference computation on a CPU copy is good enough."""
    return {name: f"{fingerprint_reference(t.detach().cpu().contiguous(), function) & (2**64 - 1):016x}"
            for name, t in _tensors(state)}  # fmt: skip


def write_certificate(certificate: Certificate) -> None:
    text = json.dumps(certificate.to_dict(), indent=1, sort_keys=True).encode()
    write_atomically(certificate_path(certificate.path), lambda f: f.write(text))


def read_certificate(checkpoint: str | os.PathLike) -> Certificate | None:
    """The certificate beside `checkpoint` (None: it has none); CheckpointError for a file that is not
    one — unreadable JSON, or fields a certificate cannot hold (an edited status, a step that is no
    int, fingerprints that are no table of names)."""
    path = certificate_path(checkpoint)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: not a certificate ({error})") from error
    problem = _certificate_problem(data)
    if problem is not None:
        raise CheckpointError(f"{path}: not a certificate ({problem})")
    return Certificate.from_dict(data)


def _certificate_problem(data: Any) -> str | None:
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    for name in ("path", "step", "status", "reason", "verified_through"):
        if name not in data:
            return f"no {name!r}"
    if data["status"] not in (CERTIFIED, PENDING, UNCERTIFIED):
        return f"status {data['status']!r}"
    for name in ("step", "verified_through"):
        if type(data[name]) is not int:
            return f"{name} {data[name]!r} is not an int"
    fingerprints = data.get("fingerprints", {})
    if not isinstance(fingerprints, dict) or not all(isinstance(v, str) for v in fingerprints.values()):
        return "fingerprints are not a table of tensor names to hex values"
    return None


def rng_states() -> dict[str, Any]:
    """The generators a training step draws from: torch (CPU and every CUDA device), numpy, random."""
    states: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    # numpy's and random's states as tensors and ints: loadable with weights_only=True
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states["numpy"] = {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached": float(cached), "kind": str(kind)}  # fmt: skip
    version, inner, gauss = random.getstate()
    states["random"] = {"version": int(version), "inner": torch.tensor(inner, dtype=torch.int64),
                        "gauss": None if gauss is None else float(gauss)}  # fmt: skip
    return states


def set_rng_states(states: Mapping[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    n = states["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    r = states["random"]
    random.setstate((r["version"], tuple(int(v) for v in r["inner"].tolist()), r["gauss"]))


def save_state(path: str | os.PathLike, state: Mapping[str, Any]) -> None:
    """`torch.save(state)` atomically (see the module's docstring)."""
    write_atomically(Path(path), lambda f: torch.save(dict(state), f))


def load_state(path: str | os.PathLike, *, verify: bool = True) -> dict[str, Any]:
    """A checkpoint written by `save_state` (tensors and plain data only: `weights_only=True`); with
    `verify`, its tensors must match its certificate's fingerprints when it has one."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:
        raise CheckpointError(f"{path}: not a readable checkpoint ({error})") from error
    certificate = read_certificate(path) if verify else None
    if certificate is not None:  # an emptied fingerprint table names no tensor: every tensor is "missing"
        _check_fingerprints(path, certificate, state)
    return state


def _check_fingerprints(checkpoint: str | os.PathLike, certificate: Certificate, state: Any) -> None:
    """CheckpointError naming what differs when `state`'s tensors are not those `certificate` names."""
    try:
        found = fingerprints(state, int(certificate.fingerprint_function))
    except ValueError as error:  # a certificate from a newer aegis
        raise CheckpointError(f"{checkpoint}: its certificate cannot be checked here ({error})") from None
    wrong = sorted(name for name, value in certificate.fingerprints.items() if found.get(name) != value)
    missing = sorted(set(certificate.fingerprints) ^ set(found))
    if wrong or missing:
        raise CheckpointError(
            f"{checkpoint} does not match its certificate: {len(wrong)} tensor(s) differ (e.g. {wrong[:3]}), "
            f"{len(missing)} name(s) not in both (e.g. {missing[:3]})"
        )


def verify_state(checkpoint: str | os.PathLike, state: Any) -> None:
    """Check a state the caller loaded from `checkpoint` (e.g. with torch.distributed.checkpoint.load)
    against the checkpoint's certificate: CheckpointError when there is none, it is not certified, or a
    tensor differs from what was certified."""
    certificate = read_certificate(checkpoint)
    if certificate is None:
        raise CheckpointError(f"{checkpoint} has no certificate")
    if not certificate.certified:
        raise CheckpointError(f"{checkpoint} is {certificate.status}: {certificate.reason}")
    _check_fingerprints(checkpoint, certificate, state)


def latest_certified(certificates: list[Certificate]) -> Certificate | None:
    """The certified checkpoint of the highest step whose file is still there."""
    usable = [c for c in certificates if c.certified and Path(c.path).exists()]
    return max(usable, key=lambda c: (c.step, c.created_wall), default=None)
