"""Processes the reliability tests kill: a protected training loop that confirms incidents every step,
writing each incident id to a file once the guard has told its listeners (after the incident's
commit), and one that is killed between an incident's commit and its quarantine write."""

from __future__ import annotations

import os
import signal

import torch
from tests.helpers import small_workload, train

import aegis_sdc as aegis
from aegis_sdc.workloads.llama import LlamaConfig

TINY = LlamaConfig(vocab_size=64, dim=64, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=128, max_seq_len=32)
SITE = "layers.0.attn.wq:fwd"
FIRST_FAULT_STEP = 3  # after the first steps, so that the loop is under way when kills start


def _loop(run_dir: str, steps: int, on_incident) -> None:
    torch.set_num_threads(1)
    model, data, optimizer = small_workload(cfg=TINY, batch=2, seq=32)
    fault = aegis.FaultSpec(site=SITE, model="bitflip", bit=30, steps=range(FIRST_FAULT_STEP, 1_000_000))
    config = aegis.GuardConfig(run_dir=run_dir, faults=(fault,), response=aegis.ResponseConfig(policy="warn"))
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    guard.subscribe(lambda event, payload: on_incident(payload) if event == "incident" else None)
    train(model, data, optimizer, steps)
    guard.close()


def train_until_killed(run_dir: str, log_path: str) -> None:
    """Train (practically) forever; each confirmed incident's id is appended to `log_path` with one
    write(2), which a SIGKILL cannot tear: the kernel has it once write returns."""
    import warnings

    warnings.simplefilter("ignore")
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _loop(run_dir, 1_000_000, lambda incident: os.write(fd, f"{incident.id}\n".encode()))


def killed_before_quarantine(run_dir: str, log_path: str) -> None:
    """Confirm one incident, then die (SIGKILL) where the quarantine list would be written: after the
    incident's commit, before the list names the device."""
    import warnings

    from aegis_sdc.response import policies

    warnings.simplefilter("ignore")

    def die(path, entries):
        with open(log_path, "a") as f:
            f.write(f"{len(entries)}\n")
        os.kill(os.getpid(), signal.SIGKILL)

    policies.append_quarantine = die
    _loop(run_dir, FIRST_FAULT_STEP + 2, lambda incident: None)
