"""The GEMM sensor: evidence from the checksums of one site, judged against the site's thresholds.

Per checked call the sensor reduces the kernel's checksums to one small evidence vector
(`evidence_stats`): the largest normalized row and column differences, where they are, the raw L2
norms, a non-finite flag, and the thresholds in force. A call whose evidence crosses a threshold
captures its replay context right away (the tensors it needs may be freed later in the step); the
region captured depends on which checksum crossed (see ops/gemm_replay.py).

On the reference path (CPU tensors) the comparison reads the evidence vector on the host: for a CPU
tensor that is a memory read, not a device synchronization. The GPU path makes the same decision on
the device. Either way the guard collects all evidence vectors of a step in one read at the end of
the step, where statistics, calibration and vTasks are made.
"""

from __future__ import annotations

import logging
import math
import statistics
import struct
from collections import deque
from dataclasses import dataclass

import torch

from aegis_sdc.config import ThresholdConfig
from aegis_sdc.events import Channel, Evidence, Site
from aegis_sdc.faults.injector import FaultInjector, Injection
from aegis_sdc.faults.models import AccumulatorFault
from aegis_sdc.kernels import triton_gemm as tg
from aegis_sdc.kernels.reference import TINY, U32, GemmChecksums
from aegis_sdc.ops.gemm_replay import GemmCapture, GemmOperands
from aegis_sdc.ops.triton_replay import TritonGemmCapture
from aegis_sdc.sensors.sampling import Sampler
from aegis_sdc.sensors.thresholds import ThresholdState, worst_case_bound

log = logging.getLogger("aegis_sdc")

# Layout of the per-call evidence vector (float64 so that row/column indices stay exact).
ROW_VALUE, ROW_INDEX, ROW_L2, COL_VALUE, COL_INDEX, COL_L2, NONFINITE, ROW_THRESHOLD, COL_THRESHOLD = range(9)
STATS_LEN = 9

# The median clean difference m that scales `perturb` faults follows training over this many recent
# clean checks: raw differences grow with the activations, so a value frozen at calibration would
# make "r × m" shrink relative to the noise as training goes on.
L2_WINDOW = 16
UNUSUAL_KEPT = 1024  # alarms on unusual data remembered until their verdict (more than any backlog)

# Clean samples: at most one per site in each window of this many steps (none in the first window,
# where thresholds calibrate), and at most this many per guard — enough to screen a device's
# arithmetic on the run's own shapes and values, a few MB of files at most.
CLEAN_SAMPLE_EVERY = 500
MAX_CLEAN_SAMPLES = 64


def _measure_fault(injection: Injection, operands: GemmOperands, result: GemmChecksums, threshold: float) -> None:
    """The injected fault's size in its row's checksum unit (see `Injection.size`): its element
    recomputed in fp64 against the value the call produced — the fp32 accumulation's own error is
    within the row's clean noise. A call with a fault only (rare), on the host's own tensors."""
    m, n = result.out.shape
    if not m or not n:
        return
    i, j = injection.fault.element(m, n)
    clean = float(operands.a[i].double() @ operands.b[:, j].double())
    if operands.bias is not None:
        clean += float(operands.bias[j])
    delta = float(result.out[i, j]) - clean
    injection.size = abs(delta) / max(U32 * float(result.row_scale[i]), TINY)
    injection.threshold = threshold
    injection.element = (i, j)


def evidence_stats(result: GemmChecksums, row_threshold: float, col_threshold: float) -> torch.Tensor:
    """[STATS_LEN] float64 on the device (layout above)."""
    d_row = (result.row_sum - result.row_ref).abs()  # [M]
    row_norm = d_row / (U32 * result.row_scale).clamp_min(TINY)
    row_value, row_index = row_norm.max(dim=0)  # NaN propagates: a NaN row is the maximum
    finite = torch.isfinite(result.row_sum).all() & torch.isfinite(result.row_ref).all()
    zero = torch.zeros((), dtype=torch.float64, device=d_row.device)
    parts = [row_value.double(), row_index.double(), d_row.double().norm()]
    if result.col_sum is not None:
        d_col = (result.col_sum - result.col_ref).abs()  # [N]
        col_norm = d_col / (U32 * result.col_scale).clamp_min(TINY)
        col_value, col_index = col_norm.max(dim=0)
        finite = finite & torch.isfinite(result.col_sum).all() & torch.isfinite(result.col_ref).all()
        parts += [col_value.double(), col_index.double(), d_col.double().norm()]
    else:
        parts += [zero, zero, zero]
    parts += [(~finite).double(), zero + row_threshold, zero + col_threshold]
    return torch.stack(parts)


