"""Replay contexts of the fused Triton GEMM (CUDA tensors; CPU under TRITON_INTERPRET=1).

The kernel's last evidence program copies the context of an alarm into a capture-pool slot (see
kernels/triton_gemm.py, `_capture`). At the end of the step the host reads the evidence and, for an
alarm, turns the slot into a `TritonGemmCapture`. Its replay relaunches the same kernel with the same
tile configuration on the captured slabs (every tile's K loop runs in the same fixed order wherever
the tile sits), so every compared value is recomputed by the code that produced it:

    rows (row checks):   A's row block (copied) against the whole of B (the weight, by reference):
                         every tile of the block — accumulator row sums, rounded-output row sums —
                         and the block's reference side A·c per K slice (slice j from its tile j)
    tile (column checks: A's row block and B's column block (both copied): one tile, launched with
    wgrad by default)    `side_all` so that it recomputes every K slice of both reference sides, A·c
                         of its rows and u1ᵀB of its columns, as the tiles of its row block and
                         column block did (the slices' count is the original launch's)
"""

from __future__ import annotations

import dataclasses
import math

import torch

from aegis_sdc.events import Tile
from aegis_sdc.kernels import triton_gemm as tg
from aegis_sdc.kernels.gemm_side import SideMatrix
from aegis_sdc.kernels.reference import F32_MAX, U32, bitwise_equal
from aegis_sdc.ops.gemm_replay import ReferencedOperands, RegionDiff


@dataclasses.dataclass
class TritonGemmCall:
    """What the host keeps of one checked launch until the end of the step (no tensor data copied)."""

    a_t: bool
    b_t: bool
    m: int
    n: int
    k: int
    dtype: torch.dtype
    cfg: tg.TritonGemmConfig
    capture_kind: int
    b: torch.Tensor | None  # B's storage, referenced for a rows capture (the weight)
    bias: torch.Tensor | None
    cvec: torch.Tensor
    u1: torch.Tensor | None
    pool: tg.CapturePool | None
    fault: tuple | None  # (model, row, col, delta, mask) of a persistent fault, else None
    weight_stats: object | None = None  # weight → cvec, recomputed from `b` to verify the reference side
    c_side: SideMatrix | None = None  # the S matrices the launch read (rebuilt from cvec / u1 when absent)
    u_side: SideMatrix | None = None
    pooled: bool = False  # cvec / u1 and their S live in buffers reused next step (WeightStats, ByproductPool)

    def kept(self) -> TritonGemmCall:
        """This call as a capture keeps it past the step: pooled reference vectors copied."""
        if not self.pooled:
            return self

        def copy(side: SideMatrix | None) -> SideMatrix | None:
            return None if side is None else SideMatrix(side.vec.clone(), side.matrix.clone(), side.scale)

        c_side, u_side = copy(self.c_side), copy(self.u_side)
        return dataclasses.replace(
            self, cvec=c_side.vec if c_side is not None else self.cvec.clone(),
            u1=None if self.u1 is None else (u_side.vec if u_side is not None else self.u1.clone()),
            c_side=c_side, u_side=u_side, pooled=False,
        )  # fmt: skip

    @property
    def references(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.b, self.bias) if t is not None)


@dataclasses.dataclass
class TritonRegion:
    """One execution of a captured region, in the kernel's own units (fp32 per-tile partials)."""

    row_part: torch.Tensor  # [tiles, R]: Σ acc over each column tile
    out_part: torch.Tensor  # [tiles, R]: checksum of the rounded output's row in each column tile (its bits)
    ref_part: torch.Tensor  # [tiles_n, R]: A·c per K slice
    col_part: torch.Tensor  # [1, C] or empty: Σ acc over the tile's rows
    colref_part: torch.Tensor  # [tiles_m, C] or empty: u1ᵀB per K slice
    b_rowsum: torch.Tensor  # B·1 used (recomputed from the weight when verifying)


