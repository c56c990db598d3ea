"""What protection costs a whole training step on the GPU, against the unprotected step in the same run.

Workloads: Hugging Face `LlamaForCausalLM` at the TinyLlama-1.1B shape (hidden 2048, 22 layers, GQA
32/4, SwiGLU 5632, vocab 32000) and the project's own Llama workload; bf16 weights,
`AdamW(fused=True)`, 4 × 2048 tokens per step. Configs: unprotected; protected with nothing sampled
after calibration (p = 0); protected within a 1% budget; every GEMM checked. Each config is a real
`protect()` of its own copy of the model (same seed), calibrated before timing; rounds are
interleaved so that clock and thermal drift hit every config alike. A budget's first plan times
every site's check once (seconds): the warm-up runs until it is made, and its step's time is
reported apart (`first_plan_s`); then through one cycle under that plan, until the budget replans
with what the plan really cost (the steady state). Overheads are ratios of mean step times. Per step: CUDA events around
forward, backward and optimizer step (synchronized each step), and the host's own time to enqueue the
step — a step whose host time exceeds its GPU time is host-bound.

    python benchmarks/e2e_step.py [--workloads hf,own] [--modes eager,compiled] [--rounds 5] [--steps 6]
                                  [--triton-attention] [--stall-probe] [--profile DIR] [--resume]
                                  [--evidence inline|second-launch] [--out benchmarks/results/e2e_step.json]

`--triton-attention` routes protected attention to the checked Triton kernels
(ops/checked_attention.TRITON_ON_CUDA; each row's summary then carries the checked share of the
attention FLOPs, `attention_checked_flops_fraction`). `--evidence second-launch` runs every checked
GEMM's evidence in a second launch instead of inside the GEMM's (in `gemm_diagnose.json` the second
launch cost 0–7% less GPU time per GEMM and 20–40 µs more host time: which wins in a whole step is
this benchmark's to say). `--stall-probe` samples every thread's Python
stack every 5 ms during the timed steps; a step whose host time exceeds 1.5 × its config's
median keeps the stacks seen most often in it (`stalls` in its row, with the caching allocator's
retries in that step): where a slow step's time went. A diagnostic, not for the record: the sampler
takes the GIL every 5 ms, which a host-bound config feels.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from common import gpu_environment, write_result  # benchmarks/ is the script's directory

import aegis_sdc as aegis
from aegis_sdc.store.sqlite import read_events
from aegis_sdc.workloads.llama import Llama, LlamaConfig, lm_loss

BATCH, SEQ = 4, 2048
HF_SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000, max_position_embeddings=SEQ)  # fmt: skip
OWN_SHAPE = LlamaConfig(vocab_size=32000, dim=2048, n_layers=8, n_heads=32, n_kv_heads=4, hidden_dim=5632,
                        max_seq_len=SEQ)  # fmt: skip
PROFILE_KERNELS = 40  # kernels listed per config: the checks' own (weight sums, fingerprints, evidence) are small
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
CALIBRATION_STEPS = 18  # every site's 16 calibration checks, and two steps to settle
PLAN_STEPS = 40  # at most this many more warm-up steps while a budget's first plan is not made
RESCALE_STEPS = 80  # and at most this many under the first plan, until the budget replans (its cycle)
CONFIGS: dict[str, aegis.SamplingConfig | None] = {
    "unprotected": None,
    "p0": aegis.SamplingConfig(probability=0.0),
    "budget_1pct": aegis.SamplingConfig(budget=0.01),
    "full": aegis.SamplingConfig.every_call(),
}


class StallProbe:
    """Where the host spends a step that takes far longer than its config's others: a thread samples
    every thread's Python stack every `interval` seconds while a step runs (sys._current_frames:
    no tracing, nothing in the step's own path), and a step whose host time exceeds `factor` × the
    config's median keeps its most frequent frames (`stalls` in the row)."""

    def __init__(self, interval: float = 0.005, factor: float = 1.5) -> None:
        self.interval, self.factor = interval, factor
        self.target = threading.get_ident()
        self.samples: collections.Counter[str] = collections.Counter()
        self.running = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        me = threading.get_ident()
        while True:
            self.running.wait()
            # every thread but this one: autograd runs the backward's Python (our ops' backward) on a
            # thread of its own while the training thread waits in the engine
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = traceback.extract_stack(frame)[-6:]
                where = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(stack))
                self.samples[("main: " if ident == self.target else "other: ") + where] += 1
            time.sleep(self.interval)

    def start(self) -> None:
        self.samples.clear()
        self.running.set()

    def stop(self) -> collections.Counter[str]:
        self.running.clear()
        return collections.Counter(self.samples)