def _exceeds(value: float, threshold: float) -> bool:
    return value > threshold or math.isnan(value)


class CleanSampler:
    """Which clean checked calls keep one tile's replay context (shared by a guard's sensors). Decided
    from the step and the site id alone, so unsampled calls pay one integer comparison."""

    def __init__(self, every: int | None = None, limit: int | None = None) -> None:
        self.every = max(1, CLEAN_SAMPLE_EVERY if every is None else every)  # read at construction
        self.limit = MAX_CLEAN_SAMPLES if limit is None else limit
        self.taken = 0
        self._window: dict[int, int] = {}  # site id → the last window it was sampled in

    def due(self, site_id: int, step: int) -> bool:
        window = step // self.every
        return self.taken < self.limit and window >= 1 and self._window.get(site_id, 0) < window

    def take(self, site_id: int, step: int) -> None:
        self._window[site_id] = step // self.every
        self.taken += 1


class StepClock:
    """The training step as the guard counts it; shared by every sensor."""

    def __init__(self) -> None:
        self.step = 0


@dataclass
class CallPlan:
    site: Site
    step: int
    call: int  # index of this call of the site within the step
    check: bool  # run the checked kernel and record evidence
    col_check: bool
    injection: Injection | None  # the fault injected into this call's accumulator, if any
    fault_needs_scale: bool = False  # perturb fault before the site knows its median difference
    silent: bool = False  # a recomputation replaying a forward plan: same path, nothing recorded

    @property
    def fault(self) -> AccumulatorFault | None:
        return None if self.injection is None else self.injection.fault


@dataclass
class CallRecord:
    sensor: GemmSensor
    plan: CallPlan
    stats: torch.Tensor | None  # [STATS_LEN] float64 (reference path)
    capture: object | None  # the replay context, when the call crossed a threshold
    alarm: bool = False
    raw: torch.Tensor | None = None  # Triton path: the kernel's int64 evidence slot, decoded at step end
    triton_call: object | None = None
    thresholds: tuple[float, float] = (math.inf, math.inf)
    clean: GemmCapture | None = None  # a clean sample's tile (CleanSampler), written at the step's end
    shape: tuple[int, int, int] | None = None  # the call's (M, K, N), for the site's calibration (`thresholds`)

    def finish_triton(self, raw: list[int]) -> list[float]:
        """Decode the kernel's evidence slot and, on an alarm, take the capture out of the pool."""
        stats = decode_triton_stats(raw, *self.thresholds)
        self.alarm = raw[tg.ST_ALARM] != 0
        if self.alarm and raw[tg.ST_SLOT] > 0:
            self.capture = TritonGemmCapture(
                self.triton_call.kept(), int(raw[tg.ST_SLOT]) - 1, int(stats[ROW_INDEX]), int(stats[COL_INDEX])
            )
        self.triton_call = None  # release the references to operands and pools
        return stats


def _grown(size: float, reference: float, law) -> float:
    """How much a check's clean values grow from a call of `reference` to one of `size` under `law`
    (√ for the terms each element sums, √ln for the rows a maximum is taken over); 1 when not larger."""
    return law(size) / law(reference) if size > reference >= 1 else 1.0


def _root_log(size: float) -> float:
    return math.sqrt(math.log(max(size, 2.0)))  # (a maximum over one row is that row: as over two)


def _float_of_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def decode_triton_stats(raw: list[int], row_threshold: float, col_threshold: float) -> list[float]:
    """The Triton kernel's packed evidence slot → the reference path's evidence layout."""
    l2 = struct.unpack("<2d", struct.pack("<2q", raw[tg.ST_ROW_L2SQ], raw[tg.ST_COL_L2SQ]))
    row_value = _float_of_bits(raw[tg.ST_ROW] >> 32)
    col_value = _float_of_bits(raw[tg.ST_COL] >> 32)
    return [
        row_value,
        float(raw[tg.ST_ROW] & 0xFFFFFFFF),
        math.sqrt(max(l2[0], 0.0)),
        col_value,
        float(raw[tg.ST_COL] & 0xFFFFFFFF),
        math.sqrt(max(l2[1], 0.0)),
        float(raw[tg.ST_NONFINITE] > 0),
        row_threshold,
        col_threshold,
    ]


