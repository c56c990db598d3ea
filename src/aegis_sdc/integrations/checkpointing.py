"""Activation checkpointing and saved tensors, fingerprinted (the sensors are in sensors/fingerprint.py).

`RecomputeChecker` replaces `torch.utils.checkpoint.checkpoint` while a guard is open (and the
checkpoint functions that modules bound before (`checkpoint_fn` of torch.distributed CheckpointWrapper,
`_gradient_checkpointing_func` of Hugging Face models), so models that checkpoint — the workload with
`activation_checkpointing=True`, torchtitan, Hugging Face models with gradient checkpointing — are
checked without changes. Each non-reentrant checkpoint call:

1. runs the segment in forward recording its GEMM plans (`ops.checked_linear.SegmentTrace`) and, if
   sampled, fingerprints its output tensors and keeps its inputs and RNG state for a third run;
2. when backward recomputes the segment, replays the same plans (so the recomputation takes the same
   kernels as the forward: bit-identical when the device is healthy) and fingerprints the output
   again. Early stop is switched off for checked segments so the recomputation reaches the output.

Selective activation checkpointing (`context_fn=create_selective_checkpoint_contexts(...)`) passes
through: ops whose outputs it saves are not recomputed, the rest are, and the output is compared.
Reentrant checkpoints (`use_reentrant=True`) pass through unchecked.

`SavedTensorChecker` installs `torch.autograd.graph.saved_tensors_hooks` around the model's forward:
a sampled tensor is fingerprinted when it is packed and when backward unpacks it. Sites are named
after the innermost module running when the tensor is saved (`layers.1.mlp.down_proj:saved`).
Parameters and tensors under `saved_min_bytes` are not fingerprinted; tensors saved inside a
checkpointed segment are not saved at all (checkpointing recomputes them) and are covered by the
recompute check instead.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from aegis_sdc.events import FingerprintKind
from aegis_sdc.faults.injector import FaultInjector
from aegis_sdc.integrations.modules import GuardHook, module_names
from aegis_sdc.ops.checked_linear import PlanTracer, SegmentTrace
from aegis_sdc.sensors.fingerprint import FingerprintChecks, FingerprintRecord, RecomputeCapture, SavedTensorCapture
from aegis_sdc.sensors.gemm import StepClock

WRAPPED_SUFFIX = "._checkpoint_wrapped_module"  # torch.distributed CheckpointWrapper's inner module
# Where modules keep a checkpoint function bound before `protect` (a partial of the original):
# torch.distributed's CheckpointWrapper, Hugging Face models after `gradient_checkpointing_enable()`.
BOUND_CHECKPOINT_ATTRIBUTES = ("checkpoint_fn", "_gradient_checkpointing_func")


def output_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a segment's output (a tensor, or tensors in tuples / lists / dicts)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in output_tensors(item)]
    if isinstance(out, dict):
        return [t for item in out.values() for t in output_tensors(item)]
    return []


def _detached(value: Any) -> Any:
    """Inputs for a third run: the same values, cut from the training graph."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad and value.is_floating_point())
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    if isinstance(value, list):
        return [_detached(v) for v in value]
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


@dataclass
class _Segment:
    """One checkpoint call: what its forward left for the recomputation and a third run."""

    sampled: bool
    trace: SegmentTrace = field(default_factory=SegmentTrace)
    runs: int = 0
    first: list = field(default_factory=list)
    inputs: tuple[tuple, dict] | None = None
    rng: tuple[torch.Tensor, list[torch.Tensor], list[int]] | None = None
    autocast: tuple[str, bool, torch.dtype] | None = None


class _Rebound(functools.partial):
    """A module's bound checkpoint function (HF's `_gradient_checkpointing_func`) rebound to the
    guard's `checkpoint`; copied or pickled as the function it replaced (integrations/modules.py)."""

    def __new__(cls, original: functools.partial, checkpoint: Any) -> _Rebound:
        rebound = super().__new__(cls, checkpoint, *original.args, **original.keywords)
        rebound.original = original
        return rebound

    def __reduce__(self) -> Any:
        return self.original.__reduce__()


