"""A fault campaign over data-parallel ranks: gradient buckets in the all-reduce.

`world` gloo processes train the project's Llama under DDP, every rank protected (the collective's
checksum check, a peer replay of every step). As in the one-process campaign (runner.py), one guard per
rank serves the whole campaign: a warm-up, a snapshot, then trials that restore it, arm one fault on one
rank for their first step, train `steps_per_trial` steps and drain every rank's guard; a clean twin runs
first and every `twin_every` trials. Locations:

- `allreduce_result`: one element of an all-reduced gradient bucket on one rank, after the collective
  (the injector's `ddp.bucket<k>:allreduce` site): corrupted in flight, in the reduction, or in that
  rank's memory. Sensor: the collective's chunk checksums (distributed/comm_check.py), which prove a
  result wrong when its chunk's sum misses the ranks' local sums by more than the exact rounding bound.
  Claimed for a change of the chunk's sum over **twice** that bound (a clean chunk stays within it);
  the rank is named when a strict majority of three or more passed the same collective.
- `allreduce_input`: one element of one rank's local gradient before the all-reduce (a gradient hook:
  what the rank contributes). The reduced gradient is wrong alike on every rank, so no collective
  check can see it; the peer replay can: the next rank recomputes the step's micro-batch and the local
  gradients, fingerprinted before the all-reduce, differ. Claimed for any change at a replay step.

A trial's fault size (`allreduce_result`) is measured where it lands: the change of the element over
its chunk's rounding bound. `affected`: the parameters of some rank differ from the clean twin's.
`localized`: an incident names the faulty rank (any sensor, any step of the trial: a result corrupted
on one rank makes its weights differ, which the next step's peer replay names); `by_claimed_sensor`:
the claimed sensor named it at the fault's step; `wrong_rank_named`: an incident named another rank.
"""

from __future__ import annotations

import copy
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from aegis_sdc.faults.injector import flip_bit
from aegis_sdc.faults.models import FaultSpec
from aegis_sdc.validation import check_int, set_field

RANK_LOCATIONS = ("allreduce_result", "allreduce_input")


@dataclass(frozen=True)
class RankCampaignConfig:
    """A campaign over `world` gloo ranks on the CPU (docs/campaigns.md, "Over data-parallel ranks")."""

    trials: int = 200
    world: int = 3  # three or more: a rank is named only by a majority
    seed: int = 0
    warmup_steps: int = 20
    steps_per_trial: int = 2
    twin_every: int = 25
    bits: tuple[int, ...] = (0, 8, 13, 16, 20, 22, 23, 26, 30, 31)
    n_layers: int = 2
    dim: int = 64
    batch: int = 2
    seq: int = 32
    run_dir: str | None = None

    def __post_init__(self) -> None:
        for name, least in (("trials", 1), ("world", 2), ("warmup_steps", 18), ("steps_per_trial", 1),
                            ("twin_every", 1), ("n_layers", 1), ("dim", 8), ("batch", 1), ("seq", 2)):  # fmt: skip
            set_field(self, name, check_int, ge=least)
        set_field(self, "seed", check_int)


@dataclass(frozen=True)
class RankTrial:
    index: int
    location: str
    rank: int  # the rank whose value goes wrong
    bit: int
    seed: int
    target: str  # the bucket site (allreduce_result) or the parameter (allreduce_input)

    @property
    def cell(self) -> str:
        return f"{self.location} bit {self.bit}"


@dataclass
class RankCampaignResult:
    config: RankCampaignConfig
    claims: dict[str, dict[str, Any]]
    rows: list[dict[str, Any]] = field(default_factory=list)
    twins: int = 0
    twin_confirmed: int = 0
    twin_false_alarms: int = 0
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        inside = [r for r in self.rows if r["inside"]]
        confirmed = [r for r in inside if r["confirmed"]]
        return {
            "trials": len(self.rows),
            "confirmed_inside_coverage": len(confirmed),
            "missed_inside_coverage": len(inside) - len(confirmed),
            "localized": sum(r["localized"] for r in confirmed) / len(confirmed) if confirmed else None,
            "by_claimed_sensor": sum(r["by_claimed_sensor"] for r in confirmed) / len(confirmed) if confirmed else None,
            "wrong_rank_named": sum(r["wrong_rank_named"] for r in self.rows),
            "false_confirmed": self.twin_confirmed,
            "inside_coverage": len(inside),
            "clean_twins": self.twins,
            "twin_false_alarms": self.twin_false_alarms,
            "world": self.config.world,
            "seconds": self.seconds,
        }

    def cells(self) -> dict[str, dict[str, int]]:
        """Per cell (location, bit): counts of the trials' outcomes."""
        counted = ("injected", "affected", "confirmed", "localized", "by_claimed_sensor", "inside")
        out: dict[str, dict[str, int]] = {}
        for r in self.rows:
            cell = out.setdefault(r["cell"], dict.fromkeys(("trials", *counted, "missed_inside"), 0))
            cell["trials"] += 1
            for key in counted:
                cell[key] += bool(r[key])
            cell["missed_inside"] += bool(r["inside"] and not r["confirmed"])
        return out