class TritonGemmCapture(ReferencedOperands):
    """A vTask payload for the Triton path (the interface of ops.gemm_replay.GemmCapture)."""

    def __init__(self, call: TritonGemmCall, slot: int, row_index: int, col_index: int) -> None:
        self.call = call
        cfg = call.cfg
        bm, bn, k = cfg.block_m, cfg.block_n, call.k
        self.tiles_m, self.tiles_n = -(-call.m // bm), -(-call.n // bn)
        # the reference sides' K slices as the launch computed them (TritonGemmConfig.side_group)
        self.row_parts, self.col_parts = tg.row_side_parts(self.tiles_n, cfg), tg.side_parts(self.tiles_m, cfg)
        self.row_block = row_index // bm
        self.col_block = col_index // bn
        r0 = self.row_block * bm
        self.rows = min(bm, call.m - r0)
        data = call.pool.data[slot].clone()  # the pool is reused next step: keep a copy
        f32 = call.pool.f32[slot].clone()
        self.a_slab = (data[: bm * k].view(k, bm) if call.a_t else data[: bm * k].view(bm, k)).contiguous()
        rows = slice(0, self.rows)
        if call.capture_kind == tg.CAPTURE_TILE:
            self.extent = "tile"
            c0 = self.col_block * bn
            self.cols = min(bn, call.n - c0)
            slab = data[bm * k : bm * k + bn * k]
            self.b_slab = (slab.view(bn, k) if call.b_t else slab.view(k, bn)).contiguous()
            rp, cp = self.row_parts, self.col_parts
            parts = f32[: 2 * bm].view(2, bm)
            refs = f32[2 * bm : (2 + rp) * bm].view(rp, bm)
            cols = f32[(2 + rp) * bm : (2 + rp) * bm + (1 + cp) * bn]
            with_cols = call.u1 is not None
            self.saved = TritonRegion(
                row_part=parts[0:1, rows],
                out_part=parts[1:2, rows],
                ref_part=refs[:, rows],
                col_part=cols[:bn].view(1, bn)[:, : self.cols] if with_cols else torch.empty(0),
                colref_part=cols[bn:].view(cp, bn)[:, : self.cols] if with_cols else torch.empty(0),
                b_rowsum=call.cvec,
            )
            self.region = Tile(r0, r0 + self.rows, c0, c0 + self.cols)
            self.references: tuple[torch.Tensor, ...] = ()
        else:
            self.extent = "rows"
            self.b_slab = None
            t, rp = self.tiles_n, self.row_parts
            parts = f32[: 2 * t * bm].view(2, t, bm)
            self.saved = TritonRegion(
                row_part=parts[0, :, rows],
                out_part=parts[1, :, rows],
                ref_part=f32[2 * t * bm : (2 * t + rp) * bm].view(rp, bm)[:, rows],
                col_part=torch.empty(0),
                colref_part=torch.empty(0),
                b_rowsum=call.cvec,
            )
            self.region = Tile(r0, r0 + self.rows, 0, call.n)
            self.references = call.references
        self.versions = tuple(t._version for t in self.references)

    @classmethod
    def restore(
        cls,
        call: TritonGemmCall,
        extent: str,
        a_slab: torch.Tensor,
        b_slab: torch.Tensor | None,
        saved: TritonRegion,
        row_block: int,
        col_block: int,
    ) -> TritonGemmCapture:
        """A capture rebuilt from its parts (an evidence file), nothing referenced: `a_slab` A's row
        block and, for a tile, `b_slab` B's column block, both in the kernel's layout and zero-padded to
        BM / BN as the pool holds them; for rows, `call.b` holds all of B. `saved` is compared with."""
        if extent not in ("tile", "rows"):
            raise ValueError(f"extent must be tile or rows, got {extent!r}")
        self = cls.__new__(cls)
        cfg = call.cfg
        bm, bn = cfg.block_m, cfg.block_n
        self.call = call
        self.tiles_m, self.tiles_n = -(-call.m // bm), -(-call.n // bn)
        self.row_parts, self.col_parts = tg.row_side_parts(self.tiles_n, cfg), tg.side_parts(self.tiles_m, cfg)
        self.row_block, self.col_block = row_block, col_block
        r0 = row_block * bm
        self.rows = min(bm, call.m - r0)
        self.a_slab, self.b_slab, self.extent, self.saved = a_slab, b_slab, extent, saved
        if extent == "tile":
            c0 = col_block * bn
            self.cols = min(bn, call.n - c0)
            self.region = Tile(r0, r0 + self.rows, c0, c0 + self.cols)
        else:
            self.region = Tile(r0, r0 + self.rows, 0, call.n)
        self.references, self.versions = (), ()
        return self

    def inputs_finite(self) -> bool:
        parts = [self.a_slab] + [t for t in (self.b_slab, self.call.b, self.call.bias) if t is not None]
        return all(bool(torch.isfinite(p).all()) for p in parts)

    def _bias(self) -> torch.Tensor | None:
        bias = self.call.bias
        if bias is None or self.b_slab is None:
            return bias
        c0 = self.region.col_start
        return bias[c0 : c0 + self.cols]

    def replay(self) -> TritonRegion:
        """Recompute the region on the same kernel configuration (with a persistent fault, if modelled)."""
        call = self.call
        cfg = call.cfg
        bm, bn = cfg.block_m, cfg.block_n
        fault = None
        if call.fault is not None:
            model, row, col, delta, mask = call.fault
            fault = (model, row - self.region.row_start, col - self.region.col_start, delta, mask)
        tile = self.extent == "tile"
        b = self.b_slab if tile else call.b
        out = torch.empty(bm, bn if tile else call.n, dtype=call.dtype, device=self.a_slab.device)
        result = tg.launch_checked_gemm(
            self.a_slab,
            b,
            out,
            a_t=call.a_t,
            b_t=call.b_t,
            bias=self._bias(),
            cvec=call.cvec,
            u1=call.u1 if tile else None,
            c_side=call.c_side,
            u_side=call.u_side if tile else None,
            row_check=True,
            row_side=True,
            col_check=tile and call.u1 is not None,
            side_all=tile,
            row_parts=self.row_parts,
            col_parts=self.col_parts,
            fault=fault,
            evidence=False,
            cfg=cfg,
        )
        rows = slice(0, self.rows)
        with_cols = tile and call.u1 is not None
        b_rowsum = call.cvec
        if not tile and call.weight_stats is not None:
            b_rowsum = call.weight_stats(call.b)  # recompute B·1 from the weight: verifies the cached vector
        f64 = torch.float64  # the capture pool keeps every partial in fp64 (fp32 ones upcast exactly)
        return TritonRegion(
            row_part=result.row_part[:, rows].to(f64),
            out_part=result.out_part[:, rows].to(f64),
            ref_part=result.rowref_parts[:, rows],
            col_part=result.col_part[:, : self.cols].to(f64) if with_cols else torch.empty(0),
            colref_part=result.colref_parts[:, : self.cols] if with_cols else torch.empty(0),
            b_rowsum=b_rowsum,
        )

    def diff(self, x: TritonRegion, y: TritonRegion) -> RegionDiff:
        bn = self.call.cfg.block_n
        tiles = []
        output_differs = False
        for j in range(x.row_part.shape[0]):
            out_differs = not bitwise_equal(x.out_part[j], y.out_part[j])
            sums_differ = not bitwise_equal(x.row_part[j], y.row_part[j])
            output_differs |= out_differs
            if out_differs or sums_differ:
                c0 = self.region.col_start + j * bn
                tiles.append(Tile(self.region.row_start, self.region.row_stop, c0, min(c0 + bn, self.call.n)))
        if not bitwise_equal(x.col_part, y.col_part) and not tiles:
            tiles.append(self.region)
        reference_differs = not (bitwise_equal(x.ref_part, y.ref_part) and bitwise_equal(x.colref_part, y.colref_part))
        return RegionDiff(tuple(tiles), output_differs, reference_differs, not bitwise_equal(x.b_rowsum, y.b_rowsum))

    def exact_violations(self) -> int:
        """Saved accumulator row sums outside the exact error bound of an fp64 recomputation.

        Per tile, the saved value is an fp32 tree sum of `BN` fp32 accumulators, each within
        γ_K·Σ_k|A_ik||B_kj| of the exact product (γ_K with u' = 2⁻²³, admitting truncation); the
        tree adds at most ⌈log2 BN⌉ roundings of u' relative to the sum of magnitudes.
        """
        call = self.call
        a = (self.a_slab.t() if call.a_t else self.a_slab)[: self.rows].double()
        if self.b_slab is not None:
            b = (self.b_slab.t() if call.b_t else self.b_slab)[:, : self.cols].double()
        else:
            b = (call.b.t() if call.b_t else call.b).double()
        exact = a @ b
        magnitude = a.abs() @ b.abs()
        u2 = 2 * U32
        gamma = call.k * u2 / (1 - call.k * u2)
        bn = call.cfg.block_n
        depth = math.ceil(math.log2(bn)) + 1
        violations = 0
        for j in range(self.saved.row_part.shape[0]):
            cols = slice(j * bn, min((j + 1) * bn, exact.shape[1]))
            mag = magnitude[:, cols].sum(dim=1)
            bound = (gamma + depth * u2 * (1 + gamma)) * mag + 1e-30
            diff = (self.saved.row_part[j].double() - exact[:, cols].sum(dim=1)).abs()
            # every partial sum of the tile row's products is at most its sum of magnitudes: past
            # fp32's range an accumulator may correctly reach ±inf (and the row sum NaN)
            overflowed = mag + bound >= F32_MAX
            violations += int((~((diff <= bound) | overflowed)).sum())
        return violations