def name_compiled(checks: FingerprintChecks, kind: FingerprintKind, what: str) -> None:
    """A fingerprint check that stood aside inside a compiled graph: named `model:<kind>` in the
    coverage report, with one warning (at the end of the first step that compiled it)."""
    reason = f"{what} inside a torch.compile'd graph: an eager-mode check, not run there"
    if checks.name_uncovered("model", kind, reason):
        warnings.warn(f"aegis-sdc: {reason} (guard.coverage_report())", stacklevel=2)


class RecomputeChecker:
    def __init__(
        self, model: nn.Module, checks: FingerprintChecks, tracer: PlanTracer, injector: FaultInjector,
        clock: StepClock,
    ) -> None:  # fmt: skip
        self.names = {id(module): name for name, module in module_names(model)}
        self.model = model
        self.checks = checks
        self.tracer = tracer
        self.injector = injector
        self.clock = clock
        self._original = None
        self.closed = False
        self.compiled = False  # a checkpoint ran inside a compiled graph (a store the frame replays)
        self._wrappers: list[tuple[nn.Module, str, Any]] = []

    # -- installation ------------------------------------------------------------------------------
    def install(self) -> None:
        self._original = torch_checkpoint.checkpoint
        torch_checkpoint.checkpoint = self.checkpoint
        self.rebind()

    def name_compiled(self) -> None:
        if self.compiled:
            name_compiled(self.checks, FingerprintKind.RECOMPUTE, "activation checkpointing (the compiler recomputes)")

    def rebind(self) -> None:
        """Rebind the model's bound checkpoint functions (checkpoint_wrapper, HF's partials) that hold
        torch's own checkpoint — also when another guard's checker is installed below this one. Run
        at install and at every step's start: gradient checkpointing enabled after `protect()` (as
        `TrainingArguments(gradient_checkpointing=True)` does) is checked from the next step on."""
        if self.closed:
            return
        torch_own = self._original
        while isinstance(getattr(torch_own, "__self__", None), RecomputeChecker):
            torch_own = torch_own.__self__._original
        for module in self.model.modules():
            for attribute in BOUND_CHECKPOINT_ATTRIBUTES:
                fn = module.__dict__.get(attribute)
                if type(fn) is functools.partial and fn.func in (self._original, torch_own):
                    self._wrappers.append((module, attribute, fn))
                    setattr(module, attribute, _Rebound(fn, self.checkpoint))

    def uninstall(self) -> None:
        self.closed = True  # a checker installed over this one keeps calling through: pass calls on
        if self._original is not None and torch_checkpoint.checkpoint == self.checkpoint:
            original = self._original
            while isinstance(getattr(original, "__self__", None), RecomputeChecker) and original.__self__.closed:
                original = original.__self__._original  # a checker closed out of order passes on
            torch_checkpoint.checkpoint = original
        for module, attribute, fn in self._wrappers:
            setattr(module, attribute, fn)
        self._wrappers = []

    def segment_name(self, function: Any) -> str:
        bound = None  # HF layers checkpoint partial(forward, self, ...) (older releases: partial(super().__call__))
        while isinstance(function, functools.partial):
            if bound is None and function.args and isinstance(function.args[0], nn.Module):
                bound = function.args[0]
            function = function.func
        target = function if isinstance(function, nn.Module) else getattr(function, "__self__", bound)
        name = self.names.get(id(target)) if target is not None else None
        if name is None:
            name = self._sequential_segment(function) or getattr(function, "__qualname__", type(function).__name__)
        return name.removesuffix(WRAPPED_SUFFIX) or "<root>"

    def _sequential_segment(self, function: Any) -> str | None:
        """`blocks[2:4]` for a segment of `torch.utils.checkpoint.checkpoint_sequential(blocks, ...)`:
        its function is a closure over the Sequential's modules and the segment's first and last index."""
        if not getattr(function, "__qualname__", "").startswith("checkpoint_sequential."):
            return None
        try:
            values = (cell.cell_contents for cell in function.__closure__)
            cells = dict(zip(function.__code__.co_freevars, values, strict=True))
            start, end, first = cells["start"], cells["end"], cells["functions"][cells["start"]]
        except (AttributeError, KeyError, IndexError, TypeError, ValueError):  # another torch's closure
            return None
        name = self.names.get(id(first))
        if name is None or not isinstance(start, int) or not isinstance(end, int):
            return None
        return f"{name.rpartition('.')[0] or '<root>'}[{start}:{end + 1}]"

    def _name_reentrant(self, function: Any) -> None:
        """A reentrant segment runs unchecked: named once, in a warning and the coverage report."""
        name = self.segment_name(function)
        reason = "reentrant activation checkpointing (the recompute check needs use_reentrant=False)"
        if self.checks.name_uncovered(name, FingerprintKind.RECOMPUTE, reason):
            warnings.warn(f"aegis-sdc: {name}: recomputation not checked — {reason}", stacklevel=4)

    # -- the checked checkpoint ------------------------------------------------------------------
    def checkpoint(self, function, *args, use_reentrant: bool | None = None, **kwargs):
        """`torch.utils.checkpoint.checkpoint` with the recompute check (same arguments)."""
        original = self._original or torch_checkpoint.checkpoint
        # Under torch.compile the compiler owns recomputation (the check runs in eager mode only).
        compiling = torch.compiler.is_compiling()
        if compiling and torch.is_grad_enabled():
            self.compiled = True  # named at the step's end (name_compiled)
        if use_reentrant is not False or not torch.is_grad_enabled() or self.closed or compiling:
            if use_reentrant is not False and torch.is_grad_enabled() and not (self.closed or compiling):
                self._name_reentrant(function)
            return original(function, *args, use_reentrant=use_reentrant, **kwargs)
        state = self.checks.site(self.segment_name(function), FingerprintKind.RECOMPUTE)
        step = self.clock.step
        call = state.next_call(step)
        segment = _Segment(self.checks.sampled(state, step, call))

        def run(*a, **k):
            if segment.runs == 0:
                if segment.sampled:
                    segment.inputs, segment.rng, segment.autocast = (a, k), _rng_states(a), _autocast_state(a)
                out = self._traced(segment.trace, None, function, a, k)
                if segment.sampled:
                    with _outside_dispatch_modes():
                        segment.first = self.checks.pool.take_many(output_tensors(out))
            else:
                out = self._traced(segment.trace, 0, function, a, k)
                if segment.sampled:
                    with _outside_dispatch_modes():
                        self._recomputed(segment, state, step, call, function, out)
            segment.runs += 1
            return out

        with torch_checkpoint.set_checkpoint_early_stop(False):
            return original(run, *args, use_reentrant=False, **kwargs)

    def _traced(self, trace: SegmentTrace, cursor: int | None, function, args, kwargs):
        trace.cursor = cursor
        previous, self.tracer.current = self.tracer.current, trace
        try:
            return function(*args, **kwargs)
        finally:
            self.tracer.current = previous

    def _recomputed(self, segment: _Segment, state, step: int, call: int, function, out) -> None:
        outs = output_tensors(out)
        activations = [t for t in outs if t.is_floating_point()]  # (not indices: see SavedTensorChecker._fault_call)
        if activations:  # fault injection: a flipped bit in the recomputed activation
            self.injector.flip_tensor_bit(state.site, step, call, activations[0], salt=0xEC)
        second = self.checks.pool.take_many(outs)
        record = FingerprintRecord(state, step, call, segment.first, second, None)  # type: ignore[arg-type]

        def rerun() -> list[torch.Tensor]:
            args, kwargs = _detached(segment.inputs)
            with _restored_rng(segment.rng), _autocast(segment.autocast), torch.enable_grad():
                return [t.detach() for t in output_tensors(self._traced(segment.trace, 0, function, args, kwargs))]

        record.capture = RecomputeCapture(rerun, self.checks.pool, record)
        self.checks.records.append(record)


