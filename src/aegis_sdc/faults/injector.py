"""The fault injector: decides, per call of a site, whether a fault fires, and keeps the ground truth.

The log of fired faults is what campaigns and tests compare detections against.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from aegis_sdc.bounded import BoundedLog
from aegis_sdc.faults.models import AccumulatorFault, FaultSpec, resolve
from aegis_sdc.hashing import unit_hash

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flip_bit(tensor: torch.Tensor, index: int, bit: int) -> int:
    """Flip bit `bit` modulo the element's width (0 = the lowest mantissa bit) of element `index` (in
    logical order, any layout) of `tensor`, in place; returns the bit flipped."""
    width = 8 * tensor.element_size()
    bit %= width
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), tensor.shape))
    element = tensor.detach()[where].view(_INT_OF_SIZE[tensor.element_size()])  # a view: in place
    element.bitwise_xor_(-(1 << bit) if bit == width - 1 else 1 << bit)  # the sign bit: a negative mask
    return bit


@dataclass
class Injection:
    """One fired fault. `fault` is final once the op has run (a provisional perturb is rescaled)."""

    site: str
    step: int
    call: int
    fault: AccumulatorFault
    head: int | None = None  # attention: the (batch · heads + head) corrupted
    # GEMM faults on the reference path, once the call is checked: the corruption's size in its row's
    # checksum unit (|δ| / (u·s_i), u = 2⁻²³, s_i the row's scale: the unit of the row statistic) and
    # the row threshold in force — a fault larger than twice the threshold alarms whatever the
    # row's clean noise (which a clean call keeps under the threshold). Campaigns check that claim.
    size: float | torch.Tensor | None = None  # a 0-d device tensor from the Triton path (nothing waits for it)
    threshold: float | None = None
    element: tuple[int, int] | None = None  # (row, column) of the output corrupted


class FaultInjector:
    def __init__(self, specs: tuple[FaultSpec, ...] = (), rank: int = 0) -> None:
        self.specs = tuple(specs)
        self.rank = rank  # faults name the ranks whose device they model
        self.log: BoundedLog[Injection] = BoundedLog()  # the latest; the store has every one
        # Steps below this are re-executions after a rollback: a transient fault struck them once and
        # does not again; a persistent one (`affects_replay`: the device itself is faulty) does.
        self.reexecuted_below = 0
        # While a step's calls are recomputed within the step (a peer replay): a transient fault
        # struck the step's first call and does not strike the recomputation; a persistent one does.
        self.replaying = False
        self._matches: dict[str, tuple[FaultSpec, ...]] = {}
        # GEMM sites' own calls in the step (`fire`): a FaultSpec's `steps` strike a site's first
        # call that runs, which for a backward site is not its Linear's first call when a forward
        # without gradients (an eval pass, a reentrant checkpoint's first run) came before it
        self._counted_step: int | None = None
        self._site_calls: dict[int, int] = {}
        self._fired_sites: set[str] = set()  # every site a fault was applied to (the log keeps the latest)

    def __bool__(self) -> bool:
        return bool(self.specs)

    def set_specs(self, specs: tuple[FaultSpec, ...]) -> None:
        """Replace the faults to inject (a campaign's next trial); the log keeps what fired."""
        self.specs = tuple(specs)
        self._matches = {}

    def specs_for(self, site_name: str) -> tuple[FaultSpec, ...]:
        found = self._matches.get(site_name)
        if found is None:
            found = self._matches[site_name] = tuple(s for s in self.specs if s.matches(site_name, self.rank))
        return found

    def _strikes(self, spec: FaultSpec, step: int) -> bool:
        return spec.affects_replay or (step >= self.reexecuted_below and not self.replaying)

    def may_fire(self, site, step: int) -> bool:
        """Whether some call of `site` may get a fault at `step` (the step plan then runs it checked)."""
        return any(spec.may_fire(step) for spec in self.specs_for(site.name))

    def fire(self, site, step: int, call: int, median_l2: float | None) -> Injection | None:
        """The fault planned for call `call` of the site's Linear, or None. `site` is an events.Site;
        this is asked once for each call of the site that runs (a backward site: each forward that
        will have a backward), and a spec counts those calls — `steps` strike the first of them.

        The op records it with `applied()` once the corrupted GEMM has run: a planned backward that
        never runs (no backward pass) leaves no ground truth behind.
        """
        if not self.specs:
            return None
        specs = self.specs_for(site.name)
        if not specs:
            return None
        nth = self._site_call(site.id, step)
        for spec in specs:
            if spec.fires(site.id, step, nth) and self._strikes(spec, step):
                # Before the site knows its median clean difference, delta is provisional (1.0 per
                # unit of scale); the op rescales it by the call's own clean difference.
                fault = resolve(spec, site.id, step, nth, median_l2 if median_l2 is not None else 1.0)
                return Injection(site.name, step, call, fault)
        return None

    def _site_call(self, site_id: int, step: int) -> int:
        """This call's index among the site's calls asked about in `step`."""
        if step != self._counted_step:
            self._counted_step, self._site_calls = step, {}
        nth = self._site_calls.get(site_id, 0)
        self._site_calls[site_id] = nth + 1
        return nth

    @contextlib.contextmanager
    def recomputing(self):
        """The step's calls run again within the step (a peer replay): a transient fault struck the
        step's own calls and does not strike these; a persistent one does, counting the sites'
        calls from the first again. Counts and state are restored after."""
        counted = self._counted_step, self._site_calls
        self._site_calls = {}
        self.replaying = True
        try:
            yield
        finally:
            self.replaying = False
            self._counted_step, self._site_calls = counted

    def applied(self, injection: Injection) -> None:
        self.log.append(injection)
        self._fired_sites.add(injection.site)

    def unfired(self, step: int, site_names: list[str]) -> list[FaultSpec]:
        """This rank's specs with `steps` that match one of `site_names`, whose first step is before
        `step`, and that were never applied: the GEMM they name did not run at their steps (the
        dgrad of a first layer whose input needs no gradient, a frozen layer's wgrad, a Linear the
        forward skipped). Specs that match no site are named after the first step instead."""
        found = []
        for spec in self.specs:
            if not spec.steps or spec.steps.ranges[0][0] >= step:
                continue
            if spec.ranks and self.rank not in spec.ranks:
                continue
            aimed = any(spec.matches(name, self.rank) for name in site_names)
            if aimed and not any(spec.matches(name, self.rank) for name in self._fired_sites):
                found.append(spec)
        return found

    def flip_tensor_bit(self, site, step: int, call: int, tensor: torch.Tensor, salt: int) -> Injection | None:
        """Flip one bit of one element of `tensor` in place if a fault of `site` fires at this call:
        the model of a corrupted value in memory or in flight (collectives, saved or recomputed
        activations). The element is `spec.row` or drawn from the seed; the bit is `spec.bit`
        modulo the element's width (0 = the lowest mantissa bit)."""
        for spec in self.specs_for(site.name) if self.specs else ():
            if not spec.fires(site.id, step, call) or not self._strikes(spec, step) or tensor.numel() == 0:
                continue
            n = tensor.numel()
            index = min(spec.row if spec.row is not None else int(unit_hash(spec.seed, salt, site.id, step) * n), n - 1)
            bit = flip_bit(tensor, index, spec.bit)
            injection = Injection(site.name, step, call, AccumulatorFault("bitflip", bit, 0.0, index, 0, 0.0, 0.0))
            self.applied(injection)
            return injection
        return None