@dataclasses.dataclass
class Runner:
    """One config's model, optimizer and guard, and its timings."""

    label: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step_fn: Any
    guard: aegis.Guard | None
    gpu_ms: list[float] = dataclasses.field(default_factory=list)
    host_ms: list[float] = dataclasses.field(default_factory=list)
    checked_fraction: list[float] = dataclasses.field(default_factory=list)
    first_plan_s: float | None = None  # the warm-up step in which a budget made its first plan
    probe: StallProbe | None = None
    stack_samples: list[collections.Counter[str]] = dataclasses.field(default_factory=list)
    alloc_retries: list[int] = dataclasses.field(default_factory=list)  # the caching allocator's, per step

    def step(self, batch: torch.Tensor, record: bool) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        waited = self.guard.host_wait_ms if self.guard is not None else 0.0
        if record and self.probe is not None:
            self.probe.start()
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if record else 0
        host0 = time.perf_counter()
        start.record()
        self.step_fn(self.model, batch)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        end.record()
        # the host's own work: its time to enqueue the step, less the time it waited for the device
        host = (time.perf_counter() - host0) * 1000.0 - ((self.guard.host_wait_ms - waited) if self.guard else 0.0)
        torch.cuda.synchronize()
        if record and self.probe is not None:
            self.stack_samples.append(self.probe.stop())
        if record:
            # a retry frees every cached block and synchronizes: hundreds of ms, the model's or not
            self.alloc_retries.append(torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries)
            self.gpu_ms.append(start.elapsed_time(end))
            self.host_ms.append(host)
            if self.guard is not None:
                self.checked_fraction.append(self.guard.last_checked_flops_fraction)


def hf_model() -> tuple[torch.nn.Module, Any]:
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(HFLlamaConfig(**HF_SHAPE, attn_implementation="sdpa"))

    def step_fn(model, batch):
        model(input_ids=batch, labels=batch).loss.backward()

    return model, step_fn


def own_model() -> tuple[torch.nn.Module, Any]:
    model = Llama(OWN_SHAPE)

    def step_fn(model, batch):
        lm_loss(model(batch[:, :-1]), batch[:, 1:]).backward()

    return model, step_fn


def make_runner(label: str, workload: str, compiled: bool) -> Runner:
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialize on the device: seconds instead of a minute per copy
        model, step_fn = (hf_model if workload == "hf" else own_model)()
    model = model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    guard = None
    sampling = CONFIGS[label]
    if sampling is not None:
        # p = 0: nothing checked, saved tensors included — what the instrumentation alone costs (a
        # saved-tensor step, 1% of steps by default, costs 40–75 ms: the budget pays for it)
        fingerprints = aegis.FingerprintConfig(saved_probability=0.0) if label == "p0" else aegis.FingerprintConfig()
        config = aegis.GuardConfig(run_dir=tempfile.mkdtemp(prefix=f"e2e-{workload}-{label}-"), sampling=sampling,
                                   fingerprints=fingerprints)  # fmt: skip
        guard = aegis.protect(model, optimizer=optimizer, config=config)
    if compiled:
        model = torch.compile(model)
    return Runner(label, model, optimizer, step_fn, guard)


