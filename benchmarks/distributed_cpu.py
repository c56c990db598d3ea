"""Per-step cost of the data-parallel sensors on the CPU (gloo): the rank exchange, and the
all-reduce check against a plain DDP backward, with 2 and 4 processes.

    python benchmarks/distributed_cpu.py [--out benchmarks/results/distributed_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import dist_workers


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, sites: int) -> list[dict]:
    out = tempfile.mkdtemp()
    ctx = mp.get_context("spawn")
    p = port()
    procs = [
        ctx.Process(target=dist_workers.exchange_cost, args=(r, world, p, out, {"sites": sites})) for r in range(world)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(600)
    return [json.loads(Path(out, f"result{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "distributed_cpu.json")
    parser.add_argument("--sites", type=int, default=3 * 7 * 32 + 3, help="GEMM sites exchanged (a 32-layer model)")
    args = parser.parse_args()
    rows = []
    for world in (2, 4):
        results = run(world, args.sites)
        row = {
            "world": world,
            "sites": args.sites,
            "exchange_ms": statistics.median(r["exchange_ms"] for r in results),
            "ddp_backward_ms": statistics.median(r["ddp_backward_ms"] for r in results),
            "checked_backward_ms": statistics.median(r["checked_backward_ms"] for r in results),
        }
        row["allreduce_check_overhead"] = row["checked_backward_ms"] / row["ddp_backward_ms"] - 1
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {
        "env": {
            "device": "cpu (gloo)",
            "cores": mp.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(["python", *sys.argv]),
            "ddp_model": "8 × Linear(1024, 1024), batch 64, fp32, default 25 MB buckets",
        },
        "rows": rows,
        "summary": {f"world{r['world']}": {k: r[k] for k in ("exchange_ms", "allreduce_check_overhead")} for r in rows},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
