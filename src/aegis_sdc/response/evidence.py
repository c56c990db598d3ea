"""Evidence files: the minimal replay context of a confirmed incident, replayable on any machine.

Each incident of a run writes two files to ``RUN_DIR/evidence/``:

    incident-<rank>-<id>.safetensors   the tensors (safetensors: no pickle, no code on load)
    incident-<rank>-<id>.json          what they are: the incident, the GEMM's shape, dtypes and
                                       tile configuration, which stored values are wrong and right,
                                       the name and sha256 of the tensor file

A GEMM incident is cropped to one tile of its GEMM where the verdict names one (the replay
recomputes every tile of a region on its own, so one tile's bits do not depend on the others):
A's row block and B's column block (copied: B is the weight, which the optimizer changes next),
the reference vector B·1 the step used, and the tile's values twice, as the wrong execution and
(where the verdict knows it) the right one computed them. Other incident kinds write the JSON only,
with ``"replayable": false`` and the reason. Writing happens at the step end that confirmed the
incident, before the response policy acts, and never raises into training (a failure is logged).
The tensor file is renamed into place before the JSON: a JSON found names a complete tensor file.

Clean samples (sensors/gemm.py, `CleanSampler`) are written in the same format as

    clean-<rank>-<site_id>-<step>.safetensors / .json

with ``"clean": true``, no incident, and right values only: one tile as the training step computed
it, which a replay on the spot reproduced before it was written (a tile the replay does not
reproduce is not a reference for anything: logged, not written). The JSON names the kind of device
and software that computed them (`recorded_env`, as `aegis screen` describes a device), since only
the same kind reproduces them bit for bit. They have a budget of their own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from aegis_sdc.events import (
    AttentionKind,
    CommKind,
    FingerprintKind,
    Incident,
    RankIdentity,
    Site,
    StateKind,
    Tile,
    WrongExecution,
)
from aegis_sdc.kernels.reference import RegionReplay
from aegis_sdc.ops.gemm_replay import GemmCapture
from aegis_sdc.response.files import write_atomically
from aegis_sdc.verify.verifier import KeptReplay

log = logging.getLogger("aegis_sdc")

FORMAT = "aegis-sdc-evidence"
VERSION = 1
EVIDENCE_DIR = "evidence"
REFERENCE, TRITON = "gemm-reference", "gemm-triton"
REFERENCE_FIELDS = ("out", "row_partials", "col_partials", "row_ref")  # kernels.reference.RegionReplay
TRITON_FIELDS = ("row_part", "out_part", "ref_part", "col_part", "colref_part")  # ops.triton_replay.TritonRegion
NUMERICS = "kernels.numerics.exact_fp32: autocast off, fp32 matmuls in full IEEE precision"

# Why the other incident kinds write no tensors: their verdicts compare executions no single device
# can redo alone, or their contexts hold state the step has moved past.
NOT_REPLAYABLE = {
    CommKind: "a collective's result is the work of several devices: there is no one-device computation to replay",
    FingerprintKind: "a fingerprint mismatch compares two executions of a segment whose inputs are not kept",
    AttentionKind: "attention heads are replayed by the verifier only; their contexts are not written yet",
    StateKind: "state votes, update replays and peer replays compare state across ranks or steps, not one computation",
}


class EvidenceError(Exception):
    """An evidence file that cannot be used: missing, truncated, tampered with, or not ours."""


@dataclass
class EvidenceFile:
    """A loaded evidence pair: the JSON metadata and the tensors (on the CPU)."""

    path: Path  # the JSON
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def evidence_paths(run_dir: str | Path, rank: int, incident_id: int) -> tuple[Path, Path]:
    """(JSON, safetensors) of one incident."""
    stem = Path(run_dir) / EVIDENCE_DIR / f"incident-{rank}-{incident_id}"
    return stem.with_suffix(".json"), stem.with_suffix(".safetensors")


def clean_paths(run_dir: str | Path, rank: int, site_id: int, step: int) -> tuple[Path, Path]:
    """(JSON, safetensors) of one clean sample."""
    stem = Path(run_dir) / EVIDENCE_DIR / f"clean-{rank}-{site_id}-{step}"
    return stem.with_suffix(".json"), stem.with_suffix(".safetensors")


@dataclass
class CleanSample:
    """A clean checked call's tile, as the sensor captured it (extent "tile": nothing referenced)."""

    site: Site
    step: int
    call: int
    identity: RankIdentity
    capture: GemmCapture


