"""The param_groups of an optimizer instance given to ``wrap(optimizer=)``: a live view of the
groups the engine steps.

The engine never steps the user's instance; it builds the same optimizer over its flat shards
(tiertrain/optim.py). Loops written for plain PyTorch, DeepSpeed or FSDP still use that
instance's groups: ``optimizer.param_groups[0]["lr"]`` logged, ``group["lr"] = lr`` set by hand
each epoch (PyTorch's ImageNet example), a ReduceLROnPlateau built on it after wrap(). So the
engine's hyper-parameters are shown on the instance after each update, and before the next
one what the user changed there since is taken over, as torch's optimizer reads its groups at
its step. With ``wrap(lr_scheduler=)`` that scheduler sets every update's hyper-parameters: a
change found on the instance is then refused, not applied for one update and overwritten.

What the instance cannot do, it refuses by name (:func:`guard`): ``step()`` (the engine's
step() updates) and ``state_dict()``/``load_state_dict()``, whose file would hold no moments
and resume them at zero.
"""
from __future__ import annotations

import copy
import types
from typing import Any, Callable, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..config import ConfigError
from ..errors import listing


class InstanceView:
    """The user's instance's param_groups (the same dicts), kept showing the engine's groups'
    hyper-parameters, one group for one."""

    def __init__(self, groups: Sequence[dict], name: str):
        self.groups = groups
        self.name = name
        """The instance's class name, for messages."""
        self._shown: list[dict] = []
        """Each group's hyper-parameters as last shown (copies: an edit in place is a change)."""
        self._params = [(g["params"], len(g["params"])) for g in groups]

    def show(self, engine_groups: Sequence[dict]) -> None:
        """Write the engine's hyper-parameters into the instance's groups."""
        for theirs, mine in zip(self.groups, engine_groups, strict=True):
            theirs.update(group_options(mine))
        self._shown = [{k: _copy(v) for k, v in group_options(g).items()} for g in self.groups]

    def take(self, engine_groups: Sequence[dict], scheduled: bool) -> bool:
        """Copy what the user changed on the instance since it was last shown into the engine's
        groups (returns whether anything was); scheduled: wrap() was given an lr_scheduler,
        which owns them (refused then)."""
        self._check_params()
        taken = False
        for i, (group, shown) in enumerate(zip(self.groups, self._shown)):
            for key, value in group.items():
                if key == "params" or (key in shown and _same(shown[key], value)):
                    continue
                if scheduled:
                    raise ConfigError(
                        f"param_groups[{i}][{key!r}] of the {self.name} instance given as optimizer= was changed "
                        f"from {shown.get(key, '(absent)')!r} to {value!r}, but wrap(lr_scheduler=) sets every "
                        f"update's hyper-parameters on the engine's {self.name} (the instance only shows them): "
                        f"change them through that scheduler, or wrap without lr_scheduler= and set them on the "
                        f"instance as in plain PyTorch")
                engine_groups[i][key] = value
                shown[key] = _copy(value)
                taken = True
        return taken

    def _check_params(self) -> None:
        changed = len(self.groups) != len(self._params) or any(
            g["params"] is not params or len(params) != n for g, (params, n) in zip(self.groups, self._params))
        if changed:
            raise ConfigError(
                f"the param_groups of the {self.name} instance given as optimizer= changed their parameters after "
                f"wrap() (add_param_group, or a group's 'params' edited): the engine's optimizer was built over the "
                f"parameters of the groups at wrap(), and its state, masters and shards cannot follow. Set the "
                f"groups before wrap(), or close() the engine and wrap again with the new groups")


def group_options(group: dict) -> dict:
    """A param group's every key but "params" (lr, betas, weight_decay, ...)."""
    return {k: v for k, v in group.items() if k != "params"}


def _copy(value: Any) -> Any:
    """A copy that an edit of value in place does not reach (a tensor's, a list's)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    try:
        return copy.copy(value)
    except Exception:  # (an object that cannot be copied: compared by identity, as it is)
        return value


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.cpu())))
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # (values whose == is not a truth value)
        return a is b


def guard(instances: Sequence[torch.optim.Optimizer]) -> Callable[[], None]:
    """Make each instance's step(), state_dict() and load_state_dict() raise, naming what to
    call instead; returns what gives them back (the engine's close()). A method set on the
    instance before (a torch LRScheduler wraps step()) is given back as it was."""
    undo = []
    for instance in instances:
        name = type(instance).__name__
        refusals = {
            "step": f"{name}.step() was called on the instance given to wrap(optimizer=): the engine never steps it "
                    f"(its own {name} steps the flat shards, with the gradients engine.backward() reduced): call "
                    f"engine.step(), which clips, updates and steps wrap()'s lr_scheduler",
            "state_dict": f"{name}.state_dict() of the instance given to wrap(optimizer=) would hold none of the "
                          f"optimizer's state (the moments live in the engine's shards), and a run resumed from it "
                          f"would restart them at zero: save with engine.save_checkpoint(dir) and resume with "
                          f"engine.load_checkpoint(dir) (on every rank), or use engine.state_dict()",
        }
        refusals["load_state_dict"] = (
            f"{name}.load_state_dict() on the instance given to wrap(optimizer=) would reach none of the engine's "
            f"optimizer state (it lives in the engine's shards): resume with engine.load_checkpoint(dir) (on every "
            f"rank) from what engine.save_checkpoint(dir) wrote, or use engine.load_state_dict()")
        before = {method: vars(instance).get(method) for method in refusals}
        for method, message in refusals.items():
            # (bound, as torch's LRScheduler expects of step() when one is built on the instance later)
            setattr(instance, method, types.MethodType(_refusal(message), instance))
        undo.append((instance, before))

    def give_back() -> None:
        for instance, before in undo:
            for method, previous in before.items():
                if previous is None:
                    vars(instance).pop(method, None)
                else:
                    setattr(instance, method, previous)
    return give_back


def refuse_other_optimizers(params: dict[str, torch.nn.Parameter],
                            given: Sequence[torch.optim.Optimizer]) -> Callable[[], None]:
    """Make any other torch optimizer's step() raise when it holds one of ``params`` (the model's
    parameters an engine holds), through torch's public global step pre-hook; returns what
    removes the hook (the engine's close()). Such an optimizer, built on model.parameters() and
    not given to wrap(), sees no gradient (they live in the engine's buffers): its step() did
    nothing, so its learning rate, its scheduler or a GradScaler stepping it changed nothing."""
    names = {id(p): name for name, p in params.items()}
    exempt = {id(o) for o in given}

    def check(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if id(optimizer) in exempt:
            return
        held = [names[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in names]
        if held:
            kind = type(optimizer).__name__
            raise RuntimeError(
                f"{kind}.step() steps parameters that tiertrain.wrap() holds ({listing(held)}), on an optimizer not given to "
                f"wrap(): their gradients live in the engine's buffers, so it sees none and updates nothing, and its "
                f"learning rate, scheduler or GradScaler would change nothing. The engine updates them at "
                f"engine.step(); pass this {kind} as wrap(optimizer=...) to train with it, or drop it")

    return register_optimizer_step_pre_hook(check).remove


def _refusal(message: str) -> Callable[..., Any]:
    def refused(self, *args, **kwargs):
        raise RuntimeError(message)
    return refused
