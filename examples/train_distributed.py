"""Train the workload data-parallel on N processes with every Linear protected.

    torchrun --nproc-per-node 2 examples/train_distributed.py                  # DDP, gloo on CPUs
    torchrun --nproc-per-node 2 examples/train_distributed.py --parallel fsdp2
    torchrun --nproc-per-node 2 examples/train_distributed.py --fault-rank 1   # a faulty matrix unit on rank 1

On GPUs (one per process) it uses NCCL and bf16. Every rank writes its own store into the run
directory; rank 0 prints the merged incidents and rank-outlier warnings at the end.

A rank that dies or stalls (`kill -STOP` one) makes the others raise `RankExchangeError` within
`--exchange-timeout` seconds (on CPUs, gloo; docs/distributed.md says what times out where); they
then leave at once, as they should: a normal exit would wait in the process group's teardown for
the stalled rank's collectives, up to the group's own timeout (30 min by default).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import aegis_sdc as aegis
from aegis_sdc.store.sqlite import read_incidents, read_warnings
from aegis_sdc.workloads.data import SyntheticTokens, TokenStreamConfig
from aegis_sdc.workloads.llama import Llama, LlamaConfig, lm_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel", choices=("ddp", "fsdp2"), default="ddp")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--fault-rank", type=int, default=None, help="rank whose device corrupts accumulators")
    parser.add_argument("--fault-site", default="layers.1.mlp.up_proj:fwd")
    parser.add_argument("--run-dir", default=None)
    parser.add_argument(
        "--exchange-timeout", type=float, default=60.0,
        help="seconds a rank waits for the others in the guard's collectives before RankExchangeError",
    )  # fmt: skip
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same initial model everywhere
    model = Llama(LlamaConfig()).to(device)
    if cuda:
        model = model.to(torch.bfloat16)
    data = SyntheticTokens(
        TokenStreamConfig(vocab_size=256, seq_len=128, batch_size=8, seed=1000 + rank), device=device
    )
    faults = ()
    if args.fault_rank is not None:
        strikes = tuple(range(40, args.steps, 25)) or (args.steps - 1,)  # after calibration (16 checks)
        faults = (
            aegis.FaultSpec(site=args.fault_site, model="bitflip", bit=22, steps=strikes, ranks=(args.fault_rank,)),
        )
    run_dir = args.run_dir or aegis.config.default_run_dir()
    # every call checked: the example's injected fault must be seen (the default on a GPU samples to a 1% budget)
    config = aegis.GuardConfig(
        run_dir=run_dir, faults=faults, sampling=aegis.SamplingConfig.every_call(),
        distributed=aegis.DistributedConfig(exchange_timeout_s=args.exchange_timeout),
    )  # fmt: skip
    guard = aegis.protect(model, config=config)  # before wrapping
    if args.parallel == "ddp":
        # The rotary tables are the model's only buffers, constants: no broadcast of them at every
        # forward, which would be a collective on the default group, waiting for a stalled rank for the
        # group's own timeout rather than the guard's.
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if cuda else None, broadcast_buffers=False
        )
        guard.attach_ddp(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        guard.attach_fsdp(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard.attach_optimizer(optimizer)

    try:
        for step in range(args.steps):
            inputs, targets = data.batch()
            loss = lm_loss(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0 and step % 20 == 0:
                print(f"step {step:4d} loss {loss.item():.3f}", flush=True)
    except aegis.RankExchangeError as error:
        print(f"rank {rank}: {error}", file=sys.stderr, flush=True)
        os._exit(1)  # not sys.exit: tearing the process group down would wait for the stalled rank
    summary = guard.close()
    print(f"rank {rank}: {summary.checks} checks, {summary.confirmed} confirmed, "
          f"{summary.outlier_warnings} outlier warnings, {summary.false_alarms} false alarms", flush=True)  # fmt: skip
    dist.barrier()
    if rank == 0:
        for incident in read_incidents(run_dir):
            print(f"incident: rank {incident['rank']} {incident['device']} {incident['site']} step {incident['step']}")
        for warning in read_warnings(run_dir):
            print(f"warning: {warning['message']}")
        print(f"run directory: {run_dir} (aegis incidents {run_dir})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
