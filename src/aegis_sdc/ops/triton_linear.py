"""The Linear's three GEMMs on the fused Triton kernel (CUDA tensors; CPU under TRITON_INTERPRET=1).

Reference-side vectors, and where they come from (no extra pass over a large operand):

    forward  C = X·Wᵀ   c = Wᵀ·1    both sums of a weight in one pass, once per weight and step
    dgrad    C = dY·W   c = W·1     (`WeightStats`, kernels/weight_sums.py)
    wgrad    C = dYᵀ·X  c = X·1     a by-product of a checked forward (its reference-side MMA's
                                    ones column), else one pass over X
                        u1 = dY·1   the same of a checked dgrad, else one pass over dY

The scale of a difference is the accumulator's own row (column) norm, taken in the kernel's
epilogue: no squared vectors. A column check of a forward or dgrad (not the default) needs
u1 = 1ᵀA, a pass over the activation before the launch: that is its cost.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from aegis_sdc.kernels import triton_gemm as tg
from aegis_sdc.kernels.gemm_side import SIDE_COLUMNS, SideMatrix
from aegis_sdc.kernels.reference import TINY, U32
from aegis_sdc.kernels.row_sums import triton_row_sums
from aegis_sdc.kernels.weight_sums import GroupSums, WeightSideBuffers, weight_side_matrices, weight_sides
from aegis_sdc.ops.triton_replay import TritonGemmCall


@dataclasses.dataclass
class DeviceState:
    """Per-device buffers the guard owns for one step: evidence slots and capture pools."""

    capacity: int = 1024
    pool_slots: int = 4
    # device → [buffer [cap, 8] int64, its rows, their fp64 views, next row]: the views are made with
    # the buffer, so a checked call takes its slot without a tensor op
    _stats: dict = dataclasses.field(default_factory=dict)
    _pools: dict = dataclasses.field(default_factory=dict)  # (device, dtype) → CapturePool
    used_pools: list = dataclasses.field(default_factory=list)
    # Counts the guard's evidence reads (step ends and flushes). Whatever is derived from a weight is
    # valid for one epoch only: weights change between steps without a trace (see WeightStats).
    epoch: int = 0

    def stats_slot(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A zeroed evidence slot (int64 [STATS_LEN]) for one checked launch, and its fp64 view."""
        entry = self._stats.get(device)
        if entry is None or entry[3] >= self.capacity:
            # Full (more checked launches in one step than slots): a fresh buffer; the full one stays
            # referenced by the calls that wrote it until the step's read.
            buffer = torch.zeros(self.capacity, tg.STATS_LEN, dtype=torch.int64, device=device)
            rows, rows_f64 = list(buffer.unbind(0)), list(buffer.view(torch.float64).unbind(0))
            entry = self._stats[device] = [buffer, rows, rows_f64, 0]
        row = entry[3]
        entry[3] = row + 1
        return entry[1][row], entry[2][row]

    def pool(self, device: torch.device, dtype: torch.dtype, data_len: int, f32_len: int) -> tg.CapturePool:
        key = (device, dtype)
        pool = self._pools.get(key)
        if pool is None or pool.data.shape[1] < data_len or pool.f32.shape[1] < f32_len:
            if pool is not None:
                data_len, f32_len = max(data_len, pool.data.shape[1]), max(f32_len, pool.f32.shape[1])
            pool = tg.CapturePool.allocate(self.pool_slots, data_len, f32_len, dtype, device)
            self._pools[key] = pool
        if pool not in self.used_pools:
            self.used_pools.append(pool)
        return pool

    def end_step(self) -> None:
        """After the step's evidence was read: fresh slots and free pools for the next step."""
        for entry in self._stats.values():
            if entry[3]:
                entry[0][: entry[3]].zero_()
                entry[3] = 0
        for pool in self.used_pools:
            pool.counter.zero_()
        self.used_pools.clear()
        self.epoch += 1