# -- writing ---------------------------------------------------------------------------------------


# Evidence pairs one guard writes at most: a storm of incidents (a device failing every step) must not
# fill the disk — the first thousand say what the device does, and the store has every incident.
MAX_EVIDENCE_FILES = 1000


@dataclass
class EvidenceBudget:
    """What one guard wrote, let go past `limit`, and failed to write."""

    limit: int = field(default_factory=lambda: MAX_EVIDENCE_FILES)  # read at construction
    written: int = 0
    skipped: int = 0
    failed: int = 0
    unreproduced: int = 0  # clean samples a replay on the spot did not reproduce (not written)


def _within(budget: EvidenceBudget, what: str, past_limit: str, write: Callable[[], Path | None]) -> Path | None:
    """`write()` if the budget allows; its path, or None (past the budget, said once; or a failure,
    logged: this runs inside the training step and must never end it)."""
    if budget.written >= budget.limit:
        budget.skipped += 1
        if budget.skipped == 1:
            log.warning("aegis-sdc: %d %s written; %s", budget.written, what, past_limit)
        return None
    try:
        written = write()
    except Exception:  # a full disk, an unexpected context: logged (the first in full), training goes on
        budget.failed += 1
        if budget.failed == 1:
            log.exception("aegis-sdc: one of the %s could not be written", what)
        elif budget.failed % 100 == 0:
            log.error("aegis-sdc: %d %s could not be written", budget.failed, what)
        return None
    if written is not None:
        budget.written += 1
    return written


def write_incident_evidence(run_dir: str | Path, incident: Incident, kept: KeptReplay | None,
                            budget: EvidenceBudget | None = None) -> Path | None:  # fmt: skip
    """Write the incident's evidence pair; the JSON's path, or None when it was not written (past the
    budget, said once; or a failure, logged: this runs inside the training step and must never end it)."""

    def write() -> Path:
        meta, tensors = describe(incident, kept)
        json_path, tensor_path = evidence_paths(run_dir, incident.identity.rank, incident.id)
        written = _write_pair(json_path, tensor_path, f"{incident.identity.rank}-{incident.id}", meta, tensors)
        log.info("aegis-sdc: evidence of incident %s written to %s", incident.id, written)
        return written

    budget = budget if budget is not None else EvidenceBudget()
    return _within(budget, "evidence files", "later incidents keep theirs in the store only", write)


def write_clean_evidence(run_dir: str | Path, sample: CleanSample, budget: EvidenceBudget | None = None) -> Path | None:
    """Write a clean sample's evidence pair after a replay on the spot reproduced its tile; the JSON's
    path, or None (past the budget, not reproduced, or a failure: logged, never raised)."""

    def write() -> Path | None:
        cap = sample.capture
        if not cap.diff(cap.saved, cap.replay()).equal:
            budget.unreproduced += 1
            log.warning("aegis-sdc: the clean sample of %s at step %d was not reproduced by a replay on the spot: "
                        "not written", sample.site.name, sample.step)  # fmt: skip
            return None
        meta, tensors = describe_clean(sample)
        json_path, tensor_path = clean_paths(run_dir, sample.identity.rank, sample.site.id, sample.step)
        written = _write_pair(json_path, tensor_path, json_path.stem, meta, tensors)
        log.debug("aegis-sdc: clean sample of %s at step %d written to %s", sample.site.name, sample.step, written)
        return written

    budget = budget if budget is not None else EvidenceBudget()
    return _within(budget, "clean samples", "no more are taken", write)


def recording_env(cap: GemmCapture) -> dict[str, Any]:
    """The kind of device and software that computed a reference-path capture, as `aegis screen`
    describes the device it screens (its comparability rule reads the same keys)."""
    from aegis_sdc.response.screen import device_env  # screen imports this module: imported when used

    return device_env(cap.a_part.device, REFERENCE, cap.a_part.dtype)