@dataclass
class SiteStepStats:
    """What one site did during one step (one row of the store's step_stats table)."""

    calls: int = 0
    checks: int = 0
    alarms: int = 0
    faults: int = 0
    nonfinite: int = 0
    max_row: float = 0.0
    max_col: float = 0.0
    # the thresholds those maxima were checked against (a call larger than the calibration's shape
    # has larger ones: GemmSensor.thresholds); None: the site's current thresholds
    row_limit: float | None = None
    col_limit: float | None = None


class GemmSensor:
    """Sensor of one site (one GEMM of one Linear)."""

    def __init__(
        self,
        site: Site,
        *,
        col_check: bool,
        thresholds: ThresholdConfig,
        sampler: Sampler,
        injector: FaultInjector,
        clock: StepClock,
        recorder: list[CallRecord],
        clean: CleanSampler | None = None,
    ) -> None:
        self.site = site
        self.clean = clean
        self.col_check = col_check
        self.probability = sampler.probability_for(site.name)  # the step plan draws with it
        self.injector = injector
        self.clock = clock
        self.recorder = recorder
        self.row = ThresholdState(thresholds, math.inf)
        self.col = ThresholdState(thresholds, math.inf)
        self._clean_l2: deque[float] = deque(maxlen=L2_WINDOW)
        self._calibration_checks = thresholds.calibration_checks
        self._data_outlier_factor = thresholds.data_outlier_factor
        # (step, call) of alarms on unusual data, until their verdict; insertion-ordered and bounded
        # (alarms that end otherwise than as false alarms are never looked up again)
        self._unusual_data: dict[tuple[int, int], None] = {}
        self.data_false_alarms = 0  # false alarms that left the thresholds alone (see on_false_alarm)
        self.step_stats = SiteStepStats()
        self.flops = 0.0  # 2·M·N·K of the last call seen (checked): the site's weight in FLOP coverage
        self.shape: tuple[int, int, int] | None = None  # (M, K, N) of that call
        self._calibration_shapes: list[tuple[int, int, int]] = []  # (M, K, N) of the calls calibrated on
        self.reference_shape: tuple[float, float, float] | None = None  # their medians, once calibrated
        self.dtype: torch.dtype | None = None  # and its operands' dtype, and whether Triton ran it
        self.triton = False
        # Under FSDP2 the unsharded weight a capture would reference is freed after the module has
        # run (resharding), before the step's verification: captures then copy it (Guard.attach_fsdp).
        self.copy_referenced = False

    @property
    def median_l2(self) -> float | None:
        """Median raw ‖C·1 − A·(B·1)‖₂ over recent clean checks (None until calibrated)."""
        if len(self._clean_l2) < min(self._calibration_checks, L2_WINDOW):
            return None
        return statistics.median(self._clean_l2)

    # -- hot path ---------------------------------------------------------------------------------
    def plan(self, call: int, sampled: bool) -> CallPlan | None:
        """The plan of call `call` of this site in the current step; `sampled` is the step plan's
        draw (runtime/plan.py). None: the GEMM runs unchecked and nothing is recorded."""
        step = self.clock.step
        injection = self.injector.fire(self.site, step, call, self.median_l2) if self.injector else None
        check = sampled or self.row.calibrating
        if injection is not None:
            self.step_stats.faults += 1
        if not check and injection is None:
            return None
        needs_scale = injection is not None and injection.fault.model == "perturb" and self.median_l2 is None
        return CallPlan(self.site, step, call, check, self.col_check, injection, needs_scale)

    def thresholds(self, m: int, k: int, n: int) -> tuple[float, float]:
        """The thresholds in force for a call of shape C[M, N] = A[M, K]·B[K, N].

        A site whose shape changes from call to call — a wgrad over a varying number of tokens, a
        mixture of experts' expert (its tokens are what the router sends it) — sees its clean values
        grow with it: each accumulator element sums K rounded products (about √K on the CPU's BLAS
        up to K ≈ 128, slower beyond; measured 1.1 units at K = 1, 8.6 at 128, 15 at 2048), and a
        check's value is the largest of M rows (N columns), which grows like √(2 ln M). Calibrated
        on calls of median shape, a larger call gets its thresholds times √(K / K₀) and
        √(ln M / ln M₀) (√(ln N / ln N₀) for columns) — never less than calibrated: a site of fixed
        shape keeps them as they are (a Qwen3-MoE of 128 experts, 4 layers, CPU, 40 steps: 171 false
        alarms in 104 310 checks without, 3 with; another seed 0 in 107 154)."""
        if self.shape != (m, k, n):
            self.shape, self.flops = (m, k, n), 2.0 * m * k * n
        if self.row.hard_bound == math.inf:  # first call: the exact worst case guards calibration
            self.row.hard_bound = self.row.current = worst_case_bound(k, n)
            self.col.hard_bound = self.col.current = worst_case_bound(k, m)
        ref = self.reference_shape
        if ref is None:
            return self.row.current, (self.col.current if self.col_check else math.inf)
        longer = _grown(k, ref[1], math.sqrt)
        return (self.row.current * longer * _grown(m, ref[0], _root_log),
                self.col.current * longer * _grown(n, ref[2], _root_log) if self.col_check else math.inf)  # fmt: skip

    def _executed(self, plan: CallPlan) -> bool:
        """Record a planned fault as applied; True when the call was checked."""
        if plan.silent:
            return False
        if plan.injection is not None:
            self.injector.applied(plan.injection)
        if plan.check:
            self.step_stats.checks += 1
        return plan.check

    def observe(self, plan: CallPlan, operands: GemmOperands, result: GemmChecksums) -> None:
        if not self._executed(plan):
            return  # a fault fired on an unsampled call: it corrupts training unseen
        self.dtype, self.triton = operands.a.dtype, False
        m, k = operands.a.shape
        thresholds = self.thresholds(m, k, operands.b.shape[1])
        if plan.injection is not None:
            _measure_fault(plan.injection, operands, result, thresholds[0])
        stats = evidence_stats(result, *thresholds)
        capture = self._capture_if_alarmed(stats, operands, result, plan)
        record = CallRecord(self, plan, stats, capture, alarm=capture is not None, shape=self.shape)
        # a call carrying an injected fault computed values no healthy device reproduces: never a sample
        sampled = self.clean is not None and self.clean.due(self.site.id, plan.step)
        if sampled and capture is None and plan.injection is None:
            record.clean = self._clean_capture(operands, result, plan)
        self.recorder.append(record)

    def _clean_capture(self, operands: GemmOperands, result: GemmChecksums, plan: CallPlan) -> GemmCapture | None:
        """One tile of a clean call (both slabs copied, nothing referenced); the tile moves with the
        step so that a site's samples cover different parts of its output."""
        m, n, tiling = operands.a.shape[0], operands.b.shape[1], operands.tiling
        if m == 0 or n == 0:
            return None
        tiles_n = -(-n // tiling.cols)
        pick = (self.site.id * 1_000_003 + plan.step) % (-(-m // tiling.rows) * tiles_n)
        try:
            capture = GemmCapture(operands, result, extent="tile", row_index=(pick // tiles_n) * tiling.rows,
                                  col_index=(pick % tiles_n) * tiling.cols)  # fmt: skip
        except Exception:  # a sample is optional: out of memory here must not end the step
            log.exception("aegis-sdc: the clean sample of %s at step %d could not be taken", self.site.name, plan.step)
            return None
        self.clean.take(self.site.id, plan.step)
        return capture

    def observe_triton(self, plan: CallPlan, call, raw: torch.Tensor | None, thresholds: tuple[float, float]) -> None:
        """A Triton launch planned by this sensor (`thresholds`: those it ran with); its evidence stays
        on the device until step end."""
        if not self._executed(plan):
            return
        self.triton = True
        if call is not None:
            self.dtype = call.dtype
        if self.copy_referenced and call is not None:
            # Whether the call alarms is known at the step's end, after FSDP2 has freed the weight:
            # keep a copy of what a rows capture would reference (one pass over the weight per check).
            call.b = None if call.b is None else call.b.clone()
            call.bias = None if call.bias is None else call.bias.clone()
        # self.shape: set by `thresholds` for this very call
        self.recorder.append(CallRecord(self, plan, None, None, raw=raw, triton_call=call, thresholds=thresholds,
                                        shape=self.shape))  # fmt: skip

    def _capture_if_alarmed(
        self, stats: torch.Tensor, operands: GemmOperands, result: GemmChecksums, plan: CallPlan
    ) -> GemmCapture | None:
        s = stats.tolist()  # reference path: a CPU read (see the module docstring)
        row_alarm = s[NONFINITE] > 0 or _exceeds(s[ROW_VALUE], s[ROW_THRESHOLD])
        col_alarm = self.col_check and _exceeds(s[COL_VALUE], s[COL_THRESHOLD])
        if not (row_alarm or col_alarm):
            return None
        extent = "tile" if row_alarm and col_alarm and s[NONFINITE] == 0 else ("rows" if row_alarm else "cols")
        return GemmCapture(
            operands,
            result,
            extent=extent,
            row_index=int(s[ROW_INDEX]),
            col_index=int(s[COL_INDEX]),
            fault=plan.fault,
            copy_whole=self.copy_referenced,
        )

    # -- step end: host side ----------------------------------------------------------------------
    def judge(self, record: CallRecord, stats: list[float]) -> Evidence | None:
        """Update statistics and calibration; the Evidence if the call alarmed."""
        row_value, col_value = stats[ROW_VALUE], stats[COL_VALUE]
        st = self.step_stats
        if not record.alarm:
            if row_value >= st.max_row:
                st.max_row, st.row_limit = row_value, stats[ROW_THRESHOLD]
            if col_value >= st.max_col:
                st.max_col, st.col_limit = col_value, stats[COL_THRESHOLD]
            if self.row.calibrating and record.shape is not None:
                self._calibration_shapes.append(record.shape)
            self.row.observe_clean(row_value)
            if self.reference_shape is None and not self.row.calibrating and self._calibration_shapes:
                m, k, n = (float(statistics.median(dim)) for dim in zip(*self._calibration_shapes, strict=True))
                self.reference_shape = (m, k, n)  # (`thresholds`)
            if self.col_check:
                self.col.observe_clean(col_value)
            self._clean_l2.append(stats[ROW_L2])
            return None
        st.alarms += 1
        if self._unusual(stats):
            if len(self._unusual_data) >= UNUSUAL_KEPT:
                del self._unusual_data[next(iter(self._unusual_data))]
            self._unusual_data[(record.plan.step, record.plan.call)] = None
        over = tuple(
            channel
            for channel, value, threshold in (
                (Channel.ROW, row_value, stats[ROW_THRESHOLD]),
                (Channel.COL, col_value, stats[COL_THRESHOLD]),
            )
            if _exceeds(value, threshold)
        )
        if stats[NONFINITE] > 0 or math.isnan(row_value) or math.isnan(col_value):
            st.nonfinite += 1
            channel, value, threshold, index, l2 = (
                Channel.NONFINITE,
                row_value,
                stats[ROW_THRESHOLD],
                stats[ROW_INDEX],
                stats[ROW_L2],
            )
        else:
            st.max_row = max(st.max_row, row_value)
            st.max_col = max(st.max_col, col_value)
            if _exceeds(row_value, stats[ROW_THRESHOLD]):
                channel, value, threshold, index, l2 = (
                    Channel.ROW,
                    row_value,
                    stats[ROW_THRESHOLD],
                    stats[ROW_INDEX],
                    stats[ROW_L2],
                )
            else:
                channel, value, threshold, index, l2 = (
                    Channel.COL,
                    col_value,
                    stats[COL_THRESHOLD],
                    stats[COL_INDEX],
                    stats[COL_L2],
                )
        return Evidence(
            site=self.site,
            step=record.plan.step,
            call=record.plan.call,
            channel=channel,
            value=value,
            threshold=threshold,
            index=int(index),
            raw_l2=l2,
            tile=record.capture.region if record.capture is not None else None,
            channels=over or (channel,),
        )

    def _unusual(self, stats: list[float]) -> bool:
        """Whether a call's data lies far outside the site's recent clean calls (raw difference
        more than `data_outlier_factor` away from their median), or its checksums are not finite."""
        if stats[NONFINITE] > 0 or not all(math.isfinite(stats[i]) for i in (ROW_VALUE, COL_VALUE, ROW_L2)):
            return True
        median = self.median_l2
        if median is None or median <= 0.0:
            return False
        ratio = stats[ROW_L2] / median
        return not (1.0 / self._data_outlier_factor <= ratio <= self._data_outlier_factor)

    def on_false_alarm(self, evidence: Evidence) -> None:
        """The replay reproduced every bit: widen each threshold the call crossed — unless the call's
        data was unusual (`_unusual`): one extreme batch says nothing about the site's noise, and
        the threshold must not pay for it (it would stay blind for the next relax window)."""
        key = (evidence.step, evidence.call)
        if key in self._unusual_data:
            del self._unusual_data[key]
            self.data_false_alarms += 1
            return
        if Channel.ROW in evidence.channels:
            self.row.on_false_alarm(evidence.value if evidence.channel is Channel.ROW else self.row.current)
        if Channel.COL in evidence.channels:
            self.col.on_false_alarm(evidence.value if evidence.channel is Channel.COL else self.col.current)

    def take_step_stats(self) -> SiteStepStats:
        stats, self.step_stats = self.step_stats, SiteStepStats()
        return stats
