"""Per-step cost of the data-parallel sensors on GPUs over NCCL, on the workload at GPU scale (bf16):
the rank exchange, and the gradient all-reduce check against plain DDP in the same run.

    torchrun --nproc-per-node 2 benchmarks/distributed_gpu.py [--out benchmarks/results/distributed_gpu.json]

Step times are CUDA-event medians over `--steps` steps after `--warmup`, random tokens; the checked
step includes what the guard does with the check at the step's end (one transfer of every bucket's
result). The exchange is timed alone (it runs on its gloo group between steps), with the payload of
this model's GEMM sites and of a 32-layer model's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from aegis_sdc.distributed.comm_check import CommChecks, checked_allreduce_hook
from aegis_sdc.distributed.context import DistContext
from aegis_sdc.events import CommKind, Site
from aegis_sdc.guard import COMM_SLOTS
from aegis_sdc.workloads.data import SyntheticTokens, TokenStreamConfig
from aegis_sdc.workloads.llama import Llama, LlamaConfig, lm_loss

CFG = LlamaConfig(vocab_size=32768, dim=2048, n_layers=4, n_heads=16, n_kv_heads=8, hidden_dim=5632, max_seq_len=2048)


def step_times(device: torch.device, checked: bool, batches: list, warmup: int) -> list[float]:
    torch.manual_seed(0)
    model = Llama(CFG).to(device, torch.bfloat16)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    checks = None
    if checked:
        sites: dict[str, Site] = {}
        checks = CommChecks(64, lambda name, kind: sites.setdefault(name, Site(len(sites), name, kind, kind.value)))
        ddp.register_comm_hook(None, checked_allreduce_hook(checks, None, CommKind.ALLREDUCE))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    times = []
    for i, (x, y) in enumerate(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = lm_loss(ddp(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if checks is not None:  # the guard's step end: every bucket's largest ratio, one transfer
            records = checks.take()
            ratios = torch.stack([r.ratios().max() for r in records]).cpu().tolist()
            assert max(ratios) <= 1.0, f"a clean all-reduce failed its check: {ratios}"
        optimizer.step()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    del ddp, model, optimizer
    torch.cuda.empty_cache()
    return times


def exchange_ms(ctx: DistContext, sites: int, reps: int = 100) -> float:
    payload = torch.randn(sites + COMM_SLOTS, dtype=torch.float64)
    for i in range(10):
        ctx.all_gather(payload, i)
    times = []
    for i in range(reps):
        started = time.perf_counter()
        ctx.all_gather(payload, i)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "distributed_gpu.json")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2, help="sequences of 2048 tokens per rank")
    args = parser.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()

    ctx = DistContext(None, 60.0)
    model_sites = 3 * 7 * CFG.n_layers + 3
    exchange = {"model": exchange_ms(ctx, model_sites), "32_layers": exchange_ms(ctx, 3 * 7 * 32 + 3)}
    stream = TokenStreamConfig(vocab_size=CFG.vocab_size, seq_len=2048, batch_size=args.batch, seed=rank)
    data = SyntheticTokens(stream, device=device)
    batches = [data.batch() for _ in range(args.warmup + args.steps)]  # the same batches for both
    plain = step_times(device, False, batches, args.warmup)
    checked = step_times(device, True, batches, args.warmup)
    plain_ms, checked_ms = statistics.median(plain), statistics.median(checked)
    mine = torch.tensor([exchange["model"], exchange["32_layers"], plain_ms, checked_ms], dtype=torch.float64)
    gathered = ctx.all_gather(mine, 0).tolist()  # every rank's figures, for the record
    ctx.close()
    if rank == 0:
        names = ("exchange_ms", "exchange_32_layers_ms", "ddp_step_ms", "checked_step_ms")
        rows = [{"rank": r, **dict(zip(names, g, strict=True))} for r, g in enumerate(gathered)]
        summary = {
            "world": world,
            "exchange_ms": max(r["exchange_ms"] for r in rows),
            "exchange_32_layers_ms": max(r["exchange_32_layers_ms"] for r in rows),
            "ddp_step_ms": statistics.median(r["ddp_step_ms"] for r in rows),
            "checked_step_ms": statistics.median(r["checked_step_ms"] for r in rows),
        }
        summary["allreduce_check_overhead"] = summary["checked_step_ms"] / summary["ddp_step_ms"] - 1
        summary["exchange_fraction_of_step"] = summary["exchange_ms"] / summary["ddp_step_ms"]
        params = sum(p.numel() for p in Llama(CFG).parameters())
        result = {
            "env": {
                "gpu": torch.cuda.get_device_name(device),
                "gpus": world,
                "torch": torch.__version__,
                "nccl": str(torch.cuda.nccl.version()),
                "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": "torchrun --nproc-per-node {} {}".format(world, " ".join(sys.argv)),
                "model": f"Llama dim {CFG.dim}, {CFG.n_layers} layers, {params / 1e6:.0f} M parameters, bf16, "
                f"{args.batch}×2048 tokens per rank, DDP default 25 MB buckets",
            },
            "rows": rows,
            "summary": summary,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(json.dumps(summary), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