def claims_of(config) -> dict[str, dict[str, Any]]:
    """What the guard's distributed configuration claims for the two locations (`GuardConfig`)."""
    dist_cfg = config.distributed
    return {
        "allreduce_result": {
            "sensor": "the collective's chunk checksums", "claimed": bool(dist_cfg.comm_check),
            "down_to": "a change of the chunk's sum over 2 × the check's exact rounding bound",
            "why": "a clean chunk's sum stays within the bound, so the corrupted one misses it by more than the bound",
        },
        "allreduce_input": {
            "sensor": "peer replay", "claimed": dist_cfg.peer_replay_period == 1,
            "down_to": "any change (at a replay step: here every step)",
            "why": "the local gradients are fingerprinted before the all-reduce and the peer's recomputation of the "
                   "same micro-batch gives the same bits (a deterministic step)",
        },
    }  # fmt: skip


def draw_rank_trials(cfg: RankCampaignConfig, buckets: list[str], params: list[str]) -> list[RankTrial]:
    """Round robin over the two locations and the bits; rank, bucket or parameter and seed drawn."""
    rng = random.Random(cfg.seed)
    trials = []
    for i in range(cfg.trials):
        location = RANK_LOCATIONS[i % 2]
        bit = cfg.bits[(i // 2) % len(cfg.bits)]
        target = rng.choice(buckets if location == "allreduce_result" else params)
        trials.append(RankTrial(i, location, rng.randrange(cfg.world), bit, rng.randrange(2**31), target))
    return trials


def run_rank_campaign(cfg: RankCampaignConfig) -> RankCampaignResult:
    """Spawn `cfg.world` gloo processes, run the campaign, and return rank 0's record of it."""
    import torch.multiprocessing as mp

    out = Path(cfg.run_dir or tempfile.mkdtemp(prefix="aegis-rank-campaign-"))
    out.mkdir(parents=True, exist_ok=True)
    # The ranks meet through a file of the campaign's own (a free port picked here could be taken
    # before rank 0 binds it, leaving its peers waiting); one left by a killed campaign is stale.
    rendezvous = out / "rendezvous"
    rendezvous.unlink(missing_ok=True)
    started = time.perf_counter()
    mp.start_processes(_rank_main, args=(cfg, str(rendezvous), str(out)), nprocs=cfg.world, start_method="spawn")
    doc = torch.load(out / "rank_campaign.pt", weights_only=False)
    result = RankCampaignResult(cfg, doc["claims"], doc["rows"], doc["twins"], doc["twin_confirmed"],
                                doc["twin_false_alarms"])  # fmt: skip
    result.seconds = time.perf_counter() - started
    return result


class _RankFaults:
    """This rank's side of a trial's fault: arms it for the trial's first step and says whether it fired.

    `allreduce_input`: a hook on every parameter flips one element of the named parameter's local
    gradient in the step's first backward (the training's; a peer replay's comes later in the step).
    `allreduce_result`: the injector's fault on the bucket's site, with its size measured where it lands
    — the element's change over its chunk's rounding bound (the collective check's own)."""

    def __init__(self, guard, params: dict[str, torch.nn.Parameter]) -> None:
        self.guard = guard
        self.armed: dict[str, Any] = {}
        self.sizes: list[float] = []
        self._changed: tuple | None = None  # (site, flat index, |change|) of the last corrupted result
        self._injections = 0
        for name, p in params.items():
            p.register_hook(self._gradient_fault(name))
        checks = guard.comm_checks
        inject, record = checks.fault_hook, checks.record

        def measured_fault(site, step: int, result: torch.Tensor) -> None:
            before = result.clone()
            inject(site, step, result)
            changed = (result.double() - before.double()).abs()
            if bool(changed.gt(0).any()) or not bool(torch.equal(result.isnan(), before.isnan())):
                changed = changed.nan_to_num(float("inf"))  # a NaN or infinite result: the largest change
                self._changed = (site, int(changed.argmax()), float(changed.max()))

        def recording(site, expected, received, world, dtype, rescan=None, scale=1.0) -> None:
            record(site, expected, received, world, dtype, rescan=rescan, scale=scale)
            changed, self._changed = self._changed, None
            if changed is not None and changed[0] is site:
                last = checks.records[-1]
                bound = float(last.bound[changed[1] // last.chunk_size])
                self.sizes.append(changed[2] / bound if bound > 0 else float("inf"))

        checks.fault_hook, checks.record = measured_fault, recording

    def _gradient_fault(self, name: str):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            armed = self.armed
            if armed.get("param") != name or armed.get("step") != self.guard.step_number:
                return grad
            armed.pop("param")
            grad = grad.clone()
            flip_bit(grad, armed["index"] % grad.numel(), armed["bit"])
            return grad

        return hook

    def arm(self, trial: RankTrial, step: int) -> None:
        self.sizes.clear()
        self._injections = self.guard.injector.log.total
        if trial.location == "allreduce_result":
            spec = FaultSpec(site=trial.target, model="bitflip", bit=trial.bit, steps=(step,), seed=trial.seed)
            self.guard.injector.set_specs((spec,))
        else:
            self.armed.update(param=trial.target, step=step, bit=trial.bit, index=trial.seed)

    def disarm(self, trial: RankTrial) -> bool:
        """Whether the armed fault fired."""
        self.guard.injector.set_specs(())
        if trial.location == "allreduce_result":
            fired = self.guard.injector.log.total > self._injections
        else:
            fired = "param" not in self.armed
        self.armed.clear()
        return fired


def _rank_main(rank: int, cfg: RankCampaignConfig, rendezvous: str, out: str) -> None:
    """One rank: joins the group, runs its side of the campaign, leaves the group once nothing of the
    run holds it — a DDP model freed after `destroy_process_group` can hang the process at exit."""
    import gc

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=cfg.world)
    _campaign_on_rank(rank, cfg, out)
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def _campaign_on_rank(rank: int, cfg: RankCampaignConfig, out: str) -> None:
    """A protected DDP training, the campaign's trials in lockstep with the other ranks, each trial's
    outcome gathered on every rank; rank 0 saves the record."""
    import logging
    import warnings

    import torch.distributed as dist

    import aegis_sdc as aegis
    from aegis_sdc.events import VerdictKind
    from aegis_sdc.response.policies import SilentDataCorruptionWarning
    from aegis_sdc.workloads.data import SyntheticTokens, TokenStreamConfig
    from aegis_sdc.workloads.llama import Llama, LlamaConfig, lm_loss

    logging.getLogger("aegis_sdc").setLevel(logging.CRITICAL)  # thousands of expected findings
    warnings.simplefilter("ignore", SilentDataCorruptionWarning)
    torch.manual_seed(cfg.seed)  # the same model on every rank
    model = Llama(LlamaConfig(vocab_size=256, dim=cfg.dim, n_layers=cfg.n_layers, n_heads=4, n_kv_heads=2,
                              hidden_dim=2 * cfg.dim, max_seq_len=cfg.seq))  # fmt: skip
    config = aegis.GuardConfig(
        run_dir=os.path.join(out, f"run{rank}"), sampling=aegis.SamplingConfig.every_call(),
        distributed=aegis.DistributedConfig(peer_replay_period=1, state_vote=False, warmup_steps=cfg.warmup_steps),
        update_replay=aegis.UpdateReplayConfig(enabled=False),
        response=aegis.ResponseConfig(policy="warn", quarantine=False),
    )  # fmt: skip
    guard = aegis.protect(model, config=config)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    guard.attach_optimizer(optimizer)
    guard.attach_ddp(ddp)
    verdicts: list = []
    guard.subscribe(lambda event, payload: verdicts.append(payload) if event == "verdict" else None)
    data = SyntheticTokens(TokenStreamConfig(vocab_size=256, seq_len=cfg.seq, batch_size=cfg.batch,
                                             seed=cfg.seed + 100 + rank))  # fmt: skip
    params = dict(model.named_parameters())
    faults = _RankFaults(guard, params)

    def step(batch) -> None:
        loss = guard.run_batch(lambda module, b: lm_loss(module(b[0]), b[1]), batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(cfg.warmup_steps):
        step(data.batch())
    guard.drain()
    batches = [data.batch() for _ in range(cfg.steps_per_trial)]
    model_state = copy.deepcopy(model.state_dict())
    optimizer_state = copy.deepcopy(optimizer.state_dict())

    def run(trial: RankTrial | None) -> dict[str, Any]:
        """Restore, train the trial's steps (its fault armed on its rank), drain: what every rank saw."""
        model.load_state_dict(model_state)
        optimizer.load_state_dict(copy.deepcopy(optimizer_state))
        first = guard.step_number
        incidents, n_verdicts = guard.incidents.total, len(verdicts)
        mine = trial is not None and trial.rank == rank
        if mine:
            faults.arm(trial, first)
        for batch in batches:
            step(batch)
        guard.drain()
        seen = {
            "fired": faults.disarm(trial) if mine else False, "sizes": list(faults.sizes) if mine else [],
            "found": [(i.site.name, i.step, i.identity.rank) for i in guard.incidents.since(incidents)],
            "false_alarms": sum(v.kind is VerdictKind.FALSE_ALARM for v in verdicts[n_verdicts:]),
            "params": [p.detach().clone() for p in model.parameters()],
        }  # fmt: skip
        gathered: list[Any] = [None] * cfg.world
        dist.all_gather_object(gathered, seen)
        return {"first": first, "ranks": gathered}

    buckets = sorted({s.name for s in guard.registry.extra if s.name.endswith(":allreduce")})
    names = sorted(n for n, p in params.items() if p.requires_grad)
    twins = [run(None)]
    reference = twins[0]["ranks"]
    rows = []
    for trial in draw_rank_trials(cfg, buckets, names):
        if trial.index and trial.index % cfg.twin_every == 0:
            twins.append(run(None))
        rows.append(_judged(trial, run(trial), reference))
    twins.append(run(None))  # and after the last trial
    if rank == 0:
        record = {"claims": claims_of(config), "rows": rows, "twins": len(twins),
                  "twin_confirmed": sum(len(r["found"]) for t in twins for r in t["ranks"]),
                  "twin_false_alarms": sum(r["false_alarms"] for t in twins for r in t["ranks"])}  # fmt: skip
        torch.save(record, Path(out) / "rank_campaign.pt")
    guard.close()


def _judged(trial: RankTrial, result: dict[str, Any], reference: list[dict[str, Any]]) -> dict[str, Any]:
    """A trial's row from what every rank saw (see the module docstring for the fields)."""
    from aegis_sdc.kernels.reference import bitwise_equal

    ranks = result["ranks"]
    faulty = ranks[trial.rank]
    affected = any(not all(bitwise_equal(a, b) for a, b in zip(r["params"], ref["params"], strict=True))
                   for r, ref in zip(ranks, reference, strict=True))  # fmt: skip
    expected_site = trial.target if trial.location == "allreduce_result" else ":peer_replay"
    found = [f for r in ranks for f in r["found"]]
    named = [f for f in found if f[2] == trial.rank]  # an incident on the faulty rank, by any sensor
    at_site = [f for f in named if f[0].endswith(expected_site) and f[1] == result["first"]]
    size = max(faulty["sizes"], default=None)
    # the claims (`claims_of`): the collective check above twice its bound, the peer replay any change
    inside = bool(affected and (trial.location == "allreduce_input" or (size is not None and size > 2.0)))
    return {**asdict(trial), "cell": trial.cell, "injected": faulty["fired"], "affected": affected,
            "confirmed": bool(found), "localized": bool(named), "by_claimed_sensor": bool(at_site),
            "latency_steps": min((f[1] - result["first"] for f in named), default=None),
            "wrong_rank_named": any(f[2] != trial.rank for f in found), "inside": inside, "size": size,
            "sites": sorted({f"{f[0]} (rank {f[2]})" for f in found})}  # fmt: skip
