"""`aegis screen`: a health verdict on one device, for a scheduler's node check (Slurm, Kubernetes).

Two kinds of work, both on the device screened and with the code training runs there:

1. Synthetic sweeps. Every GEMM of a model's Linears (forward, dgrad and wgrad of each distinct
   shape, `tokens` rows) on operands drawn from a fixed seed, the A operand scaled by each of
   `scales` (faulty units have been seen to corrupt only some ranges of values), runs through the
   checked GEMM of that device: the fused Triton kernel in bf16 on CUDA, the reference path
   (kernels/reference.py) in fp32 on the CPU. Per case: the 64-bit fingerprints of the output and
   of the per-tile accumulator partials (kernels/fingerprint.py), the kernel's own checksum
   statistic against the exact worst-case bound of a correct fp32 execution
   (sensors/thresholds.worst_case_bound: no calibration, so any value above it is wrong on every
   device), and the time. Each case runs `repeats` times: the kernels fix their reduction order, so
   two runs on the same inputs must agree bit for bit.
2. Evidence replays. Each evidence file given (RUN_DIR/evidence/*.json) is re-executed by
   response/replay.replay_evidence and counted right, wrong or other. Clean samples (clean checked
   tiles the run kept, ``"clean": true``) name the kind of device and software that computed them;
   on the same kind (`EVIDENCE_KIND_KEYS`, the reference's rule) they are replayed and counted right
   (reproduced bit for bit) or differs; from another kind they are uncompared, not replayed.

A reference (`write_reference`) holds the cases' fingerprints from a healthy device, with what the
bits depend on: the device's name, torch, Triton and CUDA versions, the path, dtype and kernel
configuration. Screening `against` it compares bit for bit, when all of those are equal.

Verdict:
    FAIL           a checksum crossed the exact bound or was not finite; two runs of a case
                   differed; a case differs from a comparable reference; an evidence replay
                   reproduced the wrong values; a comparable clean sample was not reproduced bit
                   for bit
    INCONCLUSIVE   nothing failed, but a reference was given that cannot be compared bit for bit
                   (another kind of device or software), or an evidence replay computed something
                   that is neither the right nor the wrong values, or a clean sample came from
                   another kind of device or software
    PASS           otherwise
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from aegis_sdc.faults.models import AccumulatorFault, FaultSpec, resolve
from aegis_sdc.kernels.fingerprint import ROW, fingerprint_into, fingerprint_reference, lanes_to_int
from aegis_sdc.kernels.numerics import exact_fp32
from aegis_sdc.kernels.reference import Tiling, checked_gemm
from aegis_sdc.response.evidence import EvidenceError, load_evidence
from aegis_sdc.response.replay import EXIT_RIGHT, EXIT_WRONG, replay_evidence
from aegis_sdc.sensors.gemm import COL_VALUE, NONFINITE, ROW_L2, ROW_VALUE, decode_triton_stats, evidence_stats
from aegis_sdc.sensors.thresholds import worst_case_bound

FORMAT = "aegis-sdc-screen-reference"
VERSION = 2  # 2: fingerprints by function 2 (kernels/fingerprint.FUNCTION); record a version-1 reference again
PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
EXIT_PASS, EXIT_ERROR, EXIT_FAIL, EXIT_INCONCLUSIVE = 0, 2, 3, 4
TRITON, REFERENCE = "gemm-triton", "gemm-reference"
KINDS = ("fwd", "dgrad", "wgrad")
DEFAULT_SCALES = (1e-3, 1.0, 1e3)
DEFAULT_TOKENS = 2048  # rows of every GEMM: the TinyLlama screen takes seconds on an H200
SEED = 0
REPLAY_TIMES = 3

# model → {layer: (in_features, out_features)}, one entry per distinct Linear shape
MODELS: dict[str, dict[str, tuple[int, int]]] = {
    # hidden 2048, 32 query / 4 key-value heads of 64, SwiGLU 5632, vocabulary 32000
    "tinyllama": {"q_o": (2048, 2048), "k_v": (2048, 256), "gate_up": (2048, 5632), "down": (5632, 2048),
                  "lm_head": (2048, 32000)},
    # hidden 4096, 32 query / 8 key-value heads of 128, SwiGLU 14336, vocabulary 128256
    "llama3-8b": {"q_o": (4096, 4096), "k_v": (4096, 1024), "gate_up": (4096, 14336), "down": (14336, 4096),
                  "lm_head": (4096, 128256)},
}  # fmt: skip
# What a case's bits depend on besides its inputs: a reference differing in any is not compared.
KIND_KEYS = ("device", "path", "dtype", "torch", "triton", "cuda", "kernel", "threads")
# The same for evidence: it carries its own tile configuration and is replayed with it, so the
# kernel table of the screened device is not what its bits depend on.
EVIDENCE_KIND_KEYS = tuple(key for key in KIND_KEYS if key != "kernel")


class ScreenError(Exception):
    """A screen that cannot run as asked: a bad option, an unusable reference or evidence file."""


# -- the cases -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One GEMM C[M, N] = A[M, K]·B[K, N] of a Linear (in_features, out_features) at `tokens` rows:

    fwd    Y  = X·Wᵀ     M = tokens, K = in,     N = out
    dgrad  dX = dY·W     M = tokens, K = out,    N = in
    wgrad  dW = dYᵀ·X    M = out,    K = tokens, N = in    (with the column check, as in training)
    """

    layer: str
    kind: str
    in_features: int
    out_features: int
    tokens: int
    scale: float
    site_id: int  # the (layer, kind)'s index: what an injected fault's draw is keyed to
    call: int  # the scale's index: the case is call `call` of its site at step 0

    @property
    def site(self) -> str:
        return f"{self.layer}:{self.kind}"

    @property
    def name(self) -> str:
        return f"{self.site}@scale={self.scale:g}"

    @property
    def shape(self) -> tuple[int, int, int]:
        t, i, o = self.tokens, self.in_features, self.out_features
        return {"fwd": (t, i, o), "dgrad": (t, o, i), "wgrad": (o, t, i)}[self.kind]


