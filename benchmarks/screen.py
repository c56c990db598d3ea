"""`aegis screen` on a GPU: a healthy device passes, a faulty one is flagged (src/aegis_sdc/response/screen.py).

1. healthy: the TinyLlama screen (5 Linear shapes × forward, dgrad, wgrad × scales 1e-3, 1, 1e3 at
   2048 tokens, bf16, the Triton checked GEMM) records a reference, then screens against it: PASS
   expected, every case bit-identical. `seconds` is the wall time of that second screen (the first
   compiles the kernel's variants).
2. faulty: the screened kernel made faulty through its in-kernel fault injection —
   - `mantissa`: bit 16 of one accumulator element of every key/value forward (the top mantissa bit
     bf16 keeps): far below the exact checksum bound, visible only against the reference;
   - `exponent`: bit 30 of one element of the down projection's wgrad at the first scale: the
     checksum alone flags it (screened without a reference).
   Flagged: FAIL, and the failing cases are exactly the faulted ones.
3. The command line, as a node check runs it: `aegis screen --against REF` exits 0 here, and 3 with
   the mantissa fault injected.

    python benchmarks/screen.py [--device cuda:0] [--shapes tinyllama] [--out benchmarks/results/screen.json]

Writes `env`, `rows` (one per screen) and `summary` {healthy_pass, faulty_flagged, seconds}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import gpu_environment, write_result

from aegis_sdc.faults.models import FaultSpec
from aegis_sdc.response import screen as sc

FAULTS = {
    "mantissa": ("k_v:fwd@model=bitflip,bit=16,probability=1", True),  # (spec, screened against the reference)
    "exponent": ("down:wgrad@model=bitflip,bit=30,steps=0", False),
}


def row(label: str, report: sc.ScreenReport, **extra) -> dict:
    return {
        "screen": label,
        "verdict": report.verdict,
        "exit_code": report.exit_code,
        "seconds": report.seconds,
        "cases": len(report.cases),
        "alarms": sum(c.alarm for c in report.cases),
        "faulted": [c.name for c in report.cases if c.faulted],
        "failing": report.failing(),
        "reference": report.reference,
        "notes": report.notes,
        **extra,
    }


def cli(device: str, *args: str) -> tuple[int, float, str]:
    """`aegis screen` in a process of its own: (exit status, seconds, its last lines)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "aegis_sdc", "screen", "--device", device, *args],
                          capture_output=True, text=True, timeout=400)  # fmt: skip
    return done.returncode, time.perf_counter() - start, "\n".join((done.stdout + done.stderr).splitlines()[-6:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--shapes", default="tinyllama")
    parser.add_argument("--tokens", type=int, default=sc.DEFAULT_TOKENS)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/screen.json"))
    args = parser.parse_args()
    ref_path = Path(tempfile.mkdtemp()) / "screen-reference.json"
    rows = []

    recorded = sc.screen(args.device, shapes=args.shapes, tokens=args.tokens)
    sc.write_reference(recorded, ref_path)
    rows.append(row("record", recorded, case_rows=[
        {"case": c.name, "shape": c.shape, "ms": c.ms, "row": c.row, "row_bound": c.row_bound, "col": c.col}
        for c in recorded.cases]))  # fmt: skip
    print(f"record: {recorded.verdict} in {recorded.seconds:.1f} s", flush=True)
    reference = sc.load_reference(ref_path)
    healthy = sc.screen(args.device, against=reference)
    rows.append(row("healthy", healthy))
    print(f"healthy: {healthy.verdict} in {healthy.seconds:.1f} s", flush=True)
    healthy_pass = recorded.verdict == sc.PASS and healthy.verdict == sc.PASS and not healthy.reference["differs"]

    flagged = []
    for label, (text, with_reference) in FAULTS.items():
        spec = FaultSpec.parse(text)
        if with_reference:
            report = sc.screen(args.device, against=reference, fault=spec)
        else:
            report = sc.screen(args.device, shapes=args.shapes, tokens=args.tokens, fault=spec)
        faulted = {c.name for c in report.cases if c.faulted}
        named = {f["case"] for f in report.failing()}
        flagged.append(report.verdict == sc.FAIL and bool(faulted) and named == faulted)
        rows.append(row(label, report, spec=text, named_exactly_the_faulted=named == faulted))
        print(f"{label}: {report.verdict}, failing {sorted(named)}", flush=True)

    for label, extra, expected in (("cli-healthy", (), sc.EXIT_PASS),
                                   ("cli-mantissa", ("--inject", FAULTS["mantissa"][0]), sc.EXIT_FAIL)):  # fmt: skip
        code, seconds, tail = cli(args.device, "--against", str(ref_path), *extra)
        rows.append({"screen": label, "exit_code": code, "expected": expected, "seconds": seconds, "output": tail})
        print(f"{label}: exit {code} in {seconds:.1f} s", flush=True)
        if label == "cli-healthy":
            healthy_pass = healthy_pass and code == expected
        else:
            flagged.append(code == expected)

    code = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    env = gpu_environment(device=healthy.env["device"], code=code, shapes=args.shapes, tokens=args.tokens,
                          scales=list(sc.DEFAULT_SCALES), kernel=healthy.env["kernel"])  # fmt: skip
    summary = {"healthy_pass": int(healthy_pass), "faulty_flagged": int(all(flagged)), "seconds": healthy.seconds}
    write_result(args.out, env, rows, summary)
    print(json.dumps({"cuda_max_memory_gib": torch.cuda.max_memory_allocated() / 2**30}))


if __name__ == "__main__":
    main()