def describe_clean(sample: CleanSample) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The JSON metadata and tensors of a clean sample: the captured tile, right values only."""
    cap = sample.capture
    gemm, tensors, crop = _reference_context(cap, cap.region)
    tensors.update({f"right.{k}": v for k, v in crop(cap.saved).items()})
    gemm["values"] = {"wrong": None, "right": "training step (a clean check; reproduced by a replay on the spot)",
                      "wrong_execution": None}  # fmt: skip
    meta: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "clean": True,
        "site": sample.site.name,
        "site_id": sample.site.id,
        "step": sample.step,
        "call": sample.call,
        "rank": sample.identity.rank,
        "identity": sample.identity.to_dict(),
        "incident": None,
        "recorded_env": recording_env(cap),
        "torch": torch.__version__,
        "replayable": True,
        "reason": None,
        "gemm": gemm,
    }
    return meta, tensors


def describe(incident: Incident, kept: KeptReplay | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The JSON metadata and the tensors of an incident's evidence (no tensors: not replayable)."""
    meta: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "site": incident.site.name,
        "site_id": incident.site.id,
        "step": incident.step,
        "rank": incident.identity.rank,
        "incident": incident.to_dict(),
        "torch": torch.__version__,
    }
    payload = None if kept is None else kept.payload
    replays = () if kept is None else kept.replays
    if isinstance(payload, GemmCapture):
        gemm, tensors = _reference_gemm(incident, payload, replays)
    elif type(payload).__name__ == "TritonGemmCapture":
        gemm, tensors = _triton_gemm(incident, payload, replays)
    else:
        reason = next((why for kind, why in NOT_REPLAYABLE.items() if isinstance(incident.site.kind, kind)), None)
        if reason is None:
            reason = "no replay context was kept" if payload is None else f"a {type(payload).__name__} is not written"
        meta.update(replayable=False, reason=reason)
        return meta, {}
    meta.update(replayable=True, reason=None, gemm=gemm)
    return meta, tensors


def _values(wrong_execution: WrongExecution | None) -> tuple[str, str | None]:
    """Which execution computed the wrong values and which the right ones (None: no execution did,
    as far as the verdict knows — a fault every execution reproduced, or three that all differ)."""
    if wrong_execution is WrongExecution.ORIGINAL:
        return "training step", "verifier replays (two agreed)"
    if wrong_execution is WrongExecution.REPLAY:
        return "verifier replay", "training step (the second replay agreed)"
    return "training step", None


def _one_tile(tiles: tuple[Tile, ...], region: Tile, rows: int, cols: int) -> Tile:
    """The first tile the verdict names when it is one tile of the region's grid, else the region."""
    for t in tiles[:1]:
        inside = region.row_start <= t.row_start < t.row_stop <= region.row_stop
        inside &= region.col_start <= t.col_start < t.col_stop <= region.col_stop
        aligned = (t.row_start - region.row_start) % rows == 0 and (t.col_start - region.col_start) % cols == 0
        if inside and aligned and t.row_stop - t.row_start <= rows and t.col_stop - t.col_start <= cols:
            return t
    return region