def parse_shapes(text: str) -> dict[str, tuple[int, int]]:
    """A model's name (`MODELS`) or Linear shapes `INxOUT[,INxOUT...]` (each named by itself)."""
    if text in MODELS:
        return dict(MODELS[text])
    table = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            k, n = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise ScreenError(f"--shapes: {item!r} is neither a model ({', '.join(MODELS)}) nor INxOUT") from None
        if k < 1 or n < 1:
            raise ScreenError(f"--shapes: {item!r} has an empty dimension")
        table[f"{k}x{n}"] = (k, n)
    if not table:
        raise ScreenError(f"--shapes: nothing to screen in {text!r}")
    return table


def parse_scales(text: str) -> tuple[float, ...]:
    try:
        scales = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ScreenError(f"--scales: expected numbers separated by commas, got {text!r}") from None
    if not all(math.isfinite(s) and s > 0 for s in scales):
        raise ScreenError(f"--scales: each scale must be a finite number > 0, got {text!r}")
    return scales


def make_cases(table: dict[str, tuple[int, int]], tokens: int, scales: Sequence[float]) -> list[Case]:
    sites = [(layer, kind) for layer in table for kind in KINDS]
    return [Case(layer, kind, *table[layer], tokens, scale, site_id, call)
            for site_id, (layer, kind) in enumerate(sites) for call, scale in enumerate(scales)]  # fmt: skip


# -- the device, and what a case's bits depend on --------------------------------------------------


