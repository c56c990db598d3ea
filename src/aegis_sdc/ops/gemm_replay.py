"""Replay contexts of checked GEMMs: the smallest state that recomputes a suspect region bit for bit.

A region is a tile-aligned rectangle of C = A·B. Which region a vTask needs depends on which
checksum crossed its threshold, because each checksum localizes one coordinate only:

    both row and col  → "tile":  one row block × one column block. A's row block and B's column
                         block are copied (two small slabs); nothing is referenced.
    row only          → "rows":  one row block × all columns. A's row block is copied; B is
                         referenced (for forward and dgrad it is the weight).
    col only          → "cols":  all rows × one column block. A is referenced; B's column block
                         is copied.
    non-finite        → "rows" around the first non-finite row.

A referenced tensor is checked against its version counter before the replay (a weight changed by
the optimizer makes the vTask not verifiable, so the guard replays such vTasks before the optimizer
step). The region's output, its fp32 partial checksums and the reference side A·(B·1) are saved as
the training step produced them; the replay recomputes all of them with the identical
implementation and compares bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aegis_sdc.events import Tile
from aegis_sdc.kernels.reference import (
    GemmChecksums,
    RegionReplay,
    Tiling,
    bitwise_equal,
    exact_violations,
    replay_region,
)

EXTENTS = ("tile", "rows", "cols")
# A referenced weight updated between the call and its verification: the step's boundary came after
# the update (the guard names the wiring mistake when a verdict says so).
MODIFIED_BEFORE_REPLAY = "was modified before the replay"


@dataclass(frozen=True)
class GemmOperands:
    """C = A·B + bias as a checked call saw it."""

    a: torch.Tensor  # [M, K]
    b: torch.Tensor  # [K, N]
    bias: torch.Tensor | None  # [N]
    out_dtype: torch.dtype
    tiling: Tiling


@dataclass(frozen=True)
class RegionDiff:
    """Where two executions of one region differ."""

    tiles: tuple[Tile, ...]  # tiles whose output values or fp32 partial checksums differ
    output_differs: bool  # the rounded output (what training consumed) differs somewhere
    reference_differs: bool  # A·(B·1) differs: the reference side of the check was computed wrong
    # B·1 recomputed from a referenced operand (the weight) differs from the vector the step used: the
    # operand is not the one the step multiplied, so nothing else in the comparison means anything
    derived_differs: bool = False

    @property
    def equal(self) -> bool:
        return not (self.tiles or self.output_differs or self.reference_differs or self.derived_differs)


def diff_regions(x: RegionReplay, y: RegionReplay, tiling: Tiling, region: Tile) -> RegionDiff:
    """Compare two executions of a region tile by tile, bit for bit (output, partial checksums,
    reference side); tiles are reported in the GEMM's coordinates."""
    rb, cb = tiling.rows, tiling.cols
    rows, cols = x.out.shape
    has_cols = bool(x.col_partials.numel() and y.col_partials.numel())
    tiles = []
    output_differs = False
    for i, r0 in enumerate(range(0, rows, rb)):
        r1 = min(r0 + rb, rows)
        for j, c0 in enumerate(range(0, cols, cb)):
            c1 = min(c0 + cb, cols)
            out_differs = not bitwise_equal(x.out[r0:r1, c0:c1], y.out[r0:r1, c0:c1])
            sums_differ = not bitwise_equal(x.row_partials[j, r0:r1], y.row_partials[j, r0:r1])
            if has_cols:
                sums_differ |= not bitwise_equal(x.col_partials[i, c0:c1], y.col_partials[i, c0:c1])
            output_differs |= out_differs
            if out_differs or sums_differ:
                tiles.append(
                    Tile(region.row_start + r0, region.row_start + r1, region.col_start + c0, region.col_start + c1)
                )
    reference_differs = not bitwise_equal(x.row_ref, y.row_ref)
    return RegionDiff(tuple(tiles), output_differs, reference_differs, not bitwise_equal(x.b_rowsum, y.b_rowsum))