def _outside_dispatch_modes():
    """Run our own ops (fingerprints, fault injection) outside the dispatch modes active around a
    segment: selective activation checkpointing records every op of the forward and requires the
    recomputation to issue the same ones, so our ops must not be seen by it."""
    try:
        from torch.utils._python_dispatch import _disable_current_modes
    except ImportError:  # pragma: no cover - older torch
        return contextlib.nullcontext()
    return _disable_current_modes()


def _cuda_devices(args) -> list[int]:
    return sorted({t.device.index for t in output_tensors(list(args)) if t.is_cuda})


def _rng_states(args) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    devices = _cuda_devices(args)
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices], devices


class _restored_rng:
    """Run with the RNG state the segment's forward saw (dropout draws the same mask)."""

    def __init__(self, rng) -> None:
        self.rng = rng

    def __enter__(self):
        cpu, cuda, devices = self.rng
        self.fork = torch.random.fork_rng(devices=devices)
        self.fork.__enter__()
        torch.set_rng_state(cpu)
        for device, state in zip(devices, cuda, strict=True):
            torch.cuda.set_rng_state(state, device)

    def __exit__(self, *exc):
        return self.fork.__exit__(*exc)


def _autocast_state(args) -> tuple[str, bool, torch.dtype]:
    tensors = output_tensors(list(args))
    device_type = tensors[0].device.type if tensors else "cpu"
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _autocast(state):
    device_type, enabled, dtype = state
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