def device_env(device: torch.device, path: str, dtype: torch.dtype) -> dict[str, Any]:
    """The device's name and the software and configuration its results' bits depend on."""
    import triton

    from aegis_sdc.distributed.identity import gpu_uuid
    from aegis_sdc.kernels import triton_gemm as tg

    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"
    else:
        name = _cpu_name()
    if path == TRITON:
        configs = {"interpreter": dataclasses.asdict(tg.INTERPRETER_CONFIG)} if tg.INTERPRET else {
            cls: dataclasses.asdict(cfg) for cls, cfg in tg.HOPPER_TABLE.items()}  # fmt: skip
        kernel = {"configs": configs}
    else:
        kernel = {"tiling": dataclasses.asdict(Tiling())}
    return {
        "device": name,
        "gpu_uuid": gpu_uuid(device),  # which device: not part of its kind
        "path": path,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "triton": triton.__version__ if path == TRITON else None,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "kernel": kernel,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,  # a CPU BLAS may split by threads
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"cpu {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"cpu {platform.machine()} {platform.processor()}".strip()


# -- one case --------------------------------------------------------------------------------------


@dataclass
class Execution:
    """What one run of a case computed."""

    out: int  # fingerprint of C [M, N]
    partials: tuple[int, ...]  # fingerprints of the accumulator's per-tile row (and column) sums
    row: float  # the largest normalized row difference |C·1 − A·(B·1)| / (u·scale)
    col: float | None  # the same for columns (wgrad)
    l2: float  # ‖C·1 − A·(B·1)‖₂: what a perturb fault is scaled by
    nonfinite: bool
    alarm: bool
    seconds: float


@dataclass
class CaseResult:
    name: str
    site: str
    shape: tuple[int, int, int]  # (M, K, N)
    scale: float
    out: str  # fingerprint, 16 hex digits
    partials: list[str]
    row: float
    row_bound: float
    col: float | None
    col_bound: float | None
    alarm: bool  # the checksum check crossed the exact bound, or was not finite
    runs_agree: bool  # every run computed the same bits
    ms: float  # the fastest run
    faulted: bool = False  # an injected fault struck this case
    reference: str | None = None  # "same", "differs" or None (not compared)

    def failures(self) -> list[str]:
        found = []
        if self.alarm:
            cols = "" if self.col is None else f", column {self.col:.3g} (bound {self.col_bound:.3g})"
            found.append(f"checksum: row {self.row:.3g} (bound {self.row_bound:.3g}){cols}")
        if not self.runs_agree:
            found.append("two runs on the same inputs computed different bits")
        if self.reference == "differs":
            found.append("differs from the reference bit for bit")
        return found


def _operands(case: Case, device: torch.device, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """(a, b, a_t, b_t) stored as the training step holds them (ops/triton_linear.py): fwd a = X [M, K],
    b = W [N, K]; dgrad a = dY [M, K], b = W [K, N]; wgrad a = dY [K, M] (Aᵀ), b = X [K, N].
    A ~ scale·N(0, 1); B ~ N(0, 1/K), so C's values are about `scale`."""
    m, k, n = case.shape
    g = torch.Generator(device).manual_seed(seed * 1_000_003 + case.site_id)
    a_shape, b_shape, a_t, b_t = {"fwd": ((m, k), (n, k), False, True), "dgrad": ((m, k), (k, n), False, False),
                                  "wgrad": ((k, m), (k, n), True, False)}[case.kind]  # fmt: skip
    a = torch.randn(a_shape, generator=g, device=device)
    b = torch.randn(b_shape, generator=g, device=device) / math.sqrt(k)
    return (a * case.scale).to(dtype), b.to(dtype), a_t, b_t


def _fingerprints(tensors: list[torch.Tensor]) -> list[int]:
    if tensors[0].device.type != "cuda":
        return [fingerprint_reference(t) for t in tensors]
    rows = torch.zeros(len(tensors), ROW, dtype=torch.int32, device=tensors[0].device)
    fingerprint_into([(t, i) for i, t in enumerate(tensors)], rows)
    return [lanes_to_int(row) for row in rows.cpu()]


def _run_reference(case: Case, operands: tuple, fault: AccumulatorFault | None, bounds: tuple[float, float]):
    a, b, a_t, b_t = operands
    col = case.kind == "wgrad"
    start = time.perf_counter()
    result = checked_gemm(a.t() if a_t else a, b.t() if b_t else b, out_dtype=a.dtype, col_check=col, fault=fault)
    seconds = time.perf_counter() - start
    s = evidence_stats(result, *bounds).tolist()  # the sensor judges these on the host (sensors/gemm.py)
    partials = [result.row_partials] + ([result.col_partials] if col else [])
    return result.out, partials, s, False, seconds


def _run_triton(case: Case, operands: tuple, fault: AccumulatorFault | None, bounds: tuple[float, float]):
    from aegis_sdc.kernels import triton_gemm as tg
    from aegis_sdc.ops.triton_linear import Byproduct, DeviceState, _fault_args

    a, b, a_t, b_t = operands
    m, k, n = case.shape
    col = case.kind == "wgrad"
    big_a, big_b = (a.t() if a_t else a), (b.t() if b_t else b)  # logical A [M, K], B [K, N]
    cfg = tg.config_for(m, n, k)
    if fault is not None:
        row, column = fault.element(m, n)
        fault = dataclasses.replace(fault, row=row, col=column)
    stats = torch.zeros(tg.STATS_LEN, dtype=torch.int64, device=a.device)
    counters = torch.zeros(tg.counters_needed(m, n, cfg), dtype=torch.int32, device=a.device)
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    cvec = big_b.double().sum(dim=1)  # B·1 [K]: what the row check's reference side multiplies
    u1 = big_a.double().sum(dim=0) if col else None  # 1ᵀA [K]: the column check's
    # The variant training compiles (ops/checked_linear.py): a forward or dgrad leaves A·1 [M] (and
    # its S [M, 16] for bf16) for a later wgrad and captures rows on an alarm; a wgrad captures a tile.
    capture = tg.CAPTURE_TILE if col else tg.CAPTURE_ROWS
    pool = tg.CapturePool.allocate(DeviceState.pool_slots, *tg.CapturePool.layout(m, n, k, capture, cfg), a.dtype,
                                   a.device)  # fmt: skip
    byproduct = None if col else Byproduct.empty(m, a.dtype, a.device)
    _synchronize(a.device)
    start = time.perf_counter()
    launch = tg.launch_checked_gemm(
        a, b, out, a_t=a_t, b_t=b_t, cvec=cvec, u1=u1, row_check=True, row_side=True, col_check=col, stats=stats,
        counters=counters, pool=pool, capture=capture, row_threshold=bounds[0], col_threshold=bounds[1],
        fault=_fault_args(fault), byproduct=None if col else byproduct.vec,
        byproduct_side=None if col else byproduct.matrix, cfg=cfg,
    )  # fmt: skip
    _synchronize(a.device)
    seconds = time.perf_counter() - start
    raw = stats.tolist()
    partials = [launch.row_part] + ([launch.col_part] if col else [])
    return out, partials, decode_triton_stats(raw, *bounds), raw[tg.ST_ALARM] != 0, seconds  # the kernel's verdict


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _execute(case: Case, path: str, operands: tuple, fault: AccumulatorFault | None) -> Execution:
    m, k, n = case.shape
    col = case.kind == "wgrad"
    bounds = (worst_case_bound(k, n), worst_case_bound(k, m) if col else math.inf)
    run = _run_triton if path == TRITON else _run_reference
    out, partials, s, kernel_alarm, seconds = run(case, operands, fault, bounds)
    nonfinite = s[NONFINITE] > 0 or math.isnan(s[ROW_VALUE]) or (col and math.isnan(s[COL_VALUE]))
    alarm = kernel_alarm or nonfinite or s[ROW_VALUE] > bounds[0] or (col and s[COL_VALUE] > bounds[1])
    fps = _fingerprints([out, *partials])
    return Execution(fps[0], tuple(fps[1:]), s[ROW_VALUE], s[COL_VALUE] if col else None, s[ROW_L2], nonfinite,
                     bool(alarm), seconds)  # fmt: skip


def _fault_for(case: Case, spec: FaultSpec | None, path: str, operands: tuple) -> AccumulatorFault | None:
    """The fault `spec` puts into this case (the screen is step 0; the case is call `case.call` of its
    site): a perturb is scaled by the case's own clean difference, measured by a clean run first."""
    if spec is None or not spec.matches(case.site) or not spec.fires(case.site_id, 0, case.call):
        return None
    l2 = _execute(case, path, operands, None).l2 if spec.model == "perturb" else 1.0
    return resolve(spec, case.site_id, 0, case.call, l2)


def run_case(case: Case, device: torch.device, path: str, dtype: torch.dtype, seed: int = SEED,
             repeats: int = 2, fault: FaultSpec | None = None) -> CaseResult:  # fmt: skip
    """Run one case `repeats` times on `device`."""
    operands = _operands(case, device, dtype, seed)
    with exact_fp32(device.type):
        accumulator = _fault_for(case, fault, path, operands)
        runs = [_execute(case, path, operands, accumulator) for _ in range(repeats)]
    first = runs[0]
    m, k, n = case.shape
    col = case.kind == "wgrad"
    return CaseResult(
        case.name, case.site, case.shape, case.scale, f"{first.out:016x}", [f"{p:016x}" for p in first.partials],
        max(r.row for r in runs), worst_case_bound(k, n), max(r.col for r in runs) if col else None,
        worst_case_bound(k, m) if col else None, any(r.alarm for r in runs),
        all((r.out, r.partials) == (first.out, first.partials) for r in runs), 1e3 * min(r.seconds for r in runs),
        faulted=accumulator is not None,
    )  # fmt: skip


# -- evidence --------------------------------------------------------------------------------------


def evidence_files(paths: Iterable[str | Path]) -> list[Path]:
    """Evidence JSON files: a run directory's `evidence/*.json`, a directory's `*.json`, or files."""
    found: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            folder = path / "evidence" if (path / "evidence").is_dir() else path
            found += sorted(folder.glob("*.json"))
        elif path.exists():
            found.append(path.with_suffix(".json") if path.suffix == ".safetensors" else path)
        else:
            raise ScreenError(f"{path}: no such file or directory")
    return list(dict.fromkeys(found))


def replay_all(files: Iterable[Path], device: torch.device, fault: FaultSpec | None) -> list[dict[str, Any]]:
    """Each evidence file (`evidence_files`) replayed `REPLAY_TIMES` times: `outcome` right, wrong,
    other, or skipped (an incident kind that writes no tensors); a clean sample's right, differs or
    uncompared (`_clean_kind`). ScreenError when a file is unusable."""
    entries = []
    for path in files:
        try:
            meta = json.loads(path.read_bytes())
        except (OSError, ValueError) as error:
            raise ScreenError(f"{path}: not an aegis evidence file ({error})") from None
        if isinstance(meta, dict) and meta.get("replayable") is False:
            entries.append({"evidence": str(path), "site": meta.get("site"), "outcome": "skipped",
                            "reason": meta.get("reason")})  # fmt: skip
            continue
        site = str(meta.get("site")) if isinstance(meta, dict) else ""
        clean = isinstance(meta, dict) and meta.get("clean") is True
        spec = fault if fault is not None and fault.matches(site) else None
        try:
            differs = _clean_kind(path, device) if clean else []
            if differs:
                entries.append({"evidence": str(path), "site": site, "step": meta.get("step"), "clean": True,
                                "outcome": "uncompared", "kind_differs": differs})  # fmt: skip
                continue
            report = replay_evidence(path, device, REPLAY_TIMES, spec)
        except EvidenceError as error:
            raise ScreenError(str(error)) from None
        if clean:
            outcome = "right" if report.exit_code == EXIT_RIGHT else "differs"
        else:
            outcome = {EXIT_RIGHT: "right", EXIT_WRONG: "wrong"}.get(report.exit_code, "other")
        entries.append({**report.to_dict(), "outcome": outcome, "faulted": spec is not None})
    return entries


def _clean_kind(path: Path, device: torch.device) -> list[str]:
    """What differs (`EVIDENCE_KIND_KEYS`) between the device and software that computed a clean sample
    and this device running its path; empty: its bits are comparable here. EvidenceError when the
    sample is unusable (read in full: a sample from another kind is still checked)."""
    loaded = load_evidence(path)
    recorded, gemm = loaded.meta.get("recorded_env"), loaded.meta.get("gemm")
    if not isinstance(recorded, dict) or not isinstance(gemm, dict) or not isinstance(recorded.get("dtype"), str):
        raise EvidenceError(f"{loaded.path}: incomplete evidence (a clean sample names no recording device)")
    mine = device_env(device, str(gemm.get("path")), getattr(torch, recorded["dtype"], torch.float32))
    return kind_differs(recorded, mine, EVIDENCE_KIND_KEYS)


def kind_differs(theirs: dict[str, Any], mine: dict[str, Any], keys: Sequence[str] = KIND_KEYS) -> list[str]:
    """The keys of what bits depend on where two descriptions of a device (`device_env`) differ."""
    return [key for key in keys if theirs.get(key) != mine.get(key)]


# -- the screen ------------------------------------------------------------------------------------


@dataclass
class ScreenReport:
    env: dict[str, Any]
    params: dict[str, Any]  # what fixes the cases: shapes, tokens, scales, seed
    cases: list[CaseResult]
    evidence: list[dict[str, Any]] = field(default_factory=list)
    reference: dict[str, Any] | None = None  # the comparison with a reference, when one was given
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def failing(self) -> list[dict[str, str]]:
        found = [{"case": c.name, "reason": reason} for c in self.cases for reason in c.failures()]
        found += [{"evidence": e["evidence"], "reason": f"replay reproduced the wrong values ({e['site']})"}
                  for e in self.evidence if e["outcome"] == "wrong"]  # fmt: skip
        found += [{"evidence": e["evidence"], "reason": f"the clean sample of {e['site']} at step {e['step']} "
                   "was not reproduced bit for bit"} for e in self.evidence if e["outcome"] == "differs"]  # fmt: skip
        return found

    @property
    def verdict(self) -> str:
        if self.failing():
            return FAIL
        uncompared = self.reference is not None and not self.reference["compared"]
        if uncompared or any(e["outcome"] in ("other", "uncompared") for e in self.evidence):
            return INCONCLUSIVE
        return PASS

    @property
    def exit_code(self) -> int:
        return {PASS: EXIT_PASS, FAIL: EXIT_FAIL, INCONCLUSIVE: EXIT_INCONCLUSIVE}[self.verdict]

    def evidence_counts(self) -> dict[str, int]:
        """Outcomes of the incidents' evidence (clean samples: `clean_counts`)."""
        counts = dict.fromkeys(("right", "wrong", "other", "skipped"), 0)
        for e in self.evidence:
            if not e.get("clean"):
                counts[e["outcome"]] += 1
        return counts

    def clean_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(("right", "differs", "uncompared"), 0)
        for e in self.evidence:
            if e.get("clean"):
                counts[e["outcome"]] += 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "exit_code": self.exit_code, "env": self.env, "params": self.params,
                "failing": self.failing(), "notes": self.notes, "reference": self.reference,
                "evidence_counts": self.evidence_counts(), "clean_counts": self.clean_counts(),
                "seconds": self.seconds,
                "cases": [dataclasses.asdict(c) for c in self.cases], "evidence": self.evidence}  # fmt: skip


def default_path(device: torch.device) -> tuple[str, torch.dtype]:
    """The checked GEMM training runs on this device, and its dtype."""
    return (TRITON, torch.bfloat16) if device.type == "cuda" else (REFERENCE, torch.float32)


def screen(
    device: str | torch.device = "cpu",
    *,
    shapes: str | dict[str, tuple[int, int]] = "tinyllama",
    tokens: int = DEFAULT_TOKENS,
    scales: Sequence[float] = DEFAULT_SCALES,
    seed: int = SEED,
    against: dict[str, Any] | None = None,
    evidence: Iterable[str | Path] = (),
    fault: FaultSpec | None = None,
    repeats: int = 2,
    path: str | None = None,
    dtype: torch.dtype | None = None,
) -> ScreenReport:
    """Screen `device`. `against` (a loaded reference, `load_reference`) fixes the cases and is compared
    bit for bit where comparable. `fault` makes the screened kernel faulty (tests, benchmarks).
    `path` / `dtype` override the device's own (the Triton kernel on the CPU under TRITON_INTERPRET)."""
    start = time.perf_counter()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    own_path, own_dtype = default_path(device)
    path, dtype = path or own_path, dtype or own_dtype
    if against is not None:
        params = against["params"]
    else:
        table = parse_shapes(shapes) if isinstance(shapes, str) else dict(shapes)
        params = {"shapes": {layer: list(kn) for layer, kn in table.items()}, "tokens": tokens,
                  "scales": list(scales), "seed": seed}  # fmt: skip
    cases = make_cases({k: tuple(v) for k, v in params["shapes"].items()}, params["tokens"], params["scales"])
    if path == TRITON:  # TMA addresses rows of 16-byte multiples only (ops/triton_linear.unsupported);
        width = torch.empty((), dtype=dtype).element_size()  # the token count is free
        odd = sorted({d for c in cases for d in (c.in_features, c.out_features) if d * width % 16})
        if odd:
            raise ScreenError(f"the Triton kernel needs dimensions of 16-byte rows: {odd} x {width} bytes are not")
    files = evidence_files(evidence)  # a missing path is refused before minutes of sweeps
    env = device_env(device, path, dtype)
    with torch.no_grad(), torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        results = [run_case(c, device, path, dtype, params["seed"], repeats, fault) for c in cases]
        report = ScreenReport(env, params, results)
        report.evidence = replay_all(files, device, fault)
    if against is not None:
        report.reference = compare(report, against)
    differing = sorted({key for e in report.evidence for key in e.get("kind_differs", ())})
    if differing:
        count = sum(e["outcome"] == "uncompared" for e in report.evidence)
        report.notes.append(f"{count} clean sample(s) recorded on another kind of device or software "
                            f"({', '.join(differing)} differ): not compared")  # fmt: skip
    if fault is not None and not any(c.faulted for c in results) and not any(e.get("faulted") for e in report.evidence):
        report.notes.append(f"the injected fault {fault.site!r} struck no case and no evidence")
    report.seconds = time.perf_counter() - start
    return report


def compare(report: ScreenReport, reference: dict[str, Any]) -> dict[str, Any]:
    """Bit for bit against `reference` where its kind (`KIND_KEYS`) is this device's; sets each case's
    `reference` and says what differs."""
    theirs = reference["env"]
    differs = kind_differs(theirs, report.env)
    summary = {"recorded_on": theirs.get("device"), "compared": not differs, "kind_differs": differs}
    if differs:
        shown = ", ".join(f"{key} {theirs.get(key)!r} here {report.env.get(key)!r}" for key in differs
                          if key != "kernel") or "kernel configuration"  # fmt: skip
        report.notes.append(f"reference from another kind of device or software ({shown}): bits not compared; "
                            "the verdict rests on the checksum checks and evidence replays")  # fmt: skip
        return summary
    recorded = {c["name"]: c for c in reference["cases"]}
    for case in report.cases:
        mine = recorded[case.name]
        case.reference = "same" if (mine["out"], mine["partials"]) == (case.out, case.partials) else "differs"
    summary["differs"] = [c.name for c in report.cases if c.reference == "differs"]
    return summary


# -- the reference file ----------------------------------------------------------------------------


def _digest(doc: dict[str, Any]) -> str:
    body = {key: value for key, value in doc.items() if key != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_reference(report: ScreenReport, path: str | Path) -> Path:
    """The report's cases and what their bits depend on, as JSON with its own sha256 (written to a
    temporary name and renamed). ScreenError when it cannot be written."""
    path = Path(path)
    doc = {"format": FORMAT, "version": VERSION, "env": report.env, "params": report.params,
           "cases": [{"name": c.name, "shape": list(c.shape), "out": c.out, "partials": c.partials,
                      "ms": c.ms} for c in report.cases]}  # fmt: skip
    doc["sha256"] = _digest(doc)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, path)
    except OSError as error:
        raise ScreenError(f"{path}: cannot write the reference ({error.strerror or error})") from None
    return path


def load_reference(path: str | Path) -> dict[str, Any]:
    """A reference written by `write_reference`; ScreenError (one line) when it is not one, or was
    changed after it was written (its sha256)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_bytes())
    except OSError as error:
        raise ScreenError(f"{path}: {error.strerror or error}") from None
    except ValueError as error:
        raise ScreenError(f"{path}: not a screen reference (unreadable JSON: {error})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ScreenError(f"{path}: not a screen reference")
    if doc.get("version") != VERSION:
        raise ScreenError(
            f"{path}: screen reference version {doc.get('version')!r}, this aegis reads {VERSION} "
            "(record the reference again on a healthy device)"
        )
    if doc.get("sha256") != _digest(doc):
        raise ScreenError(f"{path}: modified after it was written (its sha256 does not match)")
    try:
        params = doc["params"]
        cases = make_cases({k: (int(v[0]), int(v[1])) for k, v in params["shapes"].items()}, int(params["tokens"]),
                           [float(s) for s in params["scales"]])  # fmt: skip
        int(params["seed"])
        names = [c["name"] for c in doc["cases"]]
        if not isinstance(doc["env"], dict) or not all(isinstance(c["out"], str) for c in doc["cases"]):
            raise TypeError("env or fingerprints of the wrong type")
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
        raise ScreenError(f"{path}: incomplete screen reference ({type(error).__name__}: {error})") from None
    if names != [c.name for c in cases]:
        raise ScreenError(f"{path}: its cases are not those its parameters make")
    return doc
