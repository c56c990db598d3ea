"""What the GPU benchmarks share: the record they write (`gpu_environment`, `write_result`), the
timed training-step loop (`timed_steps`), the two clocks of a kernel (`device_ms`, `host_us`), a
kernel module loaded again with edits (`module_with_edits`: the diagnoses' variants) and a kernel
compiled for sm_90a without a GPU (`compile_for_sm90a`, `bundled_tool`: registers, spills, SASS).
Imported as `common` (benchmarks/ is the script's directory)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import triton
from triton.testing import do_bench_cudagraph

from aegis_sdc.workloads.llama import lm_loss


def timed_steps(model, optimizer, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], warmup: int) -> list[float]:
    """Milliseconds per step after the first `warmup` steps."""
    times = []
    for i, (x, y) in enumerate(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = lm_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return times


def device_ms(fn: Callable[[], Any]) -> float:
    """GPU milliseconds per call of `fn`: calls unrolled into one CUDA graph and replayed
    (`triton.testing.do_bench_cudagraph`, median of its replays). What the GPU spends, without the
    host's launch time, which `do_bench` adds whenever a call's host work outlasts its kernel (a
    small GEMM): the kernel's speed is measured here, the launch path by `host_us`."""
    return do_bench_cudagraph(fn, rep=20, return_mode="median")


def host_us(fn: Callable[[], Any], n: int = 200) -> float:
    """Host microseconds per call, calls queued without synchronizing: what one call costs the
    training thread (a step is host-bound when these add up to more than its GPU time)."""
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - started
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def code_version() -> str:
    """The commit a result measured (`git rev-parse --short HEAD`, `+changes` over a dirty tree), or "unknown"."""
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def gpu_environment(**extra: Any) -> dict[str, Any]:
    """The `env` of a result: the GPU, library versions, the code, the date and the exact command, plus `extra`."""
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "code": code_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["python", *sys.argv]),
        **extra,
    }


def write_result(out: Path, env: dict[str, Any], rows: Any, summary: Any = None, **more: Any) -> None:
    """Write {env, rows, summary, ...} as JSON (the record under benchmarks/results/) and print the summary."""
    result = {"env": env, "rows": rows, **({"summary": summary} if summary is not None else {}), **more}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    if summary is not None:
        print(json.dumps(summary, indent=2), flush=True)


def module_with_edits(source_path: Path, edits: list[tuple[str, str, int]], name: str, what: str):
    """The module at `source_path` loaded again from its source with each (anchor, replacement, count)
    edit made — every anchor must occur `count` times, or the source changed under the edit (`what`
    names it in the error). From a file: Triton and the CuTe DSL read a kernel's source back."""
    import importlib.util
    import tempfile

    source = Path(source_path).read_text()
    for anchor, replacement, count in edits:
        if source.count(anchor) != count:
            raise SystemExit(f"{what} changed: {anchor.strip()[:60]!r} found {source.count(anchor)} times, not {count}")
        source = source.replace(anchor, replacement)
    path = Path(tempfile.mkdtemp(prefix="aegis_edited_")) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def bundled_tool(*names: str) -> str:
    """The first of `names` (e.g. "ptxas-blackwell", "ptxas") that Triton bundles for CUDA."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in names:
        if (tools / name).exists():
            return str(tools / name)
    raise SystemExit(f"none of {names} under {tools}")


def descriptor_type(box: list[int], dtype: str, layout: Any) -> str:
    """A TMA descriptor argument's type as the compiler names it (`tensordesc<bf16[128, 64],…>`), for
    compiling a Gluon kernel without a GPU; `dtype` as Triton spells it ("bf16", "fp32")."""
    return f"tensordesc<{dtype}[{', '.join(map(str, box))}],{layout!r}>"


def compile_for_sm90a(fn, signature: dict, constexprs: dict, gluon: bool = False, divisible: tuple = (),
                      **options: Any):  # fmt: skip
    """`fn` (a Triton or, with `gluon`, a Gluon kernel) compiled for sm_90a on any machine, no GPU:
    (the compiled kernel, its ptxas -v report, registers per thread, spill store bytes, spill load bytes).
    `divisible`: the arguments a launch would specialize as multiples of 16 (16-byte aligned pointers,
    integers divisible by 16) — what lets Triton vectorize and pipeline pointer loads, so a kernel
    that loads through pointers compiles here as it would for such a launch."""
    import os
    import re
    import tempfile

    from triton.backends.compiler import GPUTarget

    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        from triton.compiler import ASTSource as Source
    names = fn.arg_names
    source = Source(fn=fn, signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                    constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in divisible})  # fmt: skip
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        run = subprocess.run([bundled_tool("ptxas-blackwell", "ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o",
                              os.devnull], capture_output=True, text=True, check=True)  # fmt: skip
    report = run.stdout + run.stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    stores, loads = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report).groups())
    return compiled, report, registers, stores, loads
