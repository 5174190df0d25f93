"""The optimizer step for optimizers that need whole tensors (Muon, Adafactor, a user's own):
each such parameter is updated whole by one owning data-parallel rank (issue 37, item 1).

The flat shards stay what they are everywhere else: this rank's fp32 masters and reduced
gradients, in the layout checkpoints and resharding read. At the step:

1. every rank sends the pieces of its shards to their owners (tiertrain/update/ownership.py:
   one all_to_all of masters and gradients, ``2 × 4`` bytes per element that changes rank);
2. each owner steps its parameters whole, with the groups' own optimizer; groups whose
   optimizer is elementwise (the AdamW beside Muon) step their flat pieces in place, as in
   tiertrain/update/in_memory.py, without moving;
3. the owners send the new values back into the master shards (a second all_to_all, 4 bytes
   per element), and the masters are published as in every form.

Gradient accumulation reduces into the shards as usual, so a whole-tensor optimizer runs once
per optimizer step, on the accumulated gradient. The optimizer state lives with the owner:
on the device or the CPU tier in memory; on the NVMe tier in swap files, read before each
tensor's update and written after it (:class:`StreamedStates`), so a rank holds one tensor's
state at a time. Checkpoints hold torch's state per tensor (a whole parameter's state whole),
which tiertrain/state/reshard.py cuts for another data-parallel size like the rest.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..spans import span
from .ownership import Exchange, exchange
from .protocol import (SLOT_NAME, GroupSchedule, OptimizerUpdate, UpdateMemory, gradients_hidden,
                       gradients_hidden_where, optimizer_state_bytes, scale_gradients, shard_param_groups)
from .state_format import TorchOptimizerState

if TYPE_CHECKING:
    from ..optim import ClientOptimizer

WHOLE = "tiertrain_whole"
"""The attribute of a tensor the optimizer steps whole: (unit position, numel); read by
tiertrain/state/reshard.py to describe where its state belongs."""


class WholeParameterUpdate(OptimizerUpdate):
    """The client's optimizer with some groups stepped whole by owning ranks (module docstring)."""

    state_format = TorchOptimizerState()
    """torch's state_dict either way: a piece's state over its elements, a whole parameter's
    whole on its owner (on the NVMe tier, read in from its swap files for the checkpoint)."""

    def __init__(self, flat, config, lazy_zero: bool, client: "ClientOptimizer", swapper=None):
        super().__init__(flat, config, lazy_zero)
        whole_names = {n for i in client.whole_groups for n in client.groups[i].names}
        self.plan: Exchange = exchange(tuple(u.unit for u in flat.units), whole_names,
                                       flat.layout.num_shards, flat.shard_rank)
        self.comm = flat.comm if flat.layout.num_shards > 1 else None
        self.device = flat.placement.optimizer
        self.wholes = {}
        """Parameter name → the tensor the optimizer steps for it: shaped as the parameter,
        pointing into the owned buffer during a step and at a single zero between steps."""
        for o in self.plan.owned:
            t = torch.empty(0, device=self.device)
            t.data = _placeholder(o.shape, self.device)
            setattr(t, SLOT_NAME, o.name)
            setattr(t, WHOLE, (o.unit, o.numel))
            self.wholes[o.name] = t
        self.file_masters = {k: flat.read_shard(u.unit.index) for k, u in enumerate(flat.units)
                             if u.master is u.shard and flat.on_nvme(u.unit.index)}
        """Masters of units whose fp32 shard is their master in a swap file (fp32 parameters on
        NVMe), held here in CPU memory: the optimizer steps views of them, and each step writes
        the new values to the file."""
        masters = [self._master(k) for k in range(len(flat.units))]
        groups = shard_param_groups(flat, masters, [u.grad for u in flat.units],
                                    group_of=client.group_index().__getitem__, options=client.options())
        for i in client.whole_groups:
            groups[i]["params"] = [self.wholes[n] for n in client.groups[i].names if n in self.wholes]
        self.optimizer = client.build(groups)
        self.schedule = GroupSchedule.of(client, self.optimizer)
        self.states = None if swapper is None else StreamedStates(swapper, self.optimizer)
        """On the NVMe tier: where the optimizer state lives between uses; else None (in memory)."""

    # -- masters, wherever the flat buffers keep them --

    def _master(self, k: int) -> torch.Tensor:
        return self.file_masters[k] if k in self.file_masters else self.flat.units[k].master

    # -- the step --

    def own_learning_rate(self):
        return self.schedule.learning_rate()

    def step(self, grads, clip, lr, step):
        self.schedule.apply(self.optimizer, lr)
        scale_gradients(grads, clip)
        masters = [self._master(k) for k in range(len(self.flat.units))]
        with span("whole_gather"):
            owned_master, owned_grad = self._to_owners(masters, grads)
        for o in self.plan.owned:
            t = self.wholes[o.name]
            t.data = owned_master[o.offset:o.offset + o.numel].view(o.shape)
            t.grad = owned_grad[o.offset:o.offset + o.numel].view(o.shape)
        try:
            with gradients_hidden(self.optimizer, self.unchanged):
                if self.states is None:
                    self.optimizer.step()
                else:
                    self.states.step(self.optimizer)
        finally:
            for o in self.plan.owned:
                t = self.wholes[o.name]
                t.grad = None
                t.data = _placeholder(o.shape, self.device)
        del owned_grad
        with span("whole_scatter"):
            self._from_owners(owned_master, masters)
        for k, master in self.file_masters.items():
            self.flat.write_shard(self.flat.units[k].unit.index, master)
        self.unchanged = frozenset()
        self.norms_consumed()
        self.schedule.advance()
        self.publish_and_reset()

    def _to_owners(self, masters, grads) -> tuple[torch.Tensor, torch.Tensor]:
        """Each owned parameter's master and gradient, whole, in this rank's owned buffers."""
        plan = self.plan
        send = torch.empty(sum(plan.send_splits), 2, device=self.device)
        at = 0
        for runs in plan.sends:
            for r in runs:
                send[at:at + r.numel, 0] = masters[r.unit][r.start:r.start + r.numel]
                send[at:at + r.numel, 1] = grads[r.unit][r.start:r.start + r.numel]
                at += r.numel
        received = self._exchange(send, plan.receive_splits, plan.send_splits, "masters and gradients to owners")
        del send
        owned = torch.empty(2, plan.owned_numel, device=self.device)
        at = 0
        for runs in plan.receives:
            for r in runs:
                owned[:, r.owned_offset:r.owned_offset + r.numel] = received[at:at + r.numel].T
                at += r.numel
        return owned[0], owned[1]

    def _from_owners(self, owned: torch.Tensor, masters) -> None:
        """The owners' updated values into every rank's master shards."""
        plan = self.plan
        send = torch.empty(sum(plan.receive_splits), device=self.device)
        at = 0
        for runs in plan.receives:
            for r in runs:
                send[at:at + r.numel] = owned[r.owned_offset:r.owned_offset + r.numel]
                at += r.numel
        received = self._exchange(send, plan.send_splits, plan.receive_splits, "updated parameters from owners")
        at = 0
        with torch.no_grad():
            for runs in plan.sends:
                for r in runs:
                    masters[r.unit][r.start:r.start + r.numel] = received[at:at + r.numel]
                    at += r.numel

    def _exchange(self, send: torch.Tensor, receive_splits: list[int], send_splits: list[int],
                  label: str) -> torch.Tensor:
        if self.comm is None:  # (one shard: this rank owns every parameter)
            return send
        received = torch.empty((sum(receive_splits),) + tuple(send.shape[1:]), device=self.device)
        self.comm.all_to_all(received, send, receive_splits, send_splits, label)
        return received

    # -- outside the step --

    def masters(self):
        return [self._master(k) for k in range(len(self.flat.units))]

    def write_masters(self, edited):
        for k, values in enumerate(edited):
            if values is not None and k in self.file_masters:
                self.file_masters[k].copy_(values)

    def memory(self):
        if self.states is not None:
            held = sum(m.numel() * 4 for m in self.file_masters.values())
            return UpdateMemory(optimizer=self.states.nbytes + held, cpu_tier=held, nvme_tier=self.states.nbytes)
        moments = optimizer_state_bytes(self.optimizer)
        return UpdateMemory(optimizer=moments, cpu_tier=moments if self.flat.placement.offload_optimizer else 0)

    def state_dict(self):
        """torch's state per tensor: a piece's over its elements, a whole parameter's whole."""
        if self.states is not None:
            optimizer = self.states.state_dict(self.optimizer)
        else:
            optimizer = self.optimizer.state_dict()
        return {"masters": [m.detach() for m in self.masters()], "optimizer": optimizer,
                "schedule": self.schedule.state_dict()}

    def load_state_dict(self, state):
        with torch.no_grad():
            for k, master in enumerate(state["masters"]):
                self._master(k).copy_(master)
                if k in self.file_masters:
                    self.flat.write_shard(self.flat.units[k].unit.index, master.to(torch.float32))
        self.optimizer.load_state_dict(_shaped(self.optimizer, state["optimizer"]))
        if self.states is not None:
            self.states.evict_all(self.optimizer)
        self.schedule.load_state_dict(state.get("schedule"))
        self.flat.publish_masters()
        self.flat.zero_grads()


