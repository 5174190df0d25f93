"""Several torch optimizers stepped as one: ``wrap(optimizer=[Muon(hidden), AdamW(rest)])``.

Muon updates only 2-D hidden weights; embeddings, the head, norms and biases take AdamW (the
Moonlight and Kimi K2 recipe, torch's own Muon documentation). Users build the two over the
model's parameters; the engine rebuilds each over its own tensors and steps them through this
one torch Optimizer, so schedulers, checkpoints and resharding see one optimizer whose param
groups are the parts' groups in order (the same dicts: a scheduler's rate reaches the part)
and whose state_dict numbers the parts' tensors one after another, as torch numbers one
optimizer's.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


class OptimizerList(torch.optim.Optimizer):
    """Optimizers over disjoint parameters, stepped, saved and loaded together."""

    def __init__(self, parts: Sequence[torch.optim.Optimizer]):
        # (torch.optim.Optimizer.__init__ would copy the groups; these must stay the parts' own)
        if not parts:
            raise ValueError("OptimizerList needs at least one optimizer")
        self.parts = list(parts)
        self.defaults = {}
        self.param_groups = [g for part in self.parts for g in part.param_groups]

    @property
    def state(self) -> dict:
        """Every part's per-parameter state (a new dict; the parts' state dicts are live)."""
        return {p: s for part in self.parts for p, s in part.state.items()}

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> Any:
        if closure is not None:
            raise ValueError("OptimizerList steps without a closure (the engine computes the gradients)")
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        """torch's format over all parts: tensors numbered part after part."""
        state, groups, offset = {}, [], 0
        for part in self.parts:
            saved = part.state_dict()
            state.update({offset + k: v for k, v in saved["state"].items()})
            groups += [{**g, "params": [offset + k for k in g["params"]]} for g in saved["param_groups"]]
            offset += sum(len(g["params"]) for g in part.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the saved optimizer has {len(groups)} param groups, this OptimizerList "
                             f"{len(self.param_groups)}")
        at, offset = 0, 0
        for part in self.parts:
            mine = groups[at:at + len(part.param_groups)]
            at += len(part.param_groups)
            count = sum(len(g["params"]) for g in part.param_groups)
            part.load_state_dict({
                "state": {k - offset: v for k, v in state_dict["state"].items() if offset <= k < offset + count},
                "param_groups": [{**g, "params": [k - offset for k in g["params"]]} for g in mine]})
            offset += count
        self.param_groups[:] = [g for part in self.parts for g in part.param_groups]

    def __repr__(self) -> str:
        return f"OptimizerList({', '.join(type(p).__name__ for p in self.parts)})"


def build_parts(groups: list[dict], builds: Sequence[Callable[[list[dict]], torch.optim.Optimizer]],
                parts: Sequence[int]) -> OptimizerList:
    """The OptimizerList over ``groups``, group i built by ``builds[parts[i]]`` (the groups
    come in the parts' order, as client_optimizer resolved them)."""
    if len(groups) != len(parts):
        raise ValueError(f"{len(groups)} param groups for an optimizer list of {len(parts)} groups")
    return OptimizerList([builds[k]([g for g, part in zip(groups, parts) if part == k])
                          for k in range(len(builds))])


__all__ = ["OptimizerList", "build_parts"]
