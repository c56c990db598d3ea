"""Worker processes of the distributed tests. Each writes a JSON result file.

gloo on the CPU by default; with AEGIS_TEST_BACKEND=nccl each rank runs on GPU `rank` over NCCL (the
same tests, on a machine with enough GPUs).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import gc
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tests.helpers import SMALL, train

import aegis_sdc as aegis
from aegis_sdc.sensors.state_vote import local
from aegis_sdc.workloads.data import SyntheticTokens, TokenStreamConfig
from aegis_sdc.workloads.llama import Llama, lm_loss

CFG = SMALL


BACKEND = os.environ.get("AEGIS_TEST_BACKEND", "gloo")


def run_rank(fn, rank: int, world: int, rendezvous: str, out: str, options: dict) -> None:
    """A worker process's entry: `fn(rank, ...)`, its Python stacks written to `stacks{rank}.txt` on
    SIGUSR1 (the harness sends it to a rank that outlived its timeout, and shows the stacks)."""
    with open(os.path.join(out, f"stacks{rank}.txt"), "w") as stacks:  # kept open while the rank runs
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        fn(rank, world, rendezvous, out, options)


def init(rank: int, world: int, rendezvous: str) -> torch.device:
    """Join the group through a file of the test's own (no TCP port: a port picked free by the test
    can be taken by another process before rank 0 binds it, and its peers then wait forever)."""
    device = torch.device("cpu")
    if BACKEND == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)  # before the group: NCCL and object collectives use it
    dist.init_process_group(BACKEND, init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    return device


def workload(rank: int, device: torch.device, checkpointing: bool = False):
    torch.manual_seed(0)  # the same model on every rank
    model = Llama(dataclasses.replace(CFG, activation_checkpointing=checkpointing)).to(device)
    stream = TokenStreamConfig(vocab_size=CFG.vocab_size, seq_len=64, batch_size=4, seed=100 + rank)
    return model, SyntheticTokens(stream, device=device)


def fail_during_exchange(guard, stall_at: int | None, die_at: int | None) -> None:
    """Make this rank stall (sleep) or die (exit) inside the guard's per-step exchange."""
    exchange = guard.runtime.exchange

    def failing(step, *rest):
        if step == stall_at:
            time.sleep(8)
        if step == die_at:
            os._exit(3)
        return exchange(step, *rest)

    guard.runtime.exchange = failing


def _named(params: dict, name: str) -> torch.Tensor:
    """A parameter by its name in the model, or in the module DDP wraps."""
    return params[name] if name in params else params["module." + name]


def corrupt_state(model, optimizer, spec: dict) -> None:
    """Corrupt a weight or an Adam moment in place, the way a memory fault at rest would: no op
    computes wrong, so no GEMM check can see it. `spec`: kind ("weight" | "exp_avg" | "exp_avg_sq"),
    param (a name in `named_parameters`), factor (the element becomes factor × itself)."""
    params = dict(model.named_parameters())
    param = _named(params, spec["param"])  # DDP prefixes names
    with torch.no_grad():
        target = param if spec["kind"] == "weight" else optimizer.state[param][spec["kind"]]
        target.view(-1)[:8].mul_(spec.get("factor", 1e4))


def corrupt_replica(model, optimizer, spec: dict, snapshots: dict) -> None:
    """A fault of the replica state families (the public fault kits' list) on this rank, in place
    between two steps: kind "bit" (flip `bit` of element `index` of the parameter, or of the
    optimizer state `state`), "row" (row `row` × `factor`), "scale" (the state tensor × `factor`),
    "stale" (the parameter back to its value one step earlier: this replica missed an update)."""
    params = dict(model.named_parameters())
    param = _named(params, spec["param"])
    with torch.no_grad():
        target = local(param if "state" not in spec else optimizer.state[param][spec["state"]])  # FSDP2: a shard
        kind = spec["kind"]
        if kind == "bit":
            words = target.view(-1)[spec.get("index", 0) : spec.get("index", 0) + 1].view(torch.int32)
            words ^= torch.tensor(1 << spec["bit"] if spec["bit"] < 31 else -(1 << 31), dtype=torch.int32)
        elif kind == "row":
            target[spec.get("row", 0)].mul_(spec["factor"])
        elif kind == "scale":
            target.mul_(spec["factor"])
        elif kind == "stale":
            target.copy_(snapshots[spec["param"]])
        else:
            raise ValueError(f"unknown corruption kind {kind!r}")