def _crop_region(r: RegionReplay, lr: slice, lc: slice, rows: int, cols: int) -> dict[str, torch.Tensor]:
    """A reference-path region's values restricted to rows `lr` × columns `lc` (region coordinates,
    tile-aligned): partials are per tile, [column tiles, R] and [row tiles, C]."""
    col_tiles = slice(lc.start // cols, -(-lc.stop // cols))
    row_tiles = slice(lr.start // rows, -(-lr.stop // rows))
    col_partials = r.col_partials[row_tiles, lc] if r.col_partials.numel() else r.col_partials  # empty: no col checks
    return {
        "out": r.out[lr, lc],
        "row_partials": r.row_partials[col_tiles, lr],
        "col_partials": col_partials,
        "row_ref": r.row_ref[lr],
    }


def _groups(incident: Incident, saved: Any, replays: tuple, crop) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The stored values: `wrong.<field>` and, where known, `right.<field>` (see `_values`)."""
    wrong_execution = incident.verdict.wrong_execution
    wrong_from, right_from = _values(wrong_execution)
    step = crop(saved)
    first = crop(replays[0]) if replays else None
    if wrong_execution is WrongExecution.ORIGINAL and first is not None:
        wrong, right = step, first
    elif wrong_execution is WrongExecution.REPLAY and first is not None:
        wrong, right = first, step
    else:
        wrong, right, right_from = step, None, None
    tensors = {f"wrong.{k}": v for k, v in wrong.items()}
    if right is not None:
        tensors.update({f"right.{k}": v for k, v in right.items()})
    values = {"wrong": wrong_from, "right": right_from, "wrong_execution": wrong_execution and wrong_execution.value}
    return values, tensors


def _reference_gemm(incident: Incident, cap: GemmCapture, replays: tuple) -> tuple[dict, dict]:
    """C = A·B of the reference path (kernels/reference.py): A [R, K] rows × B [K, C] columns of one
    tile (or the captured region), B·1 [K] fp64 as the step used it, the tile's values."""
    tile = _one_tile(incident.verdict.mismatched_tiles, cap.region, cap.tiling.rows, cap.tiling.cols)
    gemm, tensors, crop = _reference_context(cap, tile)
    gemm["values"], groups = _groups(incident, cap.saved, replays, crop)
    tensors.update(groups)
    return gemm, tensors


def _reference_context(cap: GemmCapture, tile: Tile) -> tuple[dict, dict[str, torch.Tensor], Callable]:
    """The GEMM's description and operands restricted to `tile` (tile-aligned, inside the captured
    region), and the crop of a region's values to it."""
    tiling, region = cap.tiling, cap.region
    lr = slice(tile.row_start - region.row_start, tile.row_stop - region.row_start)
    lc = slice(tile.col_start - region.col_start, tile.col_stop - region.col_start)
    tensors = {"a": cap.a_part[lr], "b": cap.b_part[:, lc], "b_rowsum": cap.saved.b_rowsum}
    if cap.bias is not None:
        tensors["bias"] = cap.bias[lc]
    a = cap.a_part
    gemm = {
        "path": REFERENCE,
        "shape": {"m": cap.shape[0], "n": cap.shape[1], "k": a.shape[1]},  # C [M, N] = A [M, K]·B [K, N]
        "region": tile.to_dict(),  # the stored tile, in the GEMM's coordinates
        # what is stored: one tile, or the captured region (rows: a row block × all of B; cols: all of A ×
        # a column block)
        "extent": "tile" if lr.stop - lr.start <= tiling.rows and lc.stop - lc.start <= tiling.cols else cap.extent,
        "operand_dtype": str(a.dtype).removeprefix("torch."),
        "out_dtype": str(cap.out_dtype).removeprefix("torch."),
        "bias": cap.bias is not None,
        "column_checks": bool(cap.saved.col_partials.numel()),
        "tiling": {"rows": tiling.rows, "cols": tiling.cols},
        "numerics": NUMERICS,
    }
    return gemm, tensors, lambda r: _crop_region(r, lr, lc, tiling.rows, tiling.cols)


def _triton_fields(r: Any, j: slice | None = None) -> dict[str, torch.Tensor]:
    """A TritonRegion's values; `j` keeps only those column tiles of the per-tile partials."""
    fields = {name: getattr(r, name) for name in TRITON_FIELDS}
    if j is not None:
        fields["row_part"], fields["out_part"] = r.row_part[j], r.out_part[j]
    return fields


def _column_block(call: Any, j: int) -> torch.Tensor:
    """B's column block j in the kernel's layout ([BN, K] when B is held transposed, else [K, BN]),
    zero-padded past N as the capture pool holds it."""
    bn, b = call.cfg.block_n, call.b
    c0 = j * bn
    cols = min(bn, call.n - c0)
    if call.b_t:
        slab = b.new_zeros(bn, call.k)
        slab[:cols] = b[c0 : c0 + cols]
    else:
        slab = b.new_zeros(call.k, bn)
        slab[:, :cols] = b[:, c0 : c0 + cols]
    return slab


def _triton_gemm(incident: Incident, cap: Any, replays: tuple) -> tuple[dict, dict]:
    """The Triton kernel's capture (ops/triton_replay.py): A's row block [BM, K] (or [K, BM] when A is
    held transposed), B's column block (or, for a row capture the verdict localized to no single
    tile, all of B), the reference vectors and their side matrices, the values per tile."""
    call = cap.call
    cfg = call.cfg
    tensors = {"a_slab": cap.a_slab, "cvec": call.cvec}
    extent, col_block, region, crop = cap.extent, cap.col_block, cap.region, _triton_fields
    if extent == "tile":
        tensors["b_slab"] = cap.b_slab
    else:
        tile = _one_tile(incident.verdict.mismatched_tiles, region, cfg.block_m, cfg.block_n)
        if tile != region:  # one column tile of the row block: replayed as a tile capture
            extent, col_block, region = "tile", tile.col_start // cfg.block_n, tile
            tensors["b_slab"] = _column_block(call, col_block)
            j = slice(col_block, col_block + 1)

            def crop(r: Any) -> dict[str, torch.Tensor]:
                fields = _triton_fields(r, j)
                fields["col_part"] = fields["colref_part"] = torch.empty(0)  # a row capture has no column sums
                return fields
        else:
            tensors["b"] = call.b
    if call.bias is not None:
        tensors["bias"] = call.bias  # [N]: the replay slices its tile's columns
    column_checks = extent == "tile" and call.u1 is not None
    for name, side in (("c_side", call.c_side), ("u_side", call.u_side if column_checks else None)):
        if side is not None:
            tensors[f"{name}.matrix"], tensors[f"{name}.scale"] = side.matrix, side.scale
    if column_checks:
        tensors["u1"] = call.u1
    values, groups = _groups(incident, cap.saved, replays, crop)
    tensors.update(groups)
    gemm = {
        "path": TRITON,
        "shape": {"m": call.m, "n": call.n, "k": call.k},  # C [M, N] = A [M, K]·B [K, N]
        "a_t": call.a_t,  # A held as Aᵀ [K, M]
        "b_t": call.b_t,  # B held as Bᵀ [N, K] (a forward's weight)
        "region": region.to_dict(),
        "extent": extent,
        "row_block": cap.row_block,
        "col_block": col_block,
        "operand_dtype": str(cap.a_slab.dtype).removeprefix("torch."),
        "out_dtype": str(call.dtype).removeprefix("torch."),
        "bias": call.bias is not None,
        "column_checks": column_checks,
        "config": dataclasses.asdict(cfg),  # the tile configuration: a tile's bits depend on it
        "numerics": NUMERICS,
        "values": values,
    }
    return gemm, tensors


def _portable(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of its own (safetensors refuses views that share storage)."""
    return t.detach().cpu().contiguous().clone()


def _write_pair(json_path: Path, tensor_path: Path, name: str, meta: dict, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save

    json_path.parent.mkdir(parents=True, exist_ok=True)
    meta["tensors"] = None
    if tensors:
        data = save({k: _portable(v) for k, v in tensors.items()}, metadata={"format": FORMAT, "incident": name})
        write_atomically(tensor_path, lambda f: f.write(data))
        meta["tensors"] = {"file": tensor_path.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    text = (json.dumps(meta, indent=2) + "\n").encode()
    write_atomically(json_path, lambda f: f.write(text))
    return json_path


# -- reading ---------------------------------------------------------------------------------------


def load_evidence(path: str | Path) -> EvidenceFile:
    """An evidence pair, from its JSON or its tensor file; EvidenceError (one line) when it is not
    one, is incomplete, or its tensor file is not the one the JSON's sha256 names."""
    path = Path(path)
    json_path = path.with_suffix(".json") if path.suffix == ".safetensors" else path
    try:
        meta = json.loads(json_path.read_bytes())
    except OSError as error:
        raise EvidenceError(f"{json_path}: {error.strerror or error}") from None
    except ValueError as error:  # not UTF-8, not JSON (truncated)
        raise EvidenceError(f"{json_path}: not an aegis evidence file (unreadable JSON: {error})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise EvidenceError(f"{json_path}: not an aegis evidence file")
    if meta.get("version") != VERSION:
        raise EvidenceError(f"{json_path}: evidence format version {meta.get('version')!r}, this aegis reads {VERSION}")
    info = meta.get("tensors")
    if not meta.get("replayable") or info is None:
        return EvidenceFile(json_path, meta, {})
    name = info.get("file") if isinstance(info, dict) else None
    if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
        raise EvidenceError(f"{json_path}: the tensor file it names is not a file beside it: {name!r}")
    tensor_path = json_path.parent / name
    try:
        data = tensor_path.read_bytes()
    except OSError as error:
        raise EvidenceError(f"{tensor_path}: {error.strerror or error}") from None
    if hashlib.sha256(data).hexdigest() != info.get("sha256"):
        raise EvidenceError(f"{tensor_path}: its sha256 is not the one {json_path.name} names (truncated or modified)")
    from safetensors.torch import load

    try:
        tensors = load(data)
    except Exception as error:  # safetensors raises its own error types
        raise EvidenceError(f"{tensor_path}: not a safetensors file ({error})") from None
    return EvidenceFile(json_path, meta, tensors)
