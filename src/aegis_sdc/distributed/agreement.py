"""The data-parallel ranks' guards must line up: checked once, at `protect`, on every rank.

The per-step exchange sends a fixed-width tensor whose columns are the protected sites in order, and
the ranks compare their statistics site by site, sampled by one seed. Ranks that protect different
models (or different `include`/`exclude` patterns) send tensors of different widths — gloo then ends
a rank with an uncatchable `gloo::EnforceNotMet` abort — and ranks that sample with different seeds
or settings run on, silently comparing unlike with like. So at `protect` the ranks gather a small
digest of what must agree (`agreed`) on the exchange group, with its timeout; on a difference every
rank raises `RankAgreementError` naming it. A mismatch is a configuration error, not a fault of the
run: the error is a `ValueError`, like the configuration's own checks.

What must agree: the protected sites (their names in order) and the model's parameters (names and
shapes: the state vote's width follows them); the sampling seed, probability, per-site rules,
whether an overhead budget is in force and its rotation and re-plan periods; the checksum modes;
`include`/`exclude`; every `DistributedConfig` field (the state vote's and the collective checks'
settings shape what the ranks send); the world and data-parallel sizes. Not compared: the budget's
fraction (each rank plans its own checks from its own step time, and the ranks already agree on the
state sensors' periods in the step's exchange), thresholds, fault specs (per rank by design), paths.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from aegis_sdc.distributed.context import DistContext


class RankAgreementError(ValueError):
    """The data-parallel ranks' guards do not line up (raised on every rank, at `protect`): the message
    names each field that differs and which ranks hold which value."""


def _shape(param: nn.Parameter) -> str:
    try:
        return str(tuple(param.shape))
    except RuntimeError:  # a lazy module's parameter before its first call
        return "(uninitialized)"


def agreed(config: Any, ctx: DistContext, device_type: str) -> dict[str, str]:
    """What must be identical on every rank of the data-parallel group, field → its value shown.
    `config`: the guard's `GuardConfig` (typed loosely: this layer does not import the configuration)."""
    sampling = config.sampling
    fields: dict[str, Any] = {
        "world size": dist.get_world_size(),
        "data-parallel size": ctx.dp_size,
        "GuardConfig.include": config.include,
        "GuardConfig.exclude": config.exclude,
        "SamplingConfig.seed": sampling.seed,
        "SamplingConfig.probability": sampling.probability,
        "SamplingConfig.per_site": sampling.per_site,
        # the fraction may differ (see the module's docstring); whether a budget plans the checks may not
        "SamplingConfig.budget": "in force" if sampling.budget_for(device_type) is not None else "none",
        "SamplingConfig.rotation_steps": sampling.rotation_steps,
        "SamplingConfig.replan_steps": sampling.replan_steps,
    }
    for owner, part in (("ChecksumConfig", config.checksum), ("DistributedConfig", config.distributed)):
        for item in dataclasses.fields(part):
            fields[f"{owner}.{item.name}"] = getattr(part, item.name)
    return {name: repr(value) for name, value in fields.items()}


def _digest(items: Sequence[str]) -> str:
    return f"{len(items)} ({hashlib.sha256(chr(10).join(items).encode()).hexdigest()[:16]})"


def _by_value(values: list[Any], ranks: list[int]) -> str:
    """'A on rank 0, B on ranks [1, 2]' — each distinct value and the ranks that hold it."""
    holders: dict[Any, list[int]] = {}
    for value, rank in zip(values, ranks, strict=True):
        holders.setdefault(value, []).append(rank)
    return ", ".join(
        f"{value} on rank {owners[0]}" if len(owners) == 1 else f"{value} on ranks {owners}"
        for value, owners in holders.items()
    )


def _entry(items: list[str], i: int) -> str:
    return repr(items[i]) if i < len(items) else "(none: the list ends)"


def _first_difference(name: str, lists: list[list[str]], ranks: list[int]) -> str:
    """The counts of each rank's list, and the first position where a rank's differs from the lowest rank's."""
    reference = lists[0]
    parts = []
    for items, rank in zip(lists[1:], ranks[1:], strict=True):
        if items == reference:
            continue
        common = min(len(reference), len(items))
        i = next((i for i in range(common) if items[i] != reference[i]), common)
        parts.append(f"first difference at #{i}: rank {rank} has {_entry(items, i)} where rank {ranks[0]} has "
                     f"{_entry(reference, i)}")  # fmt: skip
    return f"{name}: {_by_value([len(items) for items in lists], ranks)} — " + "; ".join(parts)


def check_agreement(ctx: DistContext, config: Any, model: nn.Module, site_names: Sequence[str],
                    device_type: str) -> None:  # fmt: skip
    """Gather every data-parallel rank's digest (one small object all-gather on the exchange group);
    `RankAgreementError` on every rank when they differ, `RankExchangeError` when a rank does not
    answer within the exchange timeout. A second all-gather, only on a mismatch of the site or
    parameter lists, fetches the lists themselves to name the first difference."""
    lists = {
        "protected sites": list(site_names),
        "model parameters": [f"{name} {_shape(p)}" for name, p in model.named_parameters()],
    }
    mine = agreed(config, ctx, device_type) | {name: _digest(items) for name, items in lists.items()}
    everyone = ctx.all_gather_object(mine, "at protect() (the ranks' agreement)")
    # every rank holds the same gathered digests: all take the same branches below, collectives included
    differing = [name for name in mine if any(d.get(name) != everyone[0].get(name) for d in everyone)]
    if not differing:
        return
    wanted = {name: items for name, items in lists.items() if name in differing}
    full = ctx.all_gather_object(wanted, "at protect() (the ranks' agreement)") if wanted else []
    problems = []
    for name in differing:
        if name in wanted:
            problems.append(_first_difference(name, [f[name] for f in full], ctx.ranks))
        else:
            problems.append(f"{name}: {_by_value([d.get(name) for d in everyone], ctx.ranks)}")
    raise RankAgreementError(
        f"aegis-sdc: the guards of data-parallel ranks {ctx.ranks} do not agree at protect(); every rank must "
        "protect the same model with the same configuration (the per-step exchange compares the ranks site "
        "by site, sampled alike). " + ". ".join(problems)
    )
