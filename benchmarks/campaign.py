"""A fault campaign's record: `aegis campaign` on the project's Llama workload, written with the
benchmark's environment.

    python benchmarks/campaign.py [--trials 2000] [--device cpu|cuda] [--dtype float32|bfloat16] [--out FILE]
                                  [--plots DIR]
    python benchmarks/campaign.py --replot FILE --plots DIR     (the plots of a stored record)
    python benchmarks/campaign.py --ranks 3 [--trials 200]      (the all-reduce over gloo ranks)

CPU: `benchmarks/results/campaign_cpu.json` and the plots under `docs/campaign/`. `summary`:
`trials`, `confirmed_inside_coverage`, `missed_inside_coverage` (must be 0), `localized` (share of the
confirmed faults inside the claims found at their own site, step and tile), `false_confirmed` (in the
clean twins: must be 0), and the counts behind them. `--ranks N`: the campaign over N data-parallel
gloo ranks (campaign/ranks.py) → `benchmarks/results/campaign_ranks_cpu.json`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from common import code_version

from aegis_sdc.campaign import CampaignConfig, run_campaign
from aegis_sdc.campaign import report as campaign_report

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="the model's (default: float32 on the CPU, bfloat16 on CUDA)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plots", type=Path, default=None)
    parser.add_argument("--replot", type=Path, default=None, help="draw the plots of this record and stop")
    parser.add_argument("--ranks", type=int, default=0, help="over this many gloo ranks: the all-reduce's buckets")
    args = parser.parse_args()
    if args.ranks:
        ranks(args)
        return
    if args.replot is not None:
        campaign_report.plot(json.loads(args.replot.read_text()), args.plots or Path("."))
        return
    out = args.out or RESULTS / f"campaign_{'gpu' if args.device == 'cuda' else 'cpu'}.json"
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        if done % 100 == 0 or done == total:
            print(f"{done}/{total} trials, {time.perf_counter() - started:.0f} s", flush=True)

    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    result = run_campaign(CampaignConfig(trials=args.trials, device=args.device, seed=args.seed, dtype=dtype), progress)
    env = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "code": code_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["python", *sys.argv]),
    }  # fmt: skip
    doc = campaign_report.write(result, out, env)
    if args.plots is not None:
        campaign_report.plot(doc, args.plots)
    for location, counts in sorted(result.cells().items()):
        if counts["missed_inside"]:
            print("missed inside the claims:", location, counts, flush=True)
    print(result.summary(), flush=True)


def ranks(args: argparse.Namespace) -> None:
    from aegis_sdc.campaign.ranks import RankCampaignConfig, run_rank_campaign

    out = args.out or RESULTS / "campaign_ranks_cpu.json"
    result = run_rank_campaign(RankCampaignConfig(trials=args.trials, world=args.ranks, seed=args.seed))
    env = {"device": f"cpu (gloo, {args.ranks} processes)", "torch": torch.__version__, "code": code_version(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(["python", *sys.argv])}  # fmt: skip
    campaign_report.write(result, out, env)
    for cell, counts in sorted(result.cells().items()):
        print(cell, counts, flush=True)
    print(result.summary(), flush=True)


if __name__ == "__main__":
    main()
