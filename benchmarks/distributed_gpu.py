"""Per-step cost of the data-parallel sensors on GPUs over NCCL, on the workload at GPU scale (bf16):
the rank exchange, the gradient all-reduce check against plain DDP and the reduce-scatter check
against plain FSDP2, in the same run.

    torchrun --nproc-per-node 2 benchmarks/distributed_gpu.py [--out benchmarks/results/distributed_gpu.json]

Step times are CUDA-event medians over `--steps` steps after `--warmup`, random tokens; the checked
step includes what the guard does with the check at the step's end (one transfer of every bucket's
result). `ddp_sum_hook` is a communication hook with the checked hook's shape but no checksums: the
cost of replacing DDP's built-in all-reduce by a Python hook, separated from the checks. The
exchange is timed alone (it runs on its gloo group between steps), with the payload of this model's
GEMM sites and of a 32-layer model's.
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

from aegis_sdc.distributed.comm_check import CheckedReduceScatter, CommChecks, checked_allreduce_hook, max_ratios
from aegis_sdc.distributed.context import DistContext
from aegis_sdc.events import CommKind, Site
from aegis_sdc.runtime.step import COMM_SLOTS
from aegis_sdc.workloads.data import SyntheticTokens, TokenStreamConfig
from aegis_sdc.workloads.llama import Llama, LlamaConfig, lm_loss

CFG = LlamaConfig(vocab_size=32768, dim=2048, n_layers=4, n_heads=16, n_kv_heads=8, hidden_dim=5632, max_seq_len=2048)


MODES = ("ddp", "ddp_sum_hook", "ddp_checked", "fsdp2", "fsdp2_checked")


def wrap(model: torch.nn.Module, device: torch.device, mode: str) -> tuple[torch.nn.Module, CommChecks | None]:
    """The model under DDP or FSDP2, with the collective checks (`*_checked`), or with a plain sum
    all-reduce hook of the same shape as the checked one (`ddp_sum_hook`: the hook mechanism alone)."""
    sites: dict[str, Site] = {}
    checks = CommChecks(64, lambda name, kind: sites.setdefault(name, Site(len(sites), name, kind, kind.value)))
    if mode.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        if mode == "fsdp2_checked":
            for name, module in model.named_modules():
                if hasattr(module, "set_custom_reduce_scatter"):
                    checked = CheckedReduceScatter(checks, f"fsdp.{name}", CommKind.REDUCE_SCATTER)
                    module.set_custom_reduce_scatter(checked)
        return model, checks if mode == "fsdp2_checked" else None
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    if mode == "ddp_checked":
        ddp.register_comm_hook(None, checked_allreduce_hook(checks, None, CommKind.ALLREDUCE))
        return ddp, checks
    if mode == "ddp_sum_hook":

        def hook(state, bucket):
            future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
            return future.then(lambda fut: fut.value()[0].div_(dist.get_world_size()))

        ddp.register_comm_hook(None, hook)
    return ddp, None


def run_steps(device: torch.device, mode: str, batches: list, warmup: int, profile: bool = False) -> list[float]:
    torch.manual_seed(0)
    model, checks = wrap(Llama(CFG).to(device, torch.bfloat16), device, mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    profiler = torch.profiler.profile(activities=activities)
    for i, (x, y) in enumerate(batches):
        if profile and i == warmup:
            profiler.start()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = lm_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if checks is not None:  # the guard's step end: every collective's largest ratio, one transfer
            ratios = max_ratios(checks.take()).cpu().tolist()
            assert max(ratios) <= 1.0, f"a clean collective failed its check: {ratios}"
        optimizer.step()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    if profile:
        profiler.stop()
        print(profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=48))
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=48))
    del model, optimizer
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
    parser.add_argument("--profile", action="store_true", help="print rank 0's profile of 3 checked DDP steps")
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
    times = {mode: statistics.median(run_steps(device, mode, batches, args.warmup)) for mode in MODES}
    if args.profile:
        run_steps(device, "ddp_checked", batches[: args.warmup + 3], args.warmup, profile=rank == 0)
    mine = torch.tensor([exchange["model"], exchange["32_layers"], *times.values()], dtype=torch.float64)
    gathered = ctx.all_gather(mine, 0).tolist()  # every rank's figures, for the record
    ctx.close()
    if rank == 0:
        names = ("exchange_ms", "exchange_32_layers_ms", *(f"{mode}_step_ms" for mode in MODES))
        rows = [{"rank": r, **dict(zip(names, g, strict=True))} for r, g in enumerate(gathered)]
        summary = {
            "world": world,
            "exchange_ms": max(r["exchange_ms"] for r in rows),
            "exchange_32_layers_ms": max(r["exchange_32_layers_ms"] for r in rows),
            **{f"{mode}_step_ms": statistics.median(r[f"{mode}_step_ms"] for r in rows) for mode in MODES},
        }
        summary["allreduce_check_overhead"] = summary["ddp_checked_step_ms"] / summary["ddp_step_ms"] - 1
        summary["sum_hook_overhead"] = summary["ddp_sum_hook_step_ms"] / summary["ddp_step_ms"] - 1
        summary["reduce_scatter_check_overhead"] = summary["fsdp2_checked_step_ms"] / summary["fsdp2_step_ms"] - 1
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
                f"{args.batch}×2048 tokens per rank, DDP default 25 MB buckets; FSDP2 per block + root",
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