class WeightStats:
    """c of a weight for forward and dgrad (Wᵀ·1 and W·1), computed once per weight and step.

    A weight can change between steps without any sign on the tensor: fused optimizers
    (`AdamW(fused=True)`) and writes through `p.data` do not bump `_version`, and FSDP2 regathers
    parameters into reused storage. A cache keyed to the tensor would then hand the next step the
    previous step's vectors, every check would differ by the update, and the replay — which
    recomputes them — would blame the device. So the key is the guard's step epoch (every step end
    and flush starts a new one) together with the tensor's identity and version (a change within a
    step, such as `load_state_dict` between micro-batches, is seen through the version)."""

    def __init__(self) -> None:
        self.shared: WeightSums | None = None  # computes this weight with the others of its shape
        self._key: tuple | None = None
        self._value: tuple[SideMatrix, SideMatrix] | None = None
        # The buffers the sums are written into, reused from one step to the next (a capture copies
        # what it keeps of them: TritonGemmCall.kept). A weight that changes within a step gets
        # fresh ones: launches of the step queued before the change still read the old sums.
        self._buffers: WeightSideBuffers | None = None

    @staticmethod
    def compute(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(Wᵀ·1 [K], W·1 [N]) in fp64 for W [N, K], in one pass over W where the Triton kernel
        runs (CUDA, or the interpreter), else two torch reductions. Deterministic either way, so a
        replay recomputes them bit for bit."""
        if w.device.type == "cuda" or tg.INTERPRET:
            col_sum, row_sum, _, _ = weight_sides(w, sides=False)
            return col_sum, row_sum
        f64 = torch.float64
        return w.sum(dim=0, dtype=f64), w.sum(dim=1, dtype=f64)

    def get(self, w: torch.Tensor, source: torch.Tensor, epoch: int) -> tuple[SideMatrix, SideMatrix]:
        """(S(Wᵀ·1) for the forward, S(W·1) for the dgrad) of this step's weight (gemm_side.py)."""
        # `source` is the parameter; `w` may be its autocast copy. The copy's values are a function
        # of the parameter's within one epoch.
        key = (epoch, source.data_ptr(), source._version, w.dtype, w.shape, w.stride())
        if key != self._key and self.shared is not None:
            self.shared.prepare(epoch)  # the step's first ask: every active weight, a pass per shape
        if key != self._key:
            if w.device.type == "cuda" or tg.INTERPRET:
                buffers = self._buffers
                same_step = self._key is not None and self._key[0] == epoch
                if buffers is None or same_step or not buffers.fits(w):
                    buffers = self._buffers = WeightSideBuffers.empty(w)
                value = weight_side_matrices(w, out=buffers)  # sums and S matrices: two launches
            else:
                value = tuple(SideMatrix.of(v, w.dtype) for v in self.compute(w))
            self._key, self._value = key, value
        return self._value

    def set(self, epoch: int, w: torch.Tensor, buffers: WeightSideBuffers) -> None:
        """This step's sums of `w` (the parameter itself), computed by its group into `buffers`."""
        self._key = (epoch, w.data_ptr(), w._version, w.dtype, w.shape, w.stride())
        self._value = (
            SideMatrix.written_by_kernel(buffers.col_sum, buffers.s_col),
            SideMatrix.written_by_kernel(buffers.row_sum, buffers.s_row),
        )


class WeightSums:
    """The weight sums of a step for every protected Linear the step plan makes active, computed
    together at the step's first ask: one pair of launches per weight shape (GroupSums) instead of a
    pair per weight — 155 weights of a 1.1B Llama are 5 shapes.

    Only weights that are what the forward will read take part: plain bf16 CUDA parameters with
    contiguous rows and live storage (not a DTensor shard, not a freed FSDP view; `enabled` is turned
    off under FSDP2, which regathers weights per layer). A Linear whose forward passes something else
    (an autocast copy, a weight changed within the step) misses the key in `WeightStats.get` and
    takes its own launches, as before."""

    def __init__(self, plan) -> None:
        self.plan = plan
        self.enabled = True
        self._members: list[tuple[torch.nn.Module, int, WeightStats]] = []  # (Linear, plan index, its stats)
        self._epoch: int | None = None
        self._groups: dict[tuple, tuple[GroupSums, dict[int, int]]] = {}  # shape key → (sums, member → slot)
        self._tables: dict[tuple, tuple[tuple, torch.Tensor]] = {}  # shape key → (rows, their device table)

    def join(self, module: torch.nn.Module, index: int, stats: WeightStats) -> None:
        """A Linear whose forward reads `module.weight` as it is (an `nn.Linear`; not a Conv1D, whose
        GEMM reads the transposed weight)."""
        if type(module) is not torch.nn.Linear:
            return
        stats.shared = self
        self._members.append((module, index, stats))

    def prepare(self, epoch: int) -> None:
        if epoch == self._epoch or not self.enabled:
            return
        self._epoch = epoch
        by_key: dict[tuple, list[tuple[int, torch.Tensor, WeightStats]]] = {}
        for member, (module, index, stats) in enumerate(self._members):
            w = getattr(module, "weight", None)
            if self.plan.active_first(index) and _groupable(w):
                by_key.setdefault((w.device, tuple(w.shape), w.stride(0)), []).append((member, w, stats))
        for key, entries in by_key.items():
            if len(entries) < 2:  # alone: its own launches cost the same
                continue
            sums, slots = self._group(key, [member for member, _, _ in entries])
            rows = tuple((w.data_ptr(), slots[member]) for member, w, _ in entries)
            sums.compute(entries[0][1], self._table(key, rows))
            for member, w, stats in entries:
                stats.set(epoch, w, sums.buffers(slots[member]))

    def _group(self, key: tuple, members: list[int]) -> tuple[GroupSums, dict[int, int]]:
        group = self._groups.get(key)
        if group is None or any(member not in group[1] for member in members):
            # slots for every member of this shape now (a later step may make others active)
            device, (n, k), _ = key
            known = [] if group is None else list(group[1])
            slots = {member: slot for slot, member in enumerate(dict.fromkeys(known + members))}
            group = self._groups[key] = (GroupSums.empty(len(slots), n, k, device), slots)
        return group

    def _table(self, key: tuple, rows: tuple) -> torch.Tensor:
        """The device table of (address, slot) rows: uploaded when the rows change (a new active set)."""
        cached = self._tables.get(key)
        if cached is not None and cached[0] == rows:
            return cached[1]
        table = torch.tensor(rows, dtype=torch.int64)
        device = key[0]
        if device.type == "cuda":
            table = table.pin_memory().to(device, non_blocking=True)
        self._tables[key] = (rows, table)
        return table


def _groupable(w: object) -> bool:
    return (
        type(w) in (torch.nn.Parameter, torch.Tensor)
        and type(w.data) is torch.Tensor  # not a tensor subclass (a DTensor shard)
        and w.dtype == torch.bfloat16
        and w.dim() == 2
        and w.stride(1) == 1
        and (w.device.type == "cuda" or tg.INTERPRET)
        and w.untyped_storage().nbytes() > 0
    )


@dataclasses.dataclass
class Byproduct:
    """A·1 of a checked launch's A, as a later wgrad check of the same Linear reads it: fp64 [M] and,
    for bf16 operands, S(A·1) [M, 16] written by the same launch (fp16 S needs a scale from the whole
    vector: built when read)."""

    vec: torch.Tensor
    matrix: torch.Tensor | None
    dtype: torch.dtype

    @classmethod
    def empty(cls, m: int, dtype: torch.dtype, device: torch.device) -> Byproduct:
        matrix = None
        if dtype == torch.bfloat16:
            matrix = torch.empty(m, SIDE_COLUMNS, dtype=dtype, device=device)
        return cls(torch.empty(m, dtype=torch.float64, device=device), matrix, dtype)

    @classmethod
    def scratch(cls, m: int, dtype: torch.dtype, device: torch.device) -> Byproduct:
        """Where a launch writes a by-product that nothing will read (no wgrad follows): the shared
        workspace, so that one kernel variant serves both cases and nothing is allocated."""
        matrix = None
        if dtype == torch.bfloat16:
            matrix = tg._workspace(device, "byproduct_side", (m, SIDE_COLUMNS), dtype)
        return cls(tg._workspace(device, "byproduct", (m,), torch.float64), matrix, dtype)

    def side(self) -> SideMatrix:
        if self.matrix is not None:
            return SideMatrix.written_by_kernel(self.vec, self.matrix)
        return SideMatrix.of(self.vec, self.dtype)


class ByproductPool:
    """The by-product buffers of one Linear's calls (X·1 of its forwards, dY·1 of its dgrads), reused
    from step to step: call c of a step writes buffer c, so a checked GEMM allocates nothing for them.

    A buffer is read by the same call's wgrad later in the step, and by the replay of an alarmed
    wgrad: the step's evidence is judged before the next step's first forward (the optimizer's post
    hook, or `guard.step()`), and an alarmed call's capture copies what it keeps of them there
    (`TritonGemmCall.kept`). Buffers are handed out in call order and never twice in one step; a
    loop that never ends its steps gets fresh tensors past `MAX_PER_STEP` calls."""

    MAX_PER_STEP = 64

    def __init__(self) -> None:
        self._step: int | None = None
        self._used = 0
        self._buffers: list[Byproduct] = []  # by call index, each as long as the longest call it served
        self._views: list[Byproduct] = []  # the buffer's view at the length last handed out

    def take(self, step: int, m: int, dtype: torch.dtype, device: torch.device) -> Byproduct:
        if step != self._step:
            self._step, self._used = step, 0
        index = self._used
        self._used += 1
        if index >= self.MAX_PER_STEP:
            return Byproduct.empty(m, dtype, device)
        if index < len(self._views):
            view = self._views[index]
            if view.vec.shape[0] == m and view.dtype == dtype and view.vec.device == device:
                return view
            buffer = self._buffers[index]
            if buffer.vec.shape[0] < m or buffer.dtype != dtype or buffer.vec.device != device:
                buffer = self._buffers[index] = Byproduct.empty(m, dtype, device)
        else:
            buffer = Byproduct.empty(m, dtype, device)
            self._buffers.append(buffer)
            self._views.append(buffer)
            return buffer
        # variable lengths: a view of the longest buffer (made when the length changes, not per call)
        matrix = None if buffer.matrix is None else buffer.matrix[:m]
        view = self._views[index] = Byproduct(buffer.vec[:m], matrix, dtype)
        return view


def usable(*activations: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Whether the Triton path can take these operands (device, dtype, TMA alignment)."""
    operands = [(t, False) for t in activations] + ([] if weight is None else [(weight, True)])
    for t, is_weight in operands:
        if t.device.type != "cuda" and not tg.INTERPRET:
            return False
        if unsupported(t, is_weight=is_weight) is not None:
            return False
    return True


def unsupported(t: torch.Tensor, *, is_weight: bool = False) -> str | None:
    """Why the Triton kernel cannot take this operand (None: it can).

    Every operand is addressed by TMA: a contiguous last dimension, rows of 16-byte multiples, an
    aligned base. A weight [N, K] also gives the forward's output rows of N elements, so N must make
    16-byte rows as well. An activation's first dimension (the token count M) is free: no output
    has rows of M elements (forward [M, N], dgrad [M, K], wgrad [N, K]), and in the wgrad, where M
    is the reduction, the tiles past M read zeros — so a batch of 4 × 2047 tokens is checked."""
    # fp32 on a GPU: tl.dot would round the operands to tf32, whose products are not exact, and
    # fp32 tiles do not fit the Hopper configuration.
    if t.device.type == "cuda" and t.dtype not in (torch.bfloat16, torch.float16):
        return f"{t.dtype} operands (the GPU kernels take bf16/fp16)"
    if not tg.tma_compatible(t):
        return f"an operand of shape {tuple(t.shape)} whose rows are not 16-byte aligned (TMA)"
    if is_weight and (t.shape[0] * t.element_size()) % 16:
        rows = t.shape[0]
        return f"a weight of shape {tuple(t.shape)}: output rows of {rows} elements are not 16-byte aligned (TMA)"
    return None


def row_sums(t: torch.Tensor) -> torch.Tensor:
    """t·1 in fp64 [rows] of a 2-D t, when no kernel produced it as a by-product (one pass over t; on
    the device a kernel of its own, kernels/row_sums.py: torch's fp64 sum first copies t to fp64)."""
    if _summable_on_device(t):
        return triton_row_sums(t)
    return t.sum(dim=1, dtype=torch.float64)


def column_sums(t: torch.Tensor) -> torch.Tensor:
    """1ᵀ·t in fp64 [columns] of a 2-D t (a column check's u1 = 1ᵀA): on the device in the weight-sums
    kernels' one pass (kernels/weight_sums.py, fixed order), for the same reason as `row_sums`."""
    if _summable_on_device(t):
        return weight_sides(t, sides=False)[0]
    return t.sum(dim=0, dtype=torch.float64)


def _summable_on_device(t: torch.Tensor) -> bool:
    """Whether the sums' kernels take t: on the device (or the interpreter), contiguous columns, and a
    16-byte aligned start — their compiled variants are reused by dtype alone (kernels/triton_gemm.py,
    `_Launcher`), and Triton compiles a pointer it sees aligned as always aligned."""
    return (
        (t.device.type == "cuda" or tg.INTERPRET)
        and t.dtype in tg._TL_DTYPES
        and t.stride(1) == 1
        and t.data_ptr() % 16 == 0
    )


def _fault_args(fault) -> tuple | None:
    """Kernel arguments of a fault whose element is resolved (row and col set)."""
    if fault is None:
        return None
    if fault.model == "perturb":
        return (tg.FAULT_PERTURB, fault.row, fault.col, float(fault.delta), 0)
    mask = -(2**31) if fault.bit == 31 else 1 << fault.bit
    return (tg.FAULT_BITFLIP, fault.row, fault.col, 0.0, mask)


@functools.lru_cache(maxsize=4096)
def _capture_layout(m: int, n: int, k: int, capture: int, cfg: tg.TritonGemmConfig) -> tuple[int, int]:
    return tg.CapturePool.layout(m, n, k, capture, cfg)


def run(
    sensor: Any,
    plan: Any,
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    *,
    a_t: bool,
    b_t: bool,
    bias: torch.Tensor | None,
    c_side: SideMatrix,
    u_side: SideMatrix | None,
    col_check: bool,
    counters: torch.Tensor,
    state: DeviceState,
    weight_stats=None,
    byproduct: Byproduct | None = None,
) -> tg.GemmLaunch:
    """One GEMM on the Triton kernel, checked if `plan` says so; the row side (A·c, and the by-product
    A·1, written into `byproduct` when given) always runs. A column check takes
    u1 = 1ᵀA's S when given (wgrad: dY·1), else computes it here (forward and dgrad: one pass over A,
    that option's price)."""
    m, n = out.shape
    k = a.shape[0] if a_t else a.shape[1]
    cfg = tg.config_for(m, n, k)
    check = plan is not None and plan.check
    col = check and col_check
    if col and u_side is None:
        u_side = SideMatrix.of(row_sums(a) if a_t else column_sums(a), a.dtype)
    fault = plan.fault if plan is not None else None
    if fault is not None:
        row, col_index = fault.element(m, n)
        fault = dataclasses.replace(fault, row=row, col=col_index)
        if plan.fault_needs_scale:
            # A perturb fault before the site knows its median clean difference: measure this call
            # first (one clean launch and a host read: fault-injection runs only).
            stats = torch.zeros(tg.STATS_LEN, dtype=torch.int64, device=a.device)
            tg.launch_checked_gemm(
                a, b, torch.empty_like(out), a_t=a_t, b_t=b_t, bias=bias, c_side=c_side,
                row_check=True, row_side=True, stats=stats, counters=counters, cfg=cfg,
            )  # fmt: skip
            clean_l2 = float(stats.view(torch.float64)[tg.ST_ROW_L2SQ]) ** 0.5
            fault = dataclasses.replace(fault, delta=fault.delta * clean_l2)
        plan.injection.fault = fault
    stats, stats_f64 = state.stats_slot(a.device) if check else (None, None)
    capture = tg.CAPTURE_NONE
    pool = None
    if check:
        # A column check localizes both coordinates: a tile. A row check captures the row block
        # against the whole of B (a forward's or dgrad's B is the weight, kept by reference).
        capture = tg.CAPTURE_TILE if col else tg.CAPTURE_ROWS
        data_len, f32_len = _capture_layout(m, n, k, capture, cfg)
        pool = state.pool(a.device, out.dtype, data_len, f32_len)
    thresholds = sensor.thresholds(m, k, n) if check else (float("inf"), float("inf"))
    result = tg.launch_checked_gemm(
        a,
        b,
        out,
        a_t=a_t,
        b_t=b_t,
        bias=bias,
        c_side=c_side,
        u_side=u_side if col else None,
        row_check=check,
        row_side=True,
        col_check=col,
        stats=stats,
        stats_f64=stats_f64,
        counters=counters,
        pool=pool,
        capture=capture,
        row_threshold=thresholds[0],
        col_threshold=thresholds[1],
        fault=_fault_args(fault),
        byproduct=byproduct.vec if byproduct is not None else None,
        byproduct_side=byproduct.matrix if byproduct is not None else None,
        cfg=cfg,
        scratch=True,
    )
    if plan is not None and plan.injection is not None and check:
        _measure_fault(plan.injection, a, b, out, a_t, b_t, bias, thresholds[0])
    if plan is not None:
        call = TritonGemmCall(
            a_t=a_t,
            b_t=b_t,
            m=m,
            n=n,
            k=k,
            dtype=out.dtype,
            cfg=cfg,
            capture_kind=capture,
            b=b if capture == tg.CAPTURE_ROWS else None,
            bias=bias,
            cvec=c_side.vec,
            u1=u_side.vec if col else None,
            c_side=c_side,
            u_side=u_side if col else None,
            pool=pool,
            fault=_fault_args(fault) if fault is not None and fault.affects_replay else None,
            weight_stats=weight_stats,
            pooled=True,  # the weight's sums and the by-products are reused next step: a capture copies them
        )
        sensor.observe_triton(plan, call, stats, thresholds)  # a checked call's: computed above
    return result


def _measure_fault(injection, a, b, out, a_t: bool, b_t: bool, bias, threshold: float) -> None:
    """An injected fault's size in its row's checksum unit, as the kernel normalizes the row (u·‖C_i‖,
    kernels/gemm_evidence.py), left on the device as a 0-d tensor: nothing waits (a campaign reads it
    after the step). The fault model is applied to the element's fp32 value recomputed in fp64 —
    the rounded output cannot show a change below its own rounding — and ‖C_i‖ is taken from the
    output row (within bf16's rounding of the accumulator's). Calls carrying an injected fault only."""
    fault = injection.fault
    i, j = fault.row, fault.col
    a_row = (a[:, i] if a_t else a[i]).double()
    b_col = (b[j] if b_t else b[:, j]).double()
    clean = (a_row @ b_col).float()
    delta = fault.corrupt(clean).double() - clean.double()
    row = out[i].double() - (bias.double() if bias is not None else 0.0)  # the kernel's norm is before the bias
    size = delta.abs() / (U32 * row.norm()).clamp_min(TINY)
    injection.size = torch.where(size.isnan(), float("inf"), size)  # a NaN accumulator: the largest fault
    injection.threshold = threshold
    injection.element = (i, j)