def train_with_faults(model, data, optimizer, steps: int, rank: int, faults: list[dict], delay: dict | None,
                      guard=None) -> list:  # fmt: skip
    """`train` one step at a time: this rank's faults of `corrupt_replica` land before their step's
    forward; `delay` ({"rank", "every", "seconds"}) makes a rank slow; with `guard`, the loss is
    computed through `guard.run_batch` (`train_through_guard`)."""
    params = dict(model.named_parameters())
    losses, snapshots = [], {}
    for step in range(steps):
        for spec in faults:
            if spec["rank"] != rank:
                continue
            if spec["kind"] == "stale" and spec["step"] == step + 1:  # the value before this step's update
                param = _named(params, spec["param"])
                snapshots[spec["param"]] = local(param).clone()
            if spec["step"] == step:
                corrupt_replica(model, optimizer, spec, snapshots)
        if delay and delay["rank"] == rank and step % delay["every"] == 0:
            time.sleep(delay["seconds"])
        losses += train(model, data, optimizer, 1) if guard is None else train_through_guard(guard, data, optimizer, 1)
    return losses


def install_step_faults(guard, model, rank: int, specs: list[dict]) -> None:
    """Faults between the checked ops, for the peer replay, on this rank at one step each (the
    training's forward or backward only — the first at that step — never a replay's): kind "output"
    (a module's output block × `factor`), "output_sign" (its first rows negated), "grad" (a
    parameter's local gradient before the all-reduce: `mode` "noise", "bit" or "row")."""
    modules, params = dict(model.named_modules()), dict(model.named_parameters())
    for spec in (s for s in specs if s["rank"] == rank):
        fired = {"done": False}

        def due(spec=spec, fired=fired) -> bool:
            if guard.step_number != spec["step"] or fired["done"]:
                return False
            fired["done"] = True
            return True

        if spec["kind"] in ("output", "output_sign"):

            def corrupt_output(module, args, output, spec=spec, due=due):
                if not due():
                    return output
                output = output.clone()
                if spec["kind"] == "output":
                    output[..., :8] *= spec.get("factor", 10.0)
                else:
                    output[:1] = -output[:1]
                return output

            modules[spec["module"]].register_forward_hook(corrupt_output)
        elif spec["kind"] == "grad":

            def corrupt_grad(grad, spec=spec, due=due):
                if not due():
                    return grad
                grad = grad.clone()
                if spec["mode"] == "noise":
                    grad += 1e-3 * torch.randn_like(grad)
                elif spec["mode"] == "bit":
                    grad.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 22)
                else:
                    grad[0] *= 100.0
                return grad

            params[spec["param"]].register_hook(corrupt_grad)
        else:
            raise ValueError(f"unknown step fault {spec['kind']!r}")


def train_through_guard(guard, data, optimizer, steps: int) -> list[float]:
    """`train`, the loss computed through `guard.run_batch` (so that peers can recompute it)."""
    losses = []
    for _ in range(steps):
        inputs, targets = data.batch()
        loss = guard.run_batch(lambda module, batch: lm_loss(module(batch[0]), batch[1]), (inputs, targets))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def guarded_training(rank: int, world: int, rendezvous: str, out: str, options: dict) -> None:
    """DDP or FSDP2 training of the workload, protected or not, with optional faults and stalls."""
    device = init(rank, world, rendezvous)
    if _train_and_report(rank, world, device, out, options):
        # The peer is gone or stuck: tearing the group down would wait for it (NCCL's destructor
        # does). The result is written; leave at once, as a job's rank would after the error.
        os._exit(0)
    leave_group()


