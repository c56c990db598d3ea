"""One step's evidence, from the device to the host in one read that nothing waits for.

`collect` takes what the step recorded — per checked GEMM an evidence slot (Triton: int64 [8] on the
device; reference path: float64 [9] on the CPU), per attention check on the Triton kernels its
maxima and suspect head (sensors/attention.py), per collective its largest mismatch, the
fingerprints — packs the device tensors into one transfer to pinned memory, and can derive on the
device the step's alarm flag (the optimizer gate, runtime/gate.py). `read` waits for the transfer
and decodes each slot into the evidence layout the sensors judge (sensors/gemm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aegis_sdc.kernels.triton_gemm import ST_ALARM
from aegis_sdc.ops.fingerprint import FingerprintPool
from aegis_sdc.ops.transfer import PendingTransfer, start_to_host
from aegis_sdc.sensors.attention import AttentionRecord
from aegis_sdc.sensors.gemm import CallRecord


@dataclass
class Collected:
    """One step's records, with their evidence on the way to the host."""

    step: int
    records: list[CallRecord]  # checked GEMM calls
    comm_records: list  # checked collectives
    fp_records: list  # fingerprint checks
    attention: list[AttentionRecord]
    transfer: PendingTransfer | None = None
    reference: tuple[int, ...] = ()  # records on the reference path (evidence already on the host)
    triton: tuple[int, ...] = ()  # records of Triton launches (evidence slots on the device)
    deferred_attention: tuple[AttentionRecord, ...] = ()  # attention checks whose values are on the device
    has_comm: bool = False
    n_evidence: int = 0  # tensors in the transfer before the fingerprint buffers
    gate: torch.Tensor | None = None  # float32 [] on the device: 1 when any check alarmed
    fp_on_device: bool = False  # the fingerprint checks are in `gate` (compared on the device)
    held_found_inf: torch.Tensor | None = None  # the optimizer's own found_inf (GradScaler), restored after

    def nothing_to_judge(self) -> bool:
        """No check of any kind ran this step (what is read is bookkeeping: nothing can alarm)."""
        return not (self.records or self.comm_records or self.fp_records or self.attention)

    def alarmed_on_host(self) -> bool:
        """Reference-path and attention alarms are known on the host already."""
        return any(r.raw is None and r.alarm for r in self.records) or any(
            r.capture is not None for r in self.attention
        )


def collect(
    step: int, records: list[CallRecord], comm_records: list, comm_ratios: torch.Tensor | None, fp_records: list,
    attention: list[AttentionRecord], fingerprint_rows: list[torch.Tensor], *, gate: bool,
    fingerprints_differ: torch.Tensor | None = None,
) -> Collected:  # fmt: skip
    """Start the step's read (see the module docstring); with `gate`, the device-side alarm flag.
    `fingerprints_differ`: the fingerprint checks compared on the device (`FingerprintPool.differ_on_device`;
    None: the host judges them) — they join the gate."""
    collected = Collected(step, records, comm_records, fp_records, attention)
    collected.reference = tuple(i for i, r in enumerate(records) if r.raw is None)
    collected.triton = tuple(i for i, r in enumerate(records) if r.raw is not None)
    wanted, alarm_flags = [], []
    if collected.reference:
        wanted.append(torch.stack([records[i].stats for i in collected.reference]))
    if collected.triton:
        raw = torch.stack([records[i].raw for i in collected.triton])  # [calls, 8] int64
        wanted.append(raw)
        alarm_flags.append((raw[:, ST_ALARM] != 0).any())
    collected.deferred_attention = tuple(r for r in attention if r.pending is not None)
    if collected.deferred_attention:  # [Σ (checks + 1)] float64: per call its maxima and suspect head
        wanted.append(torch.cat([r.pending.packed for r in collected.deferred_attention]))
        alarm_flags.append(torch.stack([r.pending.alarm for r in collected.deferred_attention]).any())
    if fingerprints_differ is not None:  # given only with the gate and fingerprint records
        collected.fp_on_device = True
        alarm_flags.append(fingerprints_differ)
    if gate and alarm_flags:
        alarmed = torch.stack(alarm_flags).any()
        if comm_ratios is not None:
            alarmed = alarmed | (comm_ratios.to(alarmed.device) > 1.0).any()
        collected.gate = alarmed.float()  # 0-dim, as fused optimizers expect (their step counts are)
    if comm_ratios is not None:
        wanted.append(comm_ratios)
        collected.has_comm = True
    collected.n_evidence = len(wanted)
    collected.transfer = start_to_host(wanted + fingerprint_rows)
    return collected


def read(collected: Collected, fingerprint_pool: FingerprintPool) -> tuple[list[list[float]], list[float]]:
    """Wait for the read; (evidence per record in the reference layout, mismatch per collective)."""
    records = collected.records
    host = collected.transfer.wait()
    fingerprint_pool.resolve(host[collected.n_evidence :])
    host = host[: collected.n_evidence]
    synced: list[list[float] | None] = [None] * len(records)
    if collected.reference:
        for i, row in zip(collected.reference, host.pop(0).tolist(), strict=True):
            synced[i] = row
    if collected.triton:
        for i, row in zip(collected.triton, host.pop(0).tolist(), strict=True):
            synced[i] = records[i].finish_triton(row)
    if collected.deferred_attention:
        flat, start = host.pop(0).tolist(), 0
        for record in collected.deferred_attention:
            end = start + record.pending.packed.numel()
            record.finish(flat[start:end])
            start = end
    comm_values = host.pop(0).tolist() if collected.has_comm else []
    return synced, comm_values  # type: ignore[return-value]
