"""Cost of the state sensors on one GPU, as fractions of the unprotected training step.

The workload of the hot-path benchmark (benchmarks/e2e_step.py): Hugging Face `LlamaForCausalLM` at
the TinyLlama-1.1B shape, bf16, `AdamW(fused=True)`, 4 × 2048 tokens per step.

- `optimizer_replay_overhead`: the update replay at its default slices (sensors/update_replay.py),
  measured in the training step itself: one guard at p = 0 whose replay is switched on and off in
  interleaved rounds (each round as many steps as there are slices, so every slice is timed),
  against the unprotected step of the same rounds.
- `vote_overhead`: the replica vote at its defaults (sensors/state_vote.py), measured in the training
  step itself like the replay: the same guard takes a vote at every step's end (its slice of the
  parameters and of the optimizer state fingerprinted on the device, read with the step's transfer),
  switched on and off in the interleaved rounds. One GPU has no replica to exchange with: the vote's
  8 bytes per column ride the step's existing gather over the exchange group (`StepRuntime.exchange`), not
  timed here. Rows: also each vote synchronized on its own (launch, read, wait) for 1, 4 and 8
  parameter slices, and the host's part alone.
- `peer_replay_overhead`: a replay step's extra work (distributed/peer_replay.py) — the micro-batch's
  forward and backward once more (`torch.autograd.grad`), its gradients fingerprinted and read —
  divided by the default period (200 steps). The batch's exchange (its token ids) waits for a
  multi-GPU machine; a third execution runs only when a replay disagrees.
All GPU times from CUDA events around synchronized steps (median over rounds); rows keep every part.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import torch
from common import gpu_environment, write_result
from e2e_step import BATCH, CALIBRATION_STEPS, HF_SHAPE, SEQ, make_runner

from aegis_sdc.config import DistributedConfig, UpdateReplayConfig
from aegis_sdc.distributed.peer_replay import fingerprint_into
from aegis_sdc.kernels import fingerprint as kfp
from aegis_sdc.runtime.sensor_cost import SensorClock
from aegis_sdc.sensors.state_vote import StateVote
from aegis_sdc.sensors.update_replay import UpdateReplay


def _profiled(profiler: cProfile.Profile, fn):
    def wrapped(*a, **k):
        profiler.enable()
        try:
            return fn(*a, **k)
        finally:
            profiler.disable()

    return wrapped


def timed(fn, repeats: int) -> list[float]:
    """GPU milliseconds of `fn` by CUDA events, synchronized, `repeats` times."""
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/state_sensors.json"))
    args = parser.parse_args()
    distributed = DistributedConfig()
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, HF_SHAPE["vocab_size"], (BATCH, SEQ), device="cuda", generator=gen) for _ in range(4)]

    plain = make_runner("unprotected", "hf", compiled=False)
    guarded = make_runner("p0", "hf", compiled=False)
    guarded.guard.update_replay = None  # each configuration below gets its own
    in_step_vote = StateVote(guarded.guard.model, torch.device("cuda"), param_slices=distributed.vote_param_slices,
                             state_slices=distributed.vote_state_slices)  # fmt: skip
    for i in range(CALIBRATION_STEPS + 2):  # the guard's calibration checks, then steady state
        plain.step(batches[i % 4], record=False)
        guarded.step(batches[i % 4], record=False)

    # the update replay: the default, and a smaller slice every step (the same cycle of 64 steps)
    inner = guarded.guard.model
    configs = {
        f"replay_{c.slices}x{c.every}": c for c in (UpdateReplayConfig(), UpdateReplayConfig(slices=64, every=1))
    }
    replays = {
        name: UpdateReplay(inner, guarded.guard.fingerprint_pool, c.slices, c.every) for name, c in configs.items()
    }
    cycle = max(c.slices * c.every for c in configs.values())
    rows: dict = {"unprotected_ms": [], "p0_without_replay_ms": [], **{f"p0_{name}_ms": [] for name in configs},
                  "p0_vote_ms": []}  # fmt: skip
    host: dict = {name: {"before": [], "after": []} for name in configs}  # host ms of every hook call

    def host_timed(name: str, hook: str, fn):
        def wrapped(*a, **k):
            started = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                host[name][hook].append((time.perf_counter() - started) * 1000.0)

        return wrapped

    for name, replay in replays.items():
        replay.before, replay.after = host_timed(name, "before", replay.before), host_timed(name, "after", replay.after)
    # (label, runner, update replay, vote): the guard's sensors switched per run
    runs = [("unprotected_ms", plain, None, None), ("p0_without_replay_ms", guarded, None, None)]
    runs += [(f"p0_{name}_ms", guarded, replay, None) for name, replay in replays.items()]
    runs += [("p0_vote_ms", guarded, None, in_step_vote)]
    for _, runner, replay, vote in runs[1:]:  # one untimed cycle each: first copies of each slice's size
        runner.guard.update_replay, runner.guard.state_vote = replay, vote
        for i in range(cycle):
            runner.step(batches[i % 4], record=False)
    for hooks in host.values():
        for calls in hooks.values():
            calls.clear()
    guarded.guard.sensor_clock = SensorClock(torch.device("cuda"))  # the guard's own measure of the vote
    for _ in range(args.rounds):  # interleaved: every configuration sees the same machine state
        for label, runner, replay, vote in runs:
            if runner is guarded:
                runner.guard.update_replay, runner.guard.state_vote = replay, vote
            runner.gpu_ms.clear()
            for i in range(cycle):
                runner.step(batches[i % 4], record=True)
            rows[label].append(statistics.mean(runner.gpu_ms))
    guarded.guard.update_replay = guarded.guard.state_vote = None
    torch.cuda.synchronize()
    clock_costs = {"state_vote": guarded.guard.sensor_clock.cost("state_vote", 1).to_dict()}
    vote_ms = statistics.median(rows["p0_vote_ms"]) - statistics.median(rows["p0_without_replay_ms"])
    step_ms = statistics.median(rows["unprotected_ms"])
    # what the guard's own sensor clock (runtime/sensor_cost.py: events around each firing, read without
    # waiting) makes of the default replay, for the budget: one more cycle, against the medians above
    guarded.guard.sensor_clock = SensorClock(torch.device("cuda"))
    default_config = UpdateReplayConfig()
    guarded.guard.update_replay = UpdateReplay(
        inner, guarded.guard.fingerprint_pool, default_config.slices, default_config.every
    )
    for i in range(cycle):
        guarded.step(batches[i % 4], record=False)
    torch.cuda.synchronize()
    clock_costs["update_replay"] = guarded.guard.sensor_clock.cost("update_replay", default_config.every).to_dict()
    guarded.guard.update_replay = None
    base_ms = statistics.median(rows["p0_without_replay_ms"])
    replay_ms = {name: statistics.median(rows[f"p0_{name}_ms"]) - base_ms for name in configs}
    default_replay = "replay_{0.slices}x{0.every}".format(UpdateReplayConfig())

    # where a replay's host time goes (a separate cycle: the profiler slows what it watches)
    profiler = cProfile.Profile()
    replay = UpdateReplay(inner, guarded.guard.fingerprint_pool, 64, 1)  # a replay every step: the most calls
    guarded.guard.update_replay = replay
    replay.before = _profiled(profiler, replay.before)
    replay.after = _profiled(profiler, replay.after)
    for i in range(64):
        guarded.step(batches[i % 4], record=False)
    guarded.guard.update_replay = None
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
    args.out.with_name(args.out.stem + "_profile.txt").write_text(text.getvalue())

    # the vote, on the unprotected model: its defaults, and every parameter at every vote
    votes = {}
    for param_slices in sorted({distributed.vote_param_slices, 1, 4, 8}):
        vote = StateVote(plain.model, torch.device("cuda"), param_slices=param_slices,
                         state_slices=distributed.vote_state_slices)  # fmt: skip
        cycle = param_slices * distributed.vote_state_slices

        def one_vote(vote=vote) -> None:
            record = vote.take(0, plain.optimizer, 0)
            record.read()
            record.values(vote.width)

        for _ in range(cycle):  # the launch tables of every slice
            one_vote()
        taken = []
        for _ in range(cycle):  # the host's part: the launch, no wait
            torch.cuda.synchronize()
            started = time.perf_counter()
            vote.take(0, plain.optimizer, 0)
            taken.append((time.perf_counter() - started) * 1000.0)
        torch.cuda.synchronize()
        timings = [statistics.mean(timed(one_vote, cycle)) for _ in range(3)]  # three whole cycles: the median
        votes[param_slices] = {"ms": statistics.median(timings), "host_take_ms": statistics.mean(taken)}
    params = [p for p in plain.model.parameters() if p.requires_grad]

    def peer_replay_work() -> None:
        batch = batches[0]
        loss = plain.model(input_ids=batch, labels=batch).loss
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        rows_ = torch.zeros(len(params), kfp.ROW, dtype=torch.int32, device="cuda")
        seen = torch.zeros(len(grads), dtype=torch.bool)
        fingerprint_into(list(zip(grads, range(len(grads)), strict=True)), rows_, seen)
        rows_.cpu()

    peer_replay_work()
    peer_ms = statistics.median(timed(peer_replay_work, args.rounds))

    rows.update(
        step_ms=step_ms,
        optimizer_replay_ms_per_step=replay_ms,
        optimizer_replay_default=default_replay,
        optimizer_replay_host_ms_per_step={  # the hooks' host time, averaged over every step of the rounds
            name: {hook: statistics.mean(v) for hook, v in hooks.items() if v} for name, hooks in host.items()
        },
        optimizer_replays=sum(r.replays for r in replays.values()),
        sensor_clock=clock_costs,  # the guard's own measures: ms per firing, against the timings above
        confirmed=guarded.guard.summary().confirmed,  # clean training: the replays agreed bit for bit
        vote_ms=vote_ms,  # in the step: the vote's rounds against the same guard's without it
        vote_synchronized_by_param_slices=votes,  # each vote on its own: launch, read, wait
        vote_param_slices=distributed.vote_param_slices,
        vote_state_slices=distributed.vote_state_slices,
        vote_bytes_per_step=sum(p.numel() * p.element_size() for p in params),
        peer_replay_ms=peer_ms,
        peer_replay_period=distributed.peer_replay_period,
        parameters=len(params),
    )
    summary = {
        "vote_overhead": vote_ms / step_ms,
        "peer_replay_overhead": peer_ms / distributed.peer_replay_period / step_ms,
        "optimizer_replay_overhead": replay_ms[default_replay] / step_ms,
        "targets": {"vote_overhead": 0.005, "peer_replay_overhead": 0.01, "optimizer_replay_overhead": 0.005},
    }
    summary["targets_met"] = all(summary[key] <= limit for key, limit in summary["targets"].items())
    env = gpu_environment(batch=BATCH, seq=SEQ, hf_shape=HF_SHAPE, optimizer="AdamW(fused=True)", dtype="bf16")
    write_result(args.out, env, rows, summary)


if __name__ == "__main__":
    main()