def run_workload(workload: str, args: argparse.Namespace, compiled: bool) -> dict[str, Any]:
    vocab = HF_SHAPE["vocab_size"]
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, vocab, (BATCH, SEQ), device="cuda", generator=gen) for _ in range(8)]
    runners = [make_runner(label, workload, compiled) for label in args.configs]
    if args.stall_probe:
        probe = StallProbe()
        for runner in runners:
            runner.probe = probe
    for runner in runners:  # calibration (and compilation) before anything is timed
        started = time.perf_counter()
        for i in range(CALIBRATION_STEPS):
            runner.step(batches[i % len(batches)], record=False)
        # Under a budget, on until the first plan is made: it times every site's check at its shape
        # (and compiles what that needs), seconds once per run — reported apart as `first_plan_s`,
        # and kept out of the steady-state steps that are timed.
        guard, extra = runner.guard, 0
        while guard is not None and guard.budget is not None and guard.budget_plan is None and extra < PLAN_STEPS:
            step_started = time.perf_counter()
            runner.step(batches[extra % len(batches)], record=False)
            extra += 1
            if guard.budget_plan is not None:
                runner.first_plan_s = time.perf_counter() - step_started
        # Then through the first cycle under it: its next plan is scaled by what the first one really
        # cost (runtime/budget.py) — the plan of the steady state.
        first, more = (guard.budget_plan if guard is not None else None), 0
        while first is not None and guard.budget_plan is first and more < RESCALE_STEPS:
            runner.step(batches[more % len(batches)], record=False)
            more += 1
        print(f"{workload}{' compiled' if compiled else ''} {runner.label}: warm-up "
              f"{time.perf_counter() - started:.1f} s", flush=True)  # fmt: skip
    for r in range(args.rounds):
        for runner in runners:
            runner.step(batches[r % len(batches)], record=False)  # re-warm after the other configs
            for i in range(args.steps):
                runner.step(batches[(r + i) % len(batches)], record=True)
    if args.profile is not None and not compiled:
        profile(workload, runners, batches[0], args.profile)
    rows = {}
    for runner in runners:
        summary = runner.guard.close() if runner.guard is not None else None
        rows[runner.label] = {
            "gpu_ms_median": statistics.median(runner.gpu_ms),
            "host_ms_median": statistics.median(runner.host_ms),
            "gpu_ms": runner.gpu_ms,
            "host_ms": runner.host_ms,
            "checked_flops_fraction": statistics.mean(runner.checked_fraction) if runner.checked_fraction else None,
            "summary": summary.to_dict() if summary is not None else None,
            # what the budget planned, as the guard logged it (cost model, checked shares, saved-tensor steps)
            "sampling_plans": [e["message"] for e in read_events(runner.guard.run_dir, ["sampling_plan"])]
            if runner.guard is not None
            else [],
            # the cost model the budget planned with: ms per check by kind and shape, sites, mean probability
            "check_costs": runner.guard.planner.cost_table() if runner.guard is not None else [],
            "gpu_ms_mean": statistics.mean(runner.gpu_ms),
            "first_plan_s": runner.first_plan_s,
            "stalls": stalls(runner),
            "alloc_retries": sum(runner.alloc_retries),
        }
        row = rows[runner.label]
        print(f"{workload}{' compiled' if compiled else ''} {runner.label:12s} gpu {row['gpu_ms_median']:8.2f} ms"
              f"  host {row['host_ms_median']:8.2f} ms", flush=True)  # fmt: skip
    del runners
    torch.cuda.empty_cache()
    return rows


def stalls(runner: Runner) -> list[dict[str, Any]]:
    """The recorded steps whose host time exceeds the probe's factor × the median: index, times and
    the five stacks the probe saw most often in them (count × interval ≈ seconds there)."""
    if runner.probe is None or not runner.host_ms:
        return []
    limit = runner.probe.factor * statistics.median(runner.host_ms)
    return [
        {"step": i, "gpu_ms": runner.gpu_ms[i], "host_ms": host,
         "alloc_retries": runner.alloc_retries[i] if i < len(runner.alloc_retries) else None,
         "stacks": runner.stack_samples[i].most_common(5) if i < len(runner.stack_samples) else []}
        for i, host in enumerate(runner.host_ms) if host > limit
    ]  # fmt: skip


