"""Optimizer-update replay: a slice of each step's update executed a second time from a snapshot of
its inputs, the two results compared bit for bit.

No GEMM check sees the optimizer step: element-wise kernels (fused or foreach AdamW, SGD) that
read the gradients and the state and write the parameters and the state. Those kernels are
deterministic, so the same update of the same inputs gives the same bits anywhere on the device.

Before the update (the optimizer pre-hook) the parameters of this step's slice, their gradients and
their optimizer state are copied (`inputs`); after it (the post-hook, once any held-back update has
run) a second optimizer of the same class with the same group options — and GradScaler's
`grad_scale` / `found_inf` where the step had them — updates a copy of those inputs, and both results
are fingerprinted on the device (one value per parameter: its value and its state folded). The
fingerprints come with the next step's read; a parameter whose two results differ is an SDC of this
device's optimizer step, and a third execution from the untouched inputs says which one was wrong:
it agrees with the replay → the training update was wrong (the weights now carry it); it agrees with
the training update → the replay was.

One slice every `every` steps; the slices cover every parameter every `slices · every` steps,
balanced by bytes. The copies live in three blocks of device memory kept for the run (`CopyArena`:
two for the inputs, taken in turn so that a slice's inputs outlive its judgment a step later, one for
the replay's working copies), each the size of the largest slice: about
`3 × (parameter + gradient + state bytes) / slices` — 1.7 GB for a 1.1B model in bf16 with AdamW
at 16 slices. Reused, they cost one foreach copy per dtype and a fingerprint launch prepared once
per slice instead of a clone and a table per tensor: the replay's host time is what the budget pays
where the device does not run ahead of the host.

Covered: torch.optim's optimizers whose update of a parameter depends on that parameter's own
gradient and state and on its group's options (`PER_PARAMETER`: SGD, the Adam family, Adagrad,
Adadelta, RMSprop, Rprop, ASGD, Adafactor); others (subclasses too) are named once and left out.
A step whose update `skip-step` dropped, a step given a closure (its gradients are computed inside
`optimizer.step`: Lightning's automatic optimization) and parameters without a gradient are not
compared.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from aegis_sdc.events import VerdictKind, WrongExecution
from aegis_sdc.ops.fingerprint import Fingerprint, FingerprintPool
from aegis_sdc.sensors.state_vote import fold, local

SCALER_ATTRS = ("grad_scale", "found_inf")  # GradScaler hands fused optimizers these for the step
# Optimizers whose update of a parameter reads only that parameter, its gradient, its state and its
# group's options: a slice replays exactly as it ran among all parameters. Any other (LAMB's global
# norms, a clipping inside the step, ZeRO's shards, ...) could update a slice differently alone, and a
# replay would then accuse a healthy device: such optimizers are named as not covered.
PER_PARAMETER = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD,
    torch.optim.Adafactor,
)  # fmt: skip


@dataclass
class UpdateInputs:
    """One slice's update inputs as they were before the step: parameters, gradients, state."""

    names: list[str]
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    states: list[dict]
    groups: list[dict]  # each parameter's group options (without "params"; one dict per group)
    scaler: dict  # GradScaler's attributes on the optimizer during the step

    def execute(
        self, kind: type[torch.optim.Optimizer], work: CopyArena | None = None
    ) -> tuple[list[torch.Tensor], list[dict]]:
        """The update once more, on copies (the inputs stay as they were): (parameters, states).
        `work`: the memory the copies are made in (the hot path's reused block; fresh ones without)."""
        params, grads, states = copied(self.params, self.grads, self.states, work.copy if work is not None else clones)
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        # parameters that shared a group share one again (one fused or foreach call per group)
        grouped: dict[int, dict] = {}
        for group, param in zip(self.groups, params, strict=True):
            grouped.setdefault(id(group), dict(group, params=[]))["params"].append(param)
        optimizer = kind(list(grouped.values()))
        for param, state in zip(params, states, strict=True):
            optimizer.state[param] = state
        for name, value in self.scaler.items():
            setattr(optimizer, name, value)
        with torch.no_grad():
            optimizer.step()
        return params, [optimizer.state[p] for p in params]


