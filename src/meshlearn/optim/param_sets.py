"""Change which parameters an optimizer holds after it is built (blocks locked and unlocked later).

``torch.optim`` can add parameter groups but not remove parameters, and an optimizer built by
:func:`~meshlearn.optim.factory.build_optimizer` routes parameters into groups with their own
hyperparameters (decay on matrices, none on gains; Muon on hidden matrices, AdamW on the rest) that
a trainer may have changed since (``initial_lr`` of the LR schedule, No-WS β1). So:

- :func:`remove_parameters` takes parameters out of every group (they must not have state yet);
  a parameter outside the optimizer gets no state, no update and no weight decay.
- :func:`add_parameters` gives parameters back, routed as at construction, each into a *new*
  group that copies the hyperparameters of the group it would have joined: fresh state (step
  count 0), the same schedule (``initial_lr``), the same per-stage settings.

Both work for every optimizer of the factory (AdamW, NAdamW, SGD, Muon, NuMuon). A run that adds
the same parameters in the same order has the same group structure, so its ``state_dict`` loads.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from meshlearn.optim.muon import MatrixOptimizerWithAdamW

_NOT_HYPERPARAMETERS = ("params", "param_names")


def remove_parameters(optimizer: torch.optim.Optimizer, params: Iterable[Tensor]) -> int:
    """Take ``params`` out of ``optimizer``'s groups (empty groups stay, so the structure that
    :func:`add_parameters` copies from survives). Returns how many were removed. Raises if one has
    optimizer state: removing it would silently drop moments."""
    drop = {id(p) for p in params}
    removed = 0
    for group in optimizer.param_groups:
        keep = [i for i, p in enumerate(group["params"]) if id(p) not in drop]
        for i, p in enumerate(group["params"]):
            if id(p) in drop and optimizer.state.get(p):
                raise ValueError(f"parameter {group.get('param_names', [None] * (i + 1))[i] or i} "
                                 "has optimizer state; only parameters that never stepped can be removed")
        removed += len(group["params"]) - len(keep)
        group["params"] = [group["params"][i] for i in keep]
        if "param_names" in group:
            group["param_names"] = [group["param_names"][i] for i in keep]
    return removed


def add_parameters(optimizer: torch.optim.Optimizer,
                   named_params: Iterable[tuple[str, Tensor]]) -> list[dict]:
    """Add ``(name, parameter)`` pairs to ``optimizer`` with fresh state. Each goes into a new group
    copying the hyperparameters of the group it would have joined at construction (see the module
    docstring); returns the new groups, in the order added."""
    named = list(named_params)
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    already = [n for n, p in named if id(p) in held]
    if already:
        raise ValueError(f"parameters already in the optimizer: {already}")
    by_template: dict[int | bool, list[tuple[str, Tensor]]] = {}
    for name, p in named:
        by_template.setdefault(_template(optimizer, name, p), []).append((name, p))
    named_groups = any("param_names" in g for g in optimizer.param_groups)
    added = []
    for template, items in by_template.items():
        if isinstance(template, bool):  # a Muon-like optimizer without a group of this route
            group = {"use_muon": template}
        else:
            group = {k: v for k, v in optimizer.param_groups[template].items()
                     if k not in _NOT_HYPERPARAMETERS}
        group["params"] = items if named_groups else [p for _, p in items]
        optimizer.add_param_group(group)
        added.append(optimizer.param_groups[-1])
    return added


def _template(optimizer: torch.optim.Optimizer, name: str, p: Tensor) -> int | bool:
    """The index of the group whose hyperparameters a new parameter takes: for Muon-like
    optimizers the first group of the same route (matrix or AdamW; the route itself, a bool, when
    there is none: the constructor's defaults then apply); for elementwise ones (the factory's
    groups are [matrices with decay, gains without]) the group with the most weight decay for a
    matrix, the one with the least (the last of equals) for a gain."""
    groups = optimizer.param_groups
    if isinstance(optimizer, MatrixOptimizerWithAdamW):
        use_muon = p.ndim == 2 and not optimizer.is_adamw_name(name)
        for i, g in enumerate(groups):
            if g["use_muon"] == use_muon:
                return i
        return use_muon
    decays = [g.get("weight_decay", 0.0) for g in groups]
    if p.ndim >= 2:
        return max(range(len(groups)), key=lambda i: (decays[i], -i))
    return min(range(len(groups)), key=lambda i: (decays[i], -i))