def leave_group() -> None:
    """Destroy the process group once nothing of the run holds it any more. A DDP model, its reducer
    or a guard freed *after* `destroy_process_group` hung the rank in a destructor at exit, one run
    in ten under load (gloo, torch 2.13; the unprotected run too, so not the guard's): free them first."""
    gc.collect()
    dist.destroy_process_group()


def _train_and_report(rank: int, world: int, device: torch.device, out: str, options: dict) -> bool:
    """The body of `guarded_training`: train, write `result{rank}.json`; whether the exchange failed."""
    parallel = options.get("parallel", "ddp")
    model, data = workload(rank, device, options.get("checkpointing", False))
    raw_model = model
    faults = tuple(aegis.FaultSpec(**spec) for spec in options.get("faults", ()))
    config = aegis.GuardConfig(
        run_dir=os.path.join(out, "run"),
        faults=faults,
        thresholds=aegis.ThresholdConfig(**options.get("thresholds", {})),
        sampling=(
            aegis.SamplingConfig(budget=options["budgets"][rank], rotation_steps=10, replan_steps=4)
            if options.get("budgets")
            else aegis.SamplingConfig(probability=options.get("sampling", 1.0))
        ),
        distributed=aegis.DistributedConfig(**options.get("distributed", {})),
        response=aegis.ResponseConfig(quarantine=False),
    )
    group = None
    if options.get("dp_groups"):  # e.g. [[0, 1], [2, 3]]: data parallelism inside each group only
        groups = [dist.new_group(ranks) for ranks in options["dp_groups"]]
        group = next(g for g, ranks in zip(groups, options["dp_groups"], strict=True) if rank in ranks)
    guard = None
    result: dict = {"rank": rank}
    try:
        if parallel == "ddp":
            if options.get("protect", True):
                # before wrapping: clean site names; the data-parallel group the ranks compare over
                guard = aegis.protect(model, config=config, process_group=group)
            device_ids = [device.index] if device.type == "cuda" else None
            model = torch.nn.parallel.DistributedDataParallel(model, process_group=group, device_ids=device_ids)
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
            if guard is not None:
                guard.attach_optimizer(optimizer)
                guard.attach_ddp(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            if options.get("protect", True):
                guard = aegis.protect(model, config=config)  # before sharding
            if options.get("hsdp"):  # [replicas, shards]: HSDP, each shard held by `replicas` ranks
                mesh = init_device_mesh(device.type, tuple(options["hsdp"]), mesh_dim_names=("replicate", "shard"))
            else:
                mesh = init_device_mesh(device.type, (world,))
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
            if guard is not None:
                guard.attach_optimizer(optimizer)
                result["fsdp_hooked"] = guard.attach_fsdp(model)
        verdicts: list = []
        if guard is not None:
            guard.subscribe(lambda event, payload: verdicts.append(payload) if event == "verdict" else None)
        if guard is not None and rank in (options.get("stall_rank"), options.get("die_rank")):
            fail_during_exchange(guard, options.get("stall_at"), options.get("die_at"))
        started = time.monotonic()
        corruption = options.get("corrupt")
        try:
            if options.get("peer"):
                install_step_faults(guard, raw_model, rank, options.get("step_faults", []))
                faults, delay, steps = options.get("replica_faults", []), options.get("delay"), options.get("steps", 24)
                result["losses"] = train_with_faults(model, data, optimizer, steps, rank, faults, delay, guard)
            elif options.get("replica_faults") is not None or options.get("delay") is not None:
                faults, delay, steps = options.get("replica_faults", []), options.get("delay"), options.get("steps", 24)
                result["losses"] = train_with_faults(model, data, optimizer, steps, rank, faults, delay)
            elif corruption is not None:  # train to the corruption step, corrupt this rank's state, go on
                result["losses"] = train(model, data, optimizer, corruption["step"])
                if rank == corruption["rank"]:
                    corrupt_state(model, optimizer, corruption)
                result["losses"] += train(model, data, optimizer, options.get("steps", 24) - corruption["step"])
            elif options.get("checkpoint_steps"):  # a checkpoint by every rank after these steps' updates
                result["losses"] = []
                for _ in range(options.get("steps", 24)):
                    result["losses"] += train(model, data, optimizer, 1)
                    if guard.step_number in options["checkpoint_steps"]:
                        guard.save_checkpoint(Path(out, f"rank{rank}-step{guard.step_number}.pt"))
            else:
                result["losses"] = train(model, data, optimizer, options.get("steps", 24))
        except aegis.RankExchangeError as error:
            result["exchange_error"] = str(error)
            result["seconds_in_step"] = time.monotonic() - started
        if guard is not None:
            result["incidents"] = [
                {"site": i.site.name, "step": i.step, "rank": i.identity.rank, "detail": i.verdict.detail}
                for i in guard.incidents
            ]
            result["warnings"] = [w.to_dict() for w in guard.outlier_warnings]
            result["injected"] = [(j.site, j.step) for j in guard.injector.log]
            result["comm_sites"] = sorted(guard.comm_sites)
            result["verdicts"] = [
                {"site": v.site.name, "step": v.step, "kind": v.kind.value, "detail": v.detail} for v in verdicts
            ]
            result["state_votes"] = guard.state_vote.votes if guard.state_vote is not None else 0
            result["peer_replays"] = guard.peer_replay.replays if guard.peer_replay is not None else 0
            result["sensor_stretch"] = guard.sensor_stretch
            result["checks_per_step"] = [s.step_stats.checks for s in guard.sensors]
            result["relaxations"] = sum(s.row.relaxations + s.col.relaxations for s in guard.sensors)
            if "exchange_error" not in result:
                result["summary"] = guard.close().to_dict()
                result["certificates"] = [(c.step, c.status, c.reason) for c in guard.certificates]
    finally:
        Path(out, f"result{rank}.json").write_text(json.dumps(result))
    return "exchange_error" in result


def exchange_cost(rank: int, world: int, rendezvous: str, out: str, options: dict) -> None:
    """Per-step cost of the exchange and of the all-reduce check, against a plain DDP step."""
    init(rank, world, rendezvous)
    from aegis_sdc.distributed.comm_check import CommChecks, checked_allreduce_hook
    from aegis_sdc.distributed.context import DistContext
    from aegis_sdc.events import CommKind, Site

    ctx = DistContext(None, 60.0)
    payload = torch.randn(options["sites"] + 256, dtype=torch.float64)
    for _ in range(5):
        ctx.all_gather(payload, 0)
    started = time.perf_counter()
    reps = 50
    for i in range(reps):
        ctx.all_gather(payload, i)
    exchange_ms = (time.perf_counter() - started) / reps * 1000

    def timed_ddp(hooked: bool) -> float:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        if hooked:
            checks = CommChecks(64, lambda name, kind: Site(0, name, kind, op=kind.value))
            ddp.register_comm_hook(None, checked_allreduce_hook(checks, None, CommKind.ALLREDUCE))
        x = torch.randn(64, 1024)
        times = []
        for _ in range(12):
            t0 = time.perf_counter()
            ddp(x).square().mean().backward()
            times.append(time.perf_counter() - t0)
        return sorted(times[2:])[len(times[2:]) // 2] * 1000

    plain_ms, checked_ms = timed_ddp(False), timed_ddp(True)
    Path(out, f"result{rank}.json").write_text(
        json.dumps(
            {"rank": rank, "exchange_ms": exchange_ms, "ddp_backward_ms": plain_ms, "checked_backward_ms": checked_ms}
        )
    )
    ctx.close()
    leave_group()


def stalled_rank(rank: int, world: int, rendezvous: str, out: str, options: dict) -> None:
    """The documented setup (`protect(ddp_model, optimizer=...)`, or a protected model with no DDP
    wrapper: then the guard's exchange is the only collective) with rank `stop_rank` stopping itself
    (SIGSTOP, as a hung kernel or a stopped process would) after its forward of step `stop_at`: the
    others meet it in the gradient all-reduce (DDP) or in the step's exchange. Each other rank records
    its `RankExchangeError` and the seconds from the start of that step to the error."""
    device = init(rank, world, rendezvous)
    model, data = workload(rank, device)
    timeout = options["exchange_timeout_s"]
    config = aegis.GuardConfig(
        run_dir=os.path.join(out, "run"),
        distributed=aegis.DistributedConfig(exchange_timeout_s=timeout),
        response=aegis.ResponseConfig(quarantine=False),
    )
    if options["ddp"]:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    aegis.protect(model, optimizer=optimizer, config=config)
    result: dict = {"rank": rank}
    try:
        for step in range(options["steps"]):
            started = time.monotonic()
            inputs, targets = data.batch()
            loss = lm_loss(model(inputs), targets)
            if rank == options["stop_rank"] and step == options["stop_at"]:
                os.kill(os.getpid(), signal.SIGSTOP)  # until the harness kills it
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    except aegis.RankExchangeError as error:
        result.update(error=str(error), seconds=time.monotonic() - started, step=step)
    finally:
        Path(out, f"result{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # a peer is stopped: tearing the groups down would wait for it


def mismatched_protect(rank: int, world: int, rendezvous: str, out: str, options: dict) -> None:
    """`protect` on ranks that differ in `options["differ"]`: "model" (rank 1 has a second layer),
    "include" (rank 1 protects the MLPs only) or "seed" (rank 1 samples with another seed)."""
    from aegis_sdc.distributed.agreement import RankAgreementError

    device = init(rank, world, rendezvous)
    differ = options["differ"] if rank == 1 else None
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, n_layers=2) if differ == "model" else CFG
    model = Llama(cfg).to(device)
    config = aegis.GuardConfig(
        run_dir=os.path.join(out, "run"),
        include=("*mlp*",) if differ == "include" else ("*",),
        sampling=aegis.SamplingConfig(probability=0.5, seed=7 if differ == "seed" else 0),
        distributed=aegis.DistributedConfig(exchange_timeout_s=30.0),
        response=aegis.ResponseConfig(quarantine=False),
    )
    result: dict = {"rank": rank}
    try:
        aegis.protect(model, config=config).close()
        result["protected"] = True
    except RankAgreementError as error:
        result.update(error=str(error), value_error=isinstance(error, ValueError))
    finally:
        Path(out, f"result{rank}.json").write_text(json.dumps(result))
    del model
    leave_group()


def moe_training(rank: int, world: int, rendezvous: str, out: str, options: dict) -> None:
    """A Hugging Face Mixtral (experts as 3-D parameters, grouped GEMMs) under DDP or FSDP2, protected,
    a fault at one expert's GEMM on one rank: `result{rank}.json` holds its incidents."""
    device = init(rank, world, rendezvous)
    _moe_train_and_report(rank, device, out, options)
    leave_group()


def _moe_train_and_report(rank: int, device: torch.device, out: str, options: dict) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2)  # fmt: skip
    model = transformers.MixtralForCausalLM(config).to(device)
    spec = aegis.FaultSpec(**options["fault"])
    guard = aegis.protect(model, config=aegis.GuardConfig(run_dir=os.path.join(out, "run"), faults=(spec,),
                                                          response=aegis.ResponseConfig(quarantine=False)))  # fmt: skip
    if options["parallel"] == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard.attach_optimizer(optimizer)
    if options["parallel"] == "ddp":
        guard.attach_ddp(model)
    else:
        guard.attach_fsdp(model)
    g = torch.Generator().manual_seed(rank)
    for _ in range(options.get("steps", 8)):
        ids = torch.randint(0, 128, (4, 32), generator=g).to(device)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    summary = guard.close()
    result = {"rank": rank, "incidents": [[i.step, i.site.name, i.identity.rank] for i in guard.incidents],
              "false_alarms": summary.false_alarms, "unattributed": summary.unattributed}  # fmt: skip
    Path(out, f"result{rank}.json").write_text(json.dumps(result))