def clones(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


def copied(
    params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict], copy: Callable[[list], list]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[dict]]:
    """Copies of parameters, their gradients and their optimizer states, made by `copy` over the flat
    list of their tensors (one call: a `CopyArena` copies it with one launch per dtype); a state's
    other entries are kept as they are."""
    keys = [sorted(k for k in state if isinstance(state[k], torch.Tensor)) for state in states]
    flat = [*params, *grads, *(state[k] for state, ks in zip(states, keys, strict=True) for k in ks)]
    copies = copy(flat)
    n, rest = len(params), iter(copies[2 * len(params) :])
    return copies[:n], copies[n : 2 * n], [{**state, **{k: next(rest) for k in ks}}
                                          for state, ks in zip(states, keys, strict=True)]  # fmt: skip


class CopyArena:
    """Copies of lists of tensors in one block of device memory reused from firing to firing: a list's
    views are laid out once per layout (shapes, dtypes) and kept, and a copy is one foreach launch per
    dtype — where a clone per tensor cost a launch and an allocation each (about 130 per replay of a
    1.1B model's slice). The copies' addresses repeat, so their fingerprint launch is prepared once
    (ops/fingerprint.py). Tensors on another device than the list's first (Adam's host `step` count)
    are cloned. Copies of one call are overwritten by the next call with the same layout's place."""

    ALIGN = 16  # bytes: every view starts aligned for any dtype and for the kernels' vector loads
    LAYOUTS = 64  # layouts kept (a replay's slices, their states as they appear)

    def __init__(self) -> None:
        self._block: torch.Tensor | None = None  # uint8
        self._layouts: dict[tuple, list[torch.Tensor | None]] = {}

    def copy(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if not tensors:
            return []
        key = tuple((t.shape, t.dtype, t.device) for t in tensors)
        views = self._layouts.get(key)
        if views is None:
            views = self._lay_out(tensors, key)
        by_dtype: dict[torch.dtype, tuple[list, list]] = {}
        for t, view in zip(tensors, views, strict=True):
            if view is not None:
                dst, src = by_dtype.setdefault(t.dtype, ([], []))
                dst.append(view)
                src.append(t)
        for dst, src in by_dtype.values():
            torch._foreach_copy_(dst, src)
        return [view if view is not None else t.clone() for t, view in zip(tensors, views, strict=True)]

    def _lay_out(self, tensors: list[torch.Tensor], key: tuple) -> list[torch.Tensor | None]:
        device = tensors[0].device
        offsets, end = [], 0
        for t in tensors:
            if t.device != device:
                offsets.append(None)
                continue
            offsets.append(end)
            end += -(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN
        if self._block is None or self._block.device != device or self._block.numel() < end:
            self._block = torch.empty(max(end, self.ALIGN), dtype=torch.uint8, device=device)
            self._layouts = {}  # views of the old block must not be handed out again
        block = self._block
        views = [None if off is None else block[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                 for t, off in zip(tensors, offsets, strict=True)]  # fmt: skip
        if len(self._layouts) >= self.LAYOUTS:
            self._layouts.pop(next(iter(self._layouts)))
        self._layouts[key] = views
        return views


def fingerprints(pool: FingerprintPool, tensors: list[torch.Tensor]) -> list[Fingerprint]:
    """The replay's fingerprints: on the device through the pool (read with the step's transfer);
    of host tensors a digest of their bytes at once — nothing to wait for, and far cheaper there than
    the reference (or the interpreted kernel) the pool would run."""
    on_device = pool.take_many([t for t in tensors if t.is_cuda])[::-1]
    # a host tensor among device ones: AdamW's `step` count unless capturable or fused
    return [on_device.pop() if t.is_cuda else Fingerprint(value=_digest(t)) for t in tensors]


def fingerprint_now(pool: FingerprintPool, t: torch.Tensor) -> int | None:
    """One fingerprint read back at once, by the same function as `fingerprints`."""
    return _digest(t) if not t.is_cuda else pool.now(t)


def _digest(t: torch.Tensor) -> int:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _local_state(state: dict) -> dict:
    """An optimizer state with its tensors as local shards (FSDP2's DTensors), not copied."""
    return {key: local(value) if isinstance(value, torch.Tensor) else value for key, value in state.items()}


def _state_tensors(state: dict) -> list[torch.Tensor]:
    return [local(state[key]) for key in sorted(state) if isinstance(state[key], torch.Tensor)]


@dataclass
class UpdateRecord:
    """A step's slice: the training update's results and the replay's, fingerprinted per parameter."""

    step: int
    inputs: UpdateInputs
    kind: type[torch.optim.Optimizer]
    trained: list[tuple[Fingerprint, ...]]
    replayed: list[tuple[Fingerprint, ...]]

    def resolved(self) -> bool:
        return not any(h.pending for hs in self.trained + self.replayed for h in hs)

    def mismatched(self) -> list[int]:
        """Indices of the parameters whose two results differ (known values only)."""
        out = []
        for i, (a, b) in enumerate(zip(self.trained, self.replayed, strict=True)):
            first, second = fold([h.value for h in a]), fold([h.value for h in b])
            if first and second and first != second:
                out.append(i)
        return out


class UpdateCapture:
    """The payload of an update mismatch: the untouched inputs, for a third execution."""

    references = ()  # the inputs are copies: nothing the optimizer changes

    def __init__(self, record: UpdateRecord, index: int, pool: FingerprintPool) -> None:
        inputs = record.inputs
        self.name = inputs.names[index]
        # copied: the record's inputs live in a block the next slices reuse (UpdateReplay)
        params, grads, states = copied([inputs.params[index]], [inputs.grads[index]], [inputs.states[index]], clones)
        self.inputs = UpdateInputs([self.name], params, grads, states, [inputs.groups[index]], inputs.scaler)
        self.kind = record.kind
        self.trained = fold([h.value for h in record.trained[index]])
        self.replayed = fold([h.value for h in record.replayed[index]])
        self.pool = pool

    def verdict(self) -> tuple[VerdictKind, WrongExecution | None, str]:
        params, states = self.inputs.execute(self.kind)
        third = fold([fingerprint_now(self.pool, t) for t in [params[0], *_state_tensors(states[0])]])
        what = f"the {self.kind.__name__} update of {self.name}"
        if third == self.replayed:
            return (VerdictKind.CONFIRMED_SDC, WrongExecution.ORIGINAL,
                    f"{what} differs from two re-executions of it from the same inputs, which agree: the "
                    "training update was wrong and the parameter (or its state) now carries it")  # fmt: skip
        if third == self.trained:
            return (VerdictKind.CONFIRMED_SDC, WrongExecution.REPLAY,
                    f"{what}: its replay differed; a third execution agrees with the training update "
                    "(the parameter is intact)")  # fmt: skip
        return (VerdictKind.NOT_DETERMINISTIC, WrongExecution.UNSTABLE,
                f"{what}: three executions from the same inputs differ — the optimizer is not deterministic "
                "here: not covered")  # fmt: skip


class UpdateReplay:
    """The update replay of one optimizer (see the module docstring)."""

    def __init__(self, model: nn.Module, pool: FingerprintPool, slices: int, every: int = 1) -> None:
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.pool = pool
        self.slices = slices
        self.every = every  # a slice every this many steps
        self._slices: list[list[torch.Tensor]] | None = None
        self._inputs: UpdateInputs | None = None
        self._step = -1
        self.records: list[UpdateRecord] = []  # replayed, waiting for their fingerprints
        self.replays = 0
        self.uncovered: str | None = None  # why the optimizer cannot be replayed, once known
        self.closure_steps = 0  # steps not replayed: their gradients come from a closure inside the step
        self._layout: tuple = ()
        self._group_of: dict[int, int] = {}
        # The inputs' copies: two blocks taken in turn, so a slice's inputs stay intact until its
        # record is judged (a step later) while the next slice is copied; the replay's working copies
        # in a third. A block whose record is not judged yet is not reused (the copies are then fresh).
        self._snapshots = (CopyArena(), CopyArena())
        self._holders: list[UpdateRecord | None] = [None, None]
        self._snapshot = -1  # the block the pending inputs are in (-1: fresh copies)
        self._work = CopyArena()

    def due(self, step: int) -> bool:
        """Whether `step` replays a slice (when its optimizer and inputs allow)."""
        return self.uncovered is None and step % self.every == 0

    @property
    def pending(self) -> bool:
        """A slice's inputs are copied and wait for the update to run."""
        return self._inputs is not None

    def _slice_of(self, optimizer: torch.optim.Optimizer, step: int) -> list[torch.Tensor]:
        if self._slices is None:  # balanced by bytes, largest first: the same slices every cycle
            params = [p for g in optimizer.param_groups for p in g["params"] if id(p) in self.names]
            slices: list[list[torch.Tensor]] = [[] for _ in range(self.slices)]
            loads = [0] * self.slices
            for p in sorted(params, key=lambda p: -p.numel() * p.element_size()):
                lightest = loads.index(min(loads))
                slices[lightest].append(p)
                loads[lightest] += p.numel() * p.element_size()
            self._slices = slices
        return self._slices[(step // self.every) % self.slices]

    def before(
        self, optimizer: torch.optim.Optimizer, step: int, dropped_updates: int, closure: bool = False,
        compiled: bool = False,
    ) -> None:  # fmt: skip
        """Copy the inputs of this step's slice (the update is still to come). A step given a closure
        computes its gradients inside `optimizer.step` (Lightning's automatic optimization): its
        inputs do not exist yet, so it is not replayed (comparing against stale inputs would accuse
        a healthy device). A `compiled` step (torch.compile over `optimizer.step()`) computes the
        update with the compiler's kernels, whose bits an eager replay need not reproduce (an
        aot_eager AdamW differed from the eager one in 2 of 6 slices on the CPU): not covered."""
        self._inputs = None
        if self.uncovered is not None:
            return
        if compiled:
            self.uncovered = ("the optimizer step runs inside torch.compile: its update is computed by compiled "
                              "kernels whose bits an eager replay does not reproduce")  # fmt: skip
            return
        if closure:
            self.closure_steps += 1
            return
        if step % self.every:
            return
        if type(optimizer) not in PER_PARAMETER:
            self.uncovered = (f"{type(optimizer).__name__} is not one of torch.optim's per-parameter optimizers: a "
                              "slice of its update need not replay as it ran among all parameters")  # fmt: skip
            return
        groups = optimizer.param_groups
        layout = tuple((id(g), len(g["params"])) for g in groups)
        if layout != self._layout:  # which group each parameter is in: rebuilt when the groups change
            self._layout = layout
            self._group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
        chosen = [p for p in self._slice_of(optimizer, step) if p.grad is not None and id(p) in self._group_of]
        if not chosen:
            return
        # the chosen parameters' group options as they are now (a scheduler changes the learning rate)
        options = {i: {k: v for k, v in groups[i].items() if k != "params"} for i in
                   {self._group_of[id(p)] for p in chosen}}  # fmt: skip
        free = [i for i, holder in enumerate(self._holders) if holder is None]
        self._snapshot = free[0] if free else -1
        params, grads, states = copied(
            [local(p) for p in chosen], [local(p.grad) for p in chosen],
            [_local_state(optimizer.state.get(p, {})) for p in chosen],
            self._snapshots[self._snapshot].copy if free else clones,
        )  # fmt: skip
        self._inputs = UpdateInputs(
            names=[self.names[id(p)] for p in chosen],
            params=params,
            grads=grads,
            states=states,
            groups=[options[self._group_of[id(p)]] for p in chosen],
            scaler={name: getattr(optimizer, name) for name in SCALER_ATTRS if hasattr(optimizer, name)},
        )
        self._chosen = chosen
        self._step, self._dropped = step, dropped_updates

    def after(self, optimizer: torch.optim.Optimizer, dropped_updates: int) -> None:
        """Once the step's update has run: replay the slice and fingerprint both results."""
        inputs, self._inputs = self._inputs, None
        if inputs is None or dropped_updates != self._dropped:
            return  # nothing copied, or `skip-step` dropped the update the inputs were for
        try:
            params, states = inputs.execute(type(optimizer), self._work)
        except (TypeError, ValueError, RuntimeError) as error:  # an optimizer that cannot be rebuilt
            self.uncovered = f"{type(optimizer).__name__} could not be replayed: {error}"
            return
        trained = [[local(p), *_state_tensors(optimizer.state.get(p, {}))] for p in self._chosen]
        replayed = [[p, *_state_tensors(s)] for p, s in zip(params, states, strict=True)]
        flat = fingerprints(self.pool, [t for ts in trained + replayed for t in ts])
        handles, start = [], 0
        for ts in trained + replayed:
            handles.append(tuple(flat[start : start + len(ts)]))
            start += len(ts)
        n = len(trained)
        record = UpdateRecord(self._step, inputs, type(optimizer), handles[:n], handles[n:])
        self.records.append(record)
        if self._snapshot >= 0:
            self._holders[self._snapshot] = record  # its inputs' block is not reused before it is judged
        self.replays += 1
        self._chosen = []

    def take_resolved(self) -> list[UpdateRecord]:
        """The records whose fingerprints have come (the step's read resolves them)."""
        done = [r for r in self.records if r.resolved()]
        self.records = [r for r in self.records if not r.resolved()]
        # their inputs' blocks are free once the guard has judged them (an UpdateCapture copies its own)
        self._holders = [None if any(h is r for r in done) else h for h in self._holders]
        return done
