"""`aegis replay`: re-execute an incident's evidence on a device and say what the device computes.

The stored tile is recomputed `times` times by the code that computed it in training, with the same
tile configuration and numerics (kernels/numerics.py, `exact_fp32`): the reference path through
`kernels.reference.replay_region`, the Triton path through `TritonGemmCapture.replay` (the same
kernel launch as the verifier's). Each run is compared bit for bit with the stored values:

    right   the values the verifier established as correct (where the verdict knows none — a fault
            every execution reproduced, or three executions that all differed — a result that is not
            the wrong one and lies within the exact fp32 error bound of an fp64 recomputation)
    wrong   the values the faulty execution produced
    other   anything else (a different corruption, or a device whose arithmetic differs: the bits
            are only comparable on the kind of device, and BLAS, that recorded them)

A clean sample (``"clean": true``: a tile of a clean check, response/evidence.py) stores right
values only: a run is right when it reproduces them bit for bit, and other otherwise.

Exit status: 0 every run right (this device computes the evidence correctly); 3 some run reproduced
the wrong values and every other run was right (the device is faulty); 4 some run computed
something else; 2 the evidence could not be read or replayed here.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from aegis_sdc.events import Tile
from aegis_sdc.faults.models import AccumulatorFault, FaultSpec, resolve
from aegis_sdc.kernels.numerics import exact_fp32
from aegis_sdc.kernels.reference import RegionReplay, Tiling, exact_violations, replay_region
from aegis_sdc.ops.gemm_replay import diff_regions
from aegis_sdc.response.evidence import (
    REFERENCE,
    REFERENCE_FIELDS,
    TRITON,
    TRITON_FIELDS,
    EvidenceError,
    EvidenceFile,
    load_evidence,
)

RIGHT, WRONG, OTHER = "right", "wrong", "other"
EXIT_RIGHT, EXIT_ERROR, EXIT_WRONG, EXIT_OTHER = 0, 2, 3, 4


@dataclass
class ReplayReport:
    """What `times` re-executions of one evidence file computed on one device."""

    evidence: Path
    site: str
    step: int
    device: str
    recorded_on: str  # the device the incident was recorded on
    right_by: str  # "bits": compared with stored right values; "bound": the fp64 error bound (none stored)
    runs: list[str] = field(default_factory=list)  # RIGHT / WRONG / OTHER per run
    clean: bool = False  # a clean sample: right values only

    @property
    def exit_code(self) -> int:
        if all(r == RIGHT for r in self.runs):
            return EXIT_RIGHT
        return EXIT_OTHER if OTHER in self.runs else EXIT_WRONG

    @property
    def outcome(self) -> str:
        return {EXIT_RIGHT: "healthy", EXIT_WRONG: "faulty", EXIT_OTHER: "unstable or different"}[self.exit_code]

    def to_dict(self) -> dict[str, Any]:
        return {"evidence": str(self.evidence), "site": self.site, "step": self.step, "device": self.device,
                "recorded_on": self.recorded_on, "right_by": self.right_by, "runs": self.runs,
                "outcome": self.outcome, "exit_code": self.exit_code, "clean": self.clean}  # fmt: skip


def replay_evidence(
    path: str | Path,
    device: str | torch.device = "cpu",
    times: int = 3,
    fault: FaultSpec | AccumulatorFault | None = None,
) -> ReplayReport:
    """Re-execute the evidence at `path` (its JSON or tensor file) `times` times on `device`.

    `fault` models a faulty device in tests: applied to every run, at the element the fault drew in
    training (a FaultSpec is resolved from the evidence's site, step and call as the injector does;
    a perturb spec with a median difference of 1). EvidenceError when the file cannot be used here.
    """
    if times < 1:
        raise ValueError(f"times must be >= 1, got {times}")
    loaded = load_evidence(path)
    meta = loaded.meta
    if not meta.get("replayable"):
        raise EvidenceError(f"{loaded.path}: not replayable: {meta.get('reason')}")
    device = torch.device(device)
    try:
        gemm = meta["gemm"]
        accumulator = _resolve(fault, meta)
        clean = meta.get("clean") is True
        if gemm["path"] == TRITON:
            replay = _triton(loaded, gemm, device, accumulator, clean)
        elif gemm["path"] == REFERENCE:
            replay = _reference(loaded, gemm, device, accumulator, clean)
        else:
            raise EvidenceError(f"{loaded.path}: unknown GEMM path {gemm['path']!r}")
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise EvidenceError(f"{loaded.path}: incomplete evidence ({type(error).__name__}: {error})") from None
    identity = (meta.get("incident") or meta).get("identity") or {}  # a clean sample has no incident
    report = ReplayReport(
        loaded.path, str(meta.get("site")), int(meta.get("step", -1)), str(device), str(identity.get("device")),
        "bits" if replay.right else "bound", clean=meta.get("clean") is True,
    )  # fmt: skip
    with exact_fp32(device.type):
        for _ in range(times):
            report.runs.append(replay.judge(replay.run()))
    return report


def _resolve(fault: FaultSpec | AccumulatorFault | None, meta: dict) -> AccumulatorFault | None:
    if isinstance(fault, FaultSpec):  # drawn as the injector drew it: from (site id, step, call)
        evidence = meta if meta.get("clean") is True else meta["incident"]["evidence"]
        return resolve(fault, int(meta["site_id"]), int(evidence["step"]), int(evidence["call"]), 1.0)
    return fault


@dataclass
class _Replay:
    """One stored computation: `run()` recomputes it, `judge()` names what a run computed."""

    run: Any
    same: Any  # (x, y) → bit-identical
    within_bound: Any  # result → no value outside the exact fp32 error bound
    wrong: Any | None  # None: a clean sample (right values only)
    right: Any | None

    def judge(self, result: Any) -> str:
        if self.wrong is not None and self.same(result, self.wrong):
            return WRONG
        if self.right is not None:
            return RIGHT if self.same(result, self.right) else OTHER
        return RIGHT if self.within_bound(result) else OTHER


def _group(tensors: dict[str, torch.Tensor], prefix: str, names: tuple[str, ...], device) -> dict | None:
    if f"{prefix}.{names[0]}" not in tensors:
        return None
    return {name: tensors[f"{prefix}.{name}"].to(device) for name in names}


def _stored(t: dict, fields: Sequence[str], device: torch.device, make: Callable[..., Any],
            clean: bool) -> tuple[Any | None, Any | None, Any]:  # fmt: skip
    """The stored wrong and right values (`make(**fields)` each, None where absent) and the one a
    replay's layout follows: an incident stores wrong values (and right ones where known), a clean
    sample right ones only."""

    def values(kind: str) -> Any | None:
        found = _group(t, kind, fields, device)
        return None if found is None else make(**found)

    wrong, right = values("wrong"), values("right")
    if clean and (right is None or wrong is not None):
        raise ValueError("a clean sample stores right values and no wrong ones")
    if not clean and wrong is None:
        raise ValueError("no wrong values stored")
    return wrong, right, wrong if wrong is not None else right


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _reference(loaded: EvidenceFile, gemm: dict, device: torch.device, fault: AccumulatorFault | None,
               clean: bool = False) -> _Replay:  # fmt: skip
    """The reference path: A [R, K] × B [K, C] of one tile (or region), B·1 [K] as the step used it."""
    t = loaded.tensors
    a, b, b_rowsum = t["a"].to(device), t["b"].to(device), t["b_rowsum"].to(device)
    bias = t["bias"].to(device) if "bias" in t else None
    tiling = Tiling(int(gemm["tiling"]["rows"]), int(gemm["tiling"]["cols"]))
    out_dtype = _dtype(gemm["out_dtype"])
    tile = gemm["region"]
    fault_at = None
    if fault is not None:
        row, col = fault.element(int(gemm["shape"]["m"]), int(gemm["shape"]["n"]))
        fault_at = (row - tile["row_start"], col - tile["col_start"])  # outside the tile: never applied

    wrong, right, stored = _stored(t, REFERENCE_FIELDS, device, functools.partial(RegionReplay, b_rowsum=b_rowsum),
                                   clean)  # fmt: skip
    region_tile = _tile(tile)

    def run() -> RegionReplay:
        result = replay_region(a, b, out_dtype=out_dtype, bias=bias, tiling=tiling, b_rowsum=b_rowsum,
                               fault=fault, fault_at=fault_at)  # fmt: skip
        if not stored.col_partials.numel():
            result.col_partials = stored.col_partials  # the training step took no column checksums
        return result

    def within_bound(r: RegionReplay) -> bool:
        return not exact_violations(a, b, bias=bias, out=r.out, row_partials=r.row_partials, tiling=tiling)

    return _Replay(run, lambda x, y: diff_regions(x, y, tiling, region_tile).equal, within_bound, wrong, right)


def _tile(d: dict) -> Tile:
    return Tile(int(d["row_start"]), int(d["row_stop"]), int(d["col_start"]), int(d["col_stop"]))


def _triton(loaded: EvidenceFile, gemm: dict, device: torch.device, fault: AccumulatorFault | None,
            clean: bool = False) -> _Replay:  # fmt: skip
    """The Triton path: the kernel relaunched on the stored slabs with the stored tile configuration."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise EvidenceError(f"{loaded.path}: Triton evidence replays on a CUDA device (or under TRITON_INTERPRET=1)")
    import dataclasses

    from aegis_sdc.kernels import triton_gemm as tg
    from aegis_sdc.kernels.gemm_side import SideMatrix
    from aegis_sdc.ops.triton_linear import _fault_args
    from aegis_sdc.ops.triton_replay import TritonGemmCall, TritonGemmCapture, TritonRegion

    t = {name: value.to(device) for name, value in loaded.tensors.items()}
    shape = gemm["shape"]
    m, n, k = int(shape["m"]), int(shape["n"]), int(shape["k"])
    cvec = t["cvec"]

    def side(name: str, vec: torch.Tensor | None) -> SideMatrix | None:
        key = f"{name}.matrix"
        return None if key not in t or vec is None else SideMatrix(vec, t[key], t[f"{name}.scale"])

    u1 = t.get("u1")
    fault_args = None
    if fault is not None:
        row, col = fault.element(m, n)
        fault_args = _fault_args(dataclasses.replace(fault, row=row, col=col))
    extent = gemm["extent"]
    call = TritonGemmCall(
        a_t=bool(gemm["a_t"]), b_t=bool(gemm["b_t"]), m=m, n=n, k=k, dtype=_dtype(gemm["out_dtype"]),
        cfg=tg.TritonGemmConfig(**gemm["config"]),
        capture_kind=tg.CAPTURE_TILE if extent == "tile" else tg.CAPTURE_ROWS,
        b=t.get("b"), bias=t.get("bias"), cvec=cvec, u1=u1, pool=None, fault=fault_args,
        c_side=side("c_side", cvec), u_side=side("u_side", u1),
    )  # fmt: skip

    wrong, right, stored = _stored(t, TRITON_FIELDS, device, functools.partial(TritonRegion, b_rowsum=cvec), clean)
    cap = TritonGemmCapture.restore(call, extent, t["a_slab"], t.get("b_slab"), stored, int(gemm["row_block"]),
                                    int(gemm["col_block"]))  # fmt: skip

    def within_bound(r: TritonRegion) -> bool:
        saved, cap.saved = cap.saved, r
        try:
            return not cap.exact_violations()
        finally:
            cap.saved = saved

    return _Replay(cap.replay, lambda x, y: cap.diff(x, y).equal, within_bound, wrong, right)