def _block_range(index: int, block: int, size: int) -> tuple[int, int]:
    start = (index // block) * block
    return start, min(start + block, size)


class ReferencedOperands:
    """Operands a capture holds by reference, not copied: the replay is valid only while they are unchanged.

    Subclasses set `references` (the tensors) and `versions` (their `_version` counters at capture).
    """

    references: tuple[torch.Tensor, ...]
    versions: tuple[int, ...]

    @property
    def references_tensors(self) -> bool:
        return bool(self.references)

    def references_changed(self) -> str | None:
        for tensor, version in zip(self.references, self.versions, strict=True):
            if tensor._version != version:
                return f"a referenced tensor of shape {tuple(tensor.shape)} {MODIFIED_BEFORE_REPLAY}"
            if tensor.numel() and tensor.untyped_storage().nbytes() == 0:
                return (
                    f"a referenced tensor of shape {tuple(tensor.shape)} was freed before the replay"
                    " (as FSDP2 frees unsharded weights; protect before fully_shard and call attach_fsdp)"
                )
        return None


class GemmCapture(ReferencedOperands):
    """The replay context of one suspect call; see the module docstring."""

    def __init__(
        self,
        operands: GemmOperands,
        result: GemmChecksums,
        *,
        extent: str,
        row_index: int,
        col_index: int,
        fault=None,  # the AccumulatorFault applied to this call, if any (replayed if persistent)
        copy_whole: bool = False,  # copy whole operands too (their storage may be freed: FSDP2)
    ) -> None:
        if extent not in EXTENTS:
            raise ValueError(f"extent must be one of {EXTENTS}, got {extent!r}")
        a, b, tiling = operands.a, operands.b, operands.tiling
        m, n = a.shape[0], b.shape[1]
        self.extent = extent
        self.shape = (m, n)  # C's [M, N]: a fault's element is drawn against it (evidence files keep it)
        self.tiling = tiling
        self.out_dtype = operands.out_dtype
        self.fault = fault
        self.fault_element = fault.element(m, n) if fault is not None else None
        whole_rows, whole_cols = extent == "cols", extent == "rows"
        r0, r1 = (0, m) if whole_rows else _block_range(row_index, tiling.rows, m)
        c0, c1 = (0, n) if whole_cols else _block_range(col_index, tiling.cols, n)
        self.region = Tile(r0, r1, c0, c1)

        # Operands: a slab is copied, a whole operand is referenced (and version-checked).
        if copy_whole:
            whole_rows = whole_cols = False  # nothing referenced: the slabs below are the whole operands
        self.a_part = a if whole_rows else a[r0:r1].clone()
        self.b_part = b if whole_cols else b[:, c0:c1].clone()
        bias = operands.bias
        self.bias = None if bias is None else (bias if whole_cols else bias[c0:c1].clone())
        self.references = tuple(
            t for t, whole in ((a, whole_rows), (b, whole_cols), (bias, whole_cols)) if whole and t is not None
        )
        self.versions = tuple(t._version for t in self.references)

        # What the training step produced in the region (copies: the originals may be freed).
        rb, cb = tiling.rows, tiling.cols
        self.saved = RegionReplay(
            out=result.out[r0:r1, c0:c1].clone(),
            row_partials=result.row_partials[c0 // cb : -(-c1 // cb), r0:r1].clone(),
            col_partials=(
                result.col_partials[r0 // rb : -(-r1 // rb), c0:c1].clone()
                if result.col_partials is not None
                else torch.empty(0)
            ),
            row_ref=result.row_ref[r0:r1].clone(),
            b_rowsum=result.b_rowsum,
        )

    def inputs_finite(self) -> bool:
        parts = [self.a_part, self.b_part] + ([self.bias] if self.bias is not None else [])
        return all(bool(torch.isfinite(p).all()) for p in parts)

    def replay(self) -> RegionReplay:
        """Recompute the region with the identical implementation (and a persistent fault, if modelled)."""
        fault, fault_at = None, None
        if self.fault is not None and self.fault.affects_replay and self.fault_element is not None:
            fault = self.fault
            fault_at = (
                self.fault_element[0] - self.region.row_start,
                self.fault_element[1] - self.region.col_start,
            )
        whole_b = self.extent == "rows"
        result = replay_region(
            self.a_part,
            self.b_part,
            out_dtype=self.out_dtype,
            bias=self.bias,
            tiling=self.tiling,
            b_rowsum=None if whole_b else self.saved.b_rowsum,
            fault=fault,
            fault_at=fault_at,
        )
        if not self.saved.col_partials.numel():
            result.col_partials = torch.empty(0)  # the training step took no column checksums
        return result

    def diff(self, x: RegionReplay, y: RegionReplay) -> RegionDiff:
        return diff_regions(x, y, self.tiling, self.region)

    def exact_violations(self) -> int:
        """Saved values outside the deterministic fp32 error bound of an fp64 recomputation."""
        return exact_violations(
            self.a_part,
            self.b_part,
            bias=self.bias,
            out=self.saved.out,
            row_partials=self.saved.row_partials,
            tiling=self.tiling,
        )