def profile(workload: str, runners: list[Runner], batch: torch.Tensor, out: Path) -> None:
    """torch.profiler over two steps of each protected config: top kernels, launches, host time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for runner in runners:
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                runner.step(batch, record=False)
        events = prof.key_averages()
        kernels = sorted((e for e in events if e.device_time_total > 0 and e.device_type.name == "CUDA"),
                         key=lambda e: -e.device_time_total)  # fmt: skip
        gpu_total = sum(e.device_time_total for e in kernels) / 2 / 1000
        launches = (
            sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")) / 2
        )
        lines.append(f"== {workload} {runner.label}: GPU kernel time {gpu_total:.1f} ms/step, "
                     f"{launches:.0f} launches/step")  # fmt: skip
        for e in kernels[:PROFILE_KERNELS]:
            lines.append(f"  {e.device_time_total / 2 / 1000:8.2f} ms  {e.count // 2:6d}×  {e.key[:90]}")
    (out / f"e2e_step_profile_{workload}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def overheads(rows: dict[str, Any]) -> dict[str, float]:
    """Mean step time over the unprotected mean, less one. Means, not medians: sampling makes some
    steps cost more than others (a step that fingerprints its saved tensors, a replan), and the user
    pays the mean; a median would hide exactly those steps."""
    base = statistics.mean(rows["unprotected"]["gpu_ms"])
    return {label: statistics.mean(row["gpu_ms"]) / base - 1.0 for label, row in rows.items() if label != "unprotected"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="hf,own")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--modes", default="eager", help="eager and/or compiled (torch.compile'd models)")
    parser.add_argument("--resume", action="store_true", help="keep the workloads already in --out")
    parser.add_argument("--profile", type=Path, default=None, help="write a torch.profiler summary here")
    parser.add_argument("--triton-attention", action="store_true", help="check attention on the Triton kernels")
    parser.add_argument("--stall-probe", action="store_true", help="where slow steps' host time went (`stalls`)")
    parser.add_argument("--evidence", choices=("inline", "second-launch"), default="inline",
                        help="checked GEMMs' evidence inside their launch (default) or in a second one")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "e2e_step.json")
    args = parser.parse_args()
    if args.triton_attention:
        from aegis_sdc.ops import checked_attention

        checked_attention.TRITON_ON_CUDA = True
    if args.evidence == "second-launch":  # every shape class's configuration, evidence in a second launch
        from aegis_sdc.kernels import triton_gemm

        for shape_class, cfg in triton_gemm.HOPPER_TABLE.items():
            triton_gemm.HOPPER_TABLE[shape_class] = dataclasses.replace(cfg, inline_evidence=False)
    args.configs = args.configs.split(",")
    rows: dict[str, Any] = {}
    if args.resume and args.out.exists():
        rows = json.loads(args.out.read_text())["rows"]
    for workload in args.workloads.split(","):
        for mode in args.modes.split(","):
            key = workload if mode == "eager" else f"{workload}_compiled"
            if key not in rows:
                rows[key] = run_workload(workload, args, compiled=mode == "compiled")
    summary: dict[str, Any] = {}
    for suffix, key in (("", "hf"), ("_compiled", "hf_compiled")):
        if key not in rows:
            continue
        over = overheads(rows[key])
        summary |= {
            f"overhead_p0{suffix}": over.get("p0"),
            f"overhead_budget_1pct{suffix}": over.get("budget_1pct"),
            f"checked_gemm_flops_budget_1pct{suffix}": rows[key].get("budget_1pct", {}).get("checked_flops_fraction"),
            f"overhead_full{suffix}": over.get("full"),
        }
    summary["confirmed_clean"] = sum(
        (row["summary"] or {}).get("confirmed", 0) for workload in rows.values() for row in workload.values()
    )
    summary["host_bound_configs"] = [
        f"{w}:{label}" for w, configs in rows.items() for label, row in configs.items()
        if row["host_ms_median"] >= row["gpu_ms_median"]
    ]  # fmt: skip
    env = gpu_environment(batch=BATCH, seq=SEQ, hf_shape=HF_SHAPE, own_shape=dataclasses.asdict(OWN_SHAPE),
                          optimizer="AdamW(fused=True)", dtype="bf16", rounds=args.rounds,
                          steps=args.steps, triton_attention=args.triton_attention,
                          evidence=args.evidence)  # fmt: skip
    write_result(args.out, env, rows, summary, overheads={w: overheads(r) for w, r in rows.items()})


if __name__ == "__main__":
    main()