def _placeholder(shape: tuple[int, ...], device) -> torch.Tensor:
    """A tensor of the parameter's shape holding a single zero (a whole tensor between steps:
    its shape stays readable, e.g. for Muon's check of 2-D parameters)."""
    return torch.zeros((), device=device).expand(shape)


def _shaped(optimizer: torch.optim.Optimizer, saved: dict) -> dict:
    """The saved state with each whole tensor's per-element values in the tensor's shape:
    resharding (tiertrain/state/reshard.py) hands them flat."""
    params = [t for g in optimizer.param_groups for t in g["params"]]
    state = {}
    for index, values in saved["state"].items():
        t = params[index] if index < len(params) else None
        if t is None or not hasattr(t, WHOLE):
            state[index] = values
            continue
        numel = getattr(t, WHOLE)[1]
        state[index] = {k: (v.reshape(t.shape) if isinstance(v, torch.Tensor) and v.dim() == 1
                            and v.numel() == numel and t.dim() != 1 else v) for k, v in values.items()}
    return {**saved, "state": state}


class StreamedStates:
    """The optimizer's state on the NVMe tier: each tensor's state in swap files, read just
    before its update and written right after, so a rank holds one tensor's state at a time
    (ZeRO-Infinity's optimizer state offload, at the granularity of a parameter). Values that
    are not per-element (step counts) stay in memory."""

    def __init__(self, swapper, optimizer: torch.optim.Optimizer):
        self.swapper = swapper
        self.index = {t: i for i, t in enumerate(t for g in optimizer.param_groups for t in g["params"])}
        self.small: dict[int, dict] = {}
        """Per tensor index: its state's values kept in memory (scalars)."""
        self.swapped: dict[int, list[str]] = {}
        """Per tensor index: the keys of its state in swap files."""
        self.nbytes = 0

    def _key(self, index: int, key: str) -> tuple:
        return ("whole_state", index, key)

    def load(self, optimizer: torch.optim.Optimizer, t: torch.Tensor) -> None:
        i = self.index[t]
        if i not in self.small:
            return  # (never stepped)
        state = dict(self.small[i])
        handles = {k: self.swapper.swap_in(self._key(i, k)) for k in self.swapped[i]}
        state.update({k: h.wait() for k, h in handles.items()})
        optimizer.state[t] = state

    def evict(self, optimizer: torch.optim.Optimizer, t: torch.Tensor) -> None:
        """t's state out to its files (and out of memory)."""
        state = optimizer.state.pop(t, None)
        if not state:
            return
        i = self.index[t]
        for k in self.swapped.get(i, []):
            self.nbytes -= self.swapper.nbytes(self._key(i, k))
        self.small[i], self.swapped[i] = {}, []
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                self.swapper.swap_out(self._key(i, k), v)
                self.swapped[i].append(k)
                self.nbytes += v.numel() * v.element_size()
            else:
                self.small[i][k] = v

    def evict_all(self, optimizer: torch.optim.Optimizer) -> None:
        for t in list(optimizer.state):
            self.evict(optimizer, t)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step() one tensor at a time (the others' gradients hidden), each with
        its state read in before and written out after."""
        stepped = [t for t in self.index if t.grad is not None]
        grads = {t: t.grad for t in stepped}
        with gradients_hidden_where(optimizer, lambda t: t in grads):
            for t in stepped:
                self.load(optimizer, t)
                t.grad = grads[t]
                try:
                    optimizer.step()
                finally:
                    t.grad = None
                self.evict(optimizer, t)

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """torch's state_dict of the optimizer, every tensor's state read in for it."""
        for t in self.index:
            self.load(optimizer, t)
        try:
            return optimizer.state_dict()
        finally:
            for t in self.index:
                optimizer.state.pop(t, None)