class _Saved:
    """What the pack hook stores for a tensor of a sampled step."""

    __slots__ = ("call", "fault_call", "first", "state", "step", "tensor")

    def __init__(self, tensor, state, step, call, fault_call) -> None:
        self.tensor, self.state, self.step, self.call, self.first = tensor, state, step, call, None
        self.fault_call = fault_call  # its index among the site's floating-point tensors this step, else None


SAVED_STEP_SITE = 0x5AFE  # the key of the per-step sampling decision (any fixed number, same on all ranks)


class SavedTensorChecker:
    """Saved tensors of sampled steps, fingerprinted when saved and when used.

    Python pack/unpack hooks cost microseconds per saved tensor (hundreds per step), so whole steps
    are sampled (`saved_probability`, the same steps on every rank): an unsampled step runs without
    hooks. In a sampled step every saved tensor of at least `min_bytes` is fingerprinted, in two
    batched launches: the packed tensors when the model's forward returns, the used ones at the
    step's end (a corruption before the use is still in memory then: the record holds the tensor).
    """

    def __init__(
        self, model: nn.Module, checks: FingerprintChecks, injector: FaultInjector, clock: StepClock,
        min_bytes: int, probability: float,
    ) -> None:  # fmt: skip
        self.model = model
        self.checks = checks
        self.injector = injector
        self.clock = clock
        self.min_bytes = min_bytes
        self.probability = probability
        self.forced: bool | None = None  # this step sampled (True) or not (False) whatever the draw: the budget's
        self.stack: list[str] = []
        self.active = False
        self.packed: list[_Saved] = []
        self.used: list[_Saved] = []
        self._states: dict[str, object] = {}
        self._float_calls: dict[str, tuple[int, int]] = {}  # module → (step, floating-point tensors saved)
        self._handles: list[Any] = []
        self._step_handles: list[Any] = []
        self._context: Any = None
        self.compiled = False  # the model's forward ran inside a compiled graph (a store the frame replays)

    def name_compiled(self) -> None:
        if self.compiled and (self.probability > 0 or self.forced):
            name_compiled(self.checks, FingerprintKind.SAVED, "saved-tensor fingerprints")

    def install(self) -> None:
        # Only the model itself carries hooks between sampled steps: a module with forward hooks
        # leaves PyTorch's fast call path, which costs microseconds per call on every step.
        self._handles.append(self.model.register_forward_pre_hook(GuardHook(self._root_enter)))
        self._handles.append(self.model.register_forward_hook(GuardHook(self._root_exit), always_call=True))
        self.checks.flushers.append(self.flush)

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._end_forward()

    def _root_enter(self, module, args) -> None:
        # The model's own forward begins: hook saved tensors if this step is sampled, and name them
        # by the module running (hooks on the submodules for this forward only).
        if torch.compiler.is_compiling() and torch.is_grad_enabled():
            self.compiled = True  # saved-tensor hooks are an eager-mode check: named at the step's end
            return
        if self.active or not torch.is_grad_enabled():
            return
        sampled = self.forced
        if sampled is None:
            sampled = self.checks.should_check(self.probability, SAVED_STEP_SITE, self.clock.step, 0)
        if not sampled:
            return
        self.active = True
        self.stack = ["<root>"]
        for name, sub in module_names(self.model):
            if sub is not self.model:
                enter = GuardHook(functools.partial(self._enter, name))
                self._step_handles.append(sub.register_forward_pre_hook(enter))
                self._step_handles.append(sub.register_forward_hook(GuardHook(self._exit), always_call=True))
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._context.__enter__()

    def _root_exit(self, module, args, output) -> None:
        if self.active:
            self._end_forward()

    def _enter(self, name: str, module, args) -> None:
        self.stack.append(name)

    def _exit(self, module, args, output) -> None:
        if len(self.stack) > 1:
            self.stack.pop()

    def _end_forward(self) -> None:
        """Leave the hooks and fingerprint everything saved during the forward in one launch."""
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None
        for handle in self._step_handles:
            handle.remove()
        self._step_handles = []
        self.active = False
        self.stack = []
        for saved, handle in zip(self.packed, self.checks.pool.take_many([p.tensor for p in self.packed]), strict=True):
            saved.first = handle
        self.packed = []

    def _pack(self, t: torch.Tensor):
        if (t.requires_grad and t.is_leaf) or t.numel() * t.element_size() < self.min_bytes:
            return t  # parameters, and tensors too small to matter
        module = self.stack[-1] if self.stack else "<root>"
        state = self._states.get(module)
        if state is None:
            state = self._states[module] = self.checks.site(module, FingerprintKind.SAVED)
        saved = _Saved(t, state, self.clock.step, state.next_call(self.clock.step), self._fault_call(module, t))
        self.packed.append(saved)
        return saved

    def _fault_call(self, module: str, t: torch.Tensor) -> int | None:
        """The call index an injected fault counts this tensor by: floating-point tensors only. An
        integer tensor saved for backward holds indices (an embedding's token ids, a gather's
        positions): one flipped bit there is an out-of-bounds access in the backward on a GPU — a
        crash of the process, not a silent corruption — so the fault model of a corrupted activation
        leaves them alone (the fingerprints still cover them)."""
        if not t.is_floating_point():
            return None
        step, count = self._float_calls.get(module, (None, 0))
        count = count if step == self.clock.step else 0
        self._float_calls[module] = (self.clock.step, count + 1)
        return count

    @property
    def activation_modules(self) -> frozenset[str]:
        """The modules that have saved a floating-point tensor for backward: where a `:saved` fault
        can strike (the others save only indices, which it leaves alone)."""
        return frozenset(self._float_calls)

    def _unpack(self, packed):
        if not isinstance(packed, _Saved):
            return packed
        if packed.fault_call is not None:
            self.injector.flip_tensor_bit(packed.state.site, packed.step, packed.fault_call, packed.tensor, salt=0x5A)
        self.used.append(packed)
        return packed.tensor

    def flush(self) -> None:
        """At the step's end: fingerprint the tensors backward used, in one launch, and record the pairs."""
        used = [u for u in self.used if u.first is not None]
        self.used = []
        for saved, second in zip(used, self.checks.pool.take_many([u.tensor for u in used]), strict=True):
            record = FingerprintRecord(saved.state, saved.step, saved.call, [saved.first], [second], None)  # type: ignore[arg-type]
            record.capture = SavedTensorCapture(saved.tensor, self.checks.pool, record)
            self.checks.records.append(record)
