"""A DeepSpeed ZeRO checkpoint's files, read: each trained parameter's fp32 master, Adam moments
and step where DeepSpeed's partitions put them, the frozen values, the buffers, the counters,
the fp16 loss scale and the client state (docs/migrate-deepspeed.md).

What DeepSpeed's ``engine.save_checkpoint`` writes (``<dir>/<tag>/``, the tag in
``<dir>/latest``), as this module reads it:

- ``mp_rank_00_model_states.pt`` (stages 1-2) or one ``zero_pp_rank_R_mp_rank_00_model_states.pt``
  per rank (stage 3): ``param_shapes`` (per param group, the trained parameters' names and shapes
  in the order of the flat buffers), the module's state dict (buffers; at stages 1-2 the frozen
  values too), ``frozen_param_fragments`` (stage 3: each rank's part of every frozen parameter),
  ``global_steps``, and the client state beside DeepSpeed's own keys;
- ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``, one per data-parallel rank. Stages 1-2
  (ZeRO §5.1-5.2): per param group one flat fp32 partition per rank
  (``single_partition_of_fp32_groups``); the group's parameters lie one after the other in the
  ranks' partitions joined in rank order. Stage 3 (§5.3): per rank its flat fp32 sub-groups
  (``fp32_flat_groups``), joined, hold every parameter's part in turn: ceil(numel / world)
  elements of each, rank r's part being elements [r·n, (r+1)·n) of the parameter. The optimizer
  state is cut as those flat buffers are: one value per element of each (Adam's ``exp_avg`` and
  ``exp_avg_sq``, SGD's ``momentum_buffer``, Lion's ``exp_avg``, ...) and, where the optimizer
  counts them, the ``step`` of each buffer.

DeepSpeed pickles some of its own objects there (its loss scaler, the ZeRO stage enum, fragment
addresses): they are read as inert placeholders, so reading needs no DeepSpeed installed and runs
no code of the file (``torch.load(weights_only=True)``). tiertrain/state/deepspeed_checkpoint.py
loads what is read here into an engine.
"""
from __future__ import annotations

import glob
import math
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .checkpoint import CheckpointError
from ..zero.layout import Slot

DEEPSPEED_OBJECTS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                     "deepspeed.runtime.zero.config.ZeroStageEnum",
                     "deepspeed.utils.tensor_fragment.fragment_address")
"""DeepSpeed's classes its checkpoints pickle, read as inert placeholders (with those a file in
torch's zip format names; one in the legacy format cannot be scanned for them)."""

_WEIGHTS_ONLY = ("its weights alone (not the optimizer state) load through DeepSpeed's zero_to_fp32.py "
                 "--safe_serialization, then tiertrain.load_pretrained(engine, path)")
"""What a refused checkpoint's message offers instead."""

_MODEL_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
               "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
               "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
               "ds_version", "checkpoint_parallel_dimensions", "csr_tensor_module_names", "mp_rank", "iteration",
               "universal_checkpoint_info"}
"""The model-states keys DeepSpeed writes itself; any other key is the client state."""


class _Opaque:
    """An object in a DeepSpeed file (DeepSpeed's own, or a client state's), kept inert: its class
    need not be importable and none of its code runs; what it was built from is kept (``args``,
    ``state``: the loss scaler's is read from it)."""

    def __init__(self, *args: Any):
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


def load_file(path: str) -> dict:
    """One DeepSpeed file, memory-mapped (a file in torch's legacy format, which cannot be, read
    whole), with torch's weights-only unpickler; DeepSpeed's objects, and any other class the
    file names (a client state's), read as inert placeholders: the latter said in a warning."""
    if not os.path.isfile(path):  # (a FIFO, a device or a directory in its place: reading one would block)
        raise CheckpointError(f"{path!r} is not a regular file: not a DeepSpeed checkpoint file tiertrain can read")
    try:
        with open(path, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path) if zipped else []
        with torch.serialization.safe_globals([(_Opaque, n) for n in sorted(set(DEEPSPEED_OBJECTS) | set(found))]):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except Exception as e:  # (pickle's and torch's errors alike: the file is not one read here)
        raise CheckpointError(f"{path!r} is not a DeepSpeed checkpoint file tiertrain can read: {e}") from e
    foreign = [n for n in found if not n.startswith("deepspeed.")]
    if foreign:
        warnings.warn(f"{path!r} holds objects of {foreign} (a client state's, most likely): they are read as inert "
                      f"placeholders (tiertrain.state.deepspeed_files._Opaque: .args, .state), none of their "
                      f"code run", stacklevel=2)
    return state


def rank_files(directory: str, kind: str) -> list[str]:
    """The ``*zero_pp_rank_R_mp_rank_00_<kind>.pt`` files in directory, in rank order; ranks
    missing from 0..n-1, or a rank's two files, are refused."""
    found = {}
    for path in glob.glob(os.path.join(directory, f"*zero_pp_rank_*_mp_rank_00_{kind}.pt")):
        rank = int(re.search(r"zero_pp_rank_(\d+)_", os.path.basename(path)).group(1))
        if rank in found:
            raise CheckpointError(f"{directory!r} holds two {kind} files of rank {rank}: {found[rank]!r} and {path!r}")
        found[rank] = path
    if sorted(found) != list(range(len(found))):
        raise CheckpointError(f"{directory!r}: the {kind} files are of ranks {sorted(found)}, "
                              f"not 0..{len(found) - 1}: some are missing")
    return [found[r] for r in range(len(found))]


def client_state_of(model_states: dict) -> dict:
    """What a model-states file holds beside DeepSpeed's own keys: the client state."""
    return {k: v for k, v in model_states.items() if k not in _MODEL_KEYS}


def loss_scale_of(optimizer_state: dict, skipped_steps: int) -> dict | None:
    """DeepSpeed's fp16 dynamic loss scale (its optimizer state's ``loss_scaler``) as tiertrain's
    scaler keeps it (the scale, the good steps since the last overflow, the overflows left
    before it is lowered), or None where it scaled no loss dynamically (bf16, fp32, a static scale)."""
    state = getattr(optimizer_state.get("loss_scaler"), "state", None) or {}
    if not state.get("dynamic") or "cur_scale" not in state:
        return None
    return {"scale": float(state["cur_scale"]),
            "good_steps": int(state.get("cur_iter", 0)) - int(state.get("last_overflow_iter", -1)) - 1,
            "hysteresis_left": int(state.get("cur_hysteresis", 1)), "overflows": skipped_steps,
            "consecutive_skips": 0}


def _flat(tensor: Any) -> torch.Tensor:
    return tensor.detach().reshape(-1)


class DeepSpeedCheckpoint:
    """One tag of a DeepSpeed ZeRO checkpoint directory, read: every trained parameter's
    fragments in the ranks' flat buffers, its values on demand (master, moments), the frozen
    values, the buffers and the counters."""

    def __init__(self, directory: str | os.PathLike, tag: str | None = None):
        directory = os.fspath(directory)
        if tag is None:
            latest = os.path.join(directory, "latest")
            if not os.path.isfile(latest):
                tags = sorted(d for d in os.listdir(directory) if os.path.isdir(os.path.join(directory, d))) \
                    if os.path.isdir(directory) else []
                raise CheckpointError(f"{directory!r} has no 'latest' file naming the DeepSpeed checkpoint's tag "
                                      f"(nor a 'latest_universal' naming a universal checkpoint's): "
                                      f"give tag= (its subdirectories: {tags[:10]})")
            with open(latest) as f:
                tag = f.read().strip()
        self.directory = os.path.join(directory, tag)
        if not os.path.isdir(self.directory):
            raise CheckpointError(f"{self.directory!r} does not exist (tag {tag!r} of {directory!r})")
        self._refuse_other_layouts()
        optim_files = self._rank_files("optim_states")
        if not optim_files:
            self._refuse_stage0()
            raise CheckpointError(f"{self.directory!r} holds no ZeRO optimizer files (*zero_pp_rank_R_mp_rank_00_"
                                  f"optim_states.pt): tiertrain reads checkpoints of DeepSpeed's ZeRO stages 1-3; "
                                  f"{_WEIGHTS_ONLY}")
        self.world = len(optim_files)
        self._optim = [load_file(p)["optimizer_state_dict"] for p in optim_files]
        first = self._optim[0]
        self._flat_key = next((k for k in ("fp32_flat_groups", "single_partition_of_fp32_groups") if k in first), None)
        """Where each rank's flat fp32 buffers are: stage 3's sub-groups, or stages 1-2's partitions."""
        if self._flat_key is None:
            raise CheckpointError(f"{optim_files[0]!r} holds neither ZeRO stage 1-2's "
                                  f"'single_partition_of_fp32_groups' nor stage 3's 'fp32_flat_groups' (it has "
                                  f"{sorted(first)}): not a ZeRO optimizer state tiertrain reads")
        partitions_parameters = self._flat_key == "fp32_flat_groups"
        recorded = getattr(first.get("zero_stage"), "args", ())
        self.stage = int(recorded[0]) if recorded else 3 if partitions_parameters else 2
        """The ZeRO stage DeepSpeed recorded (its enum's value)."""
        if (self.stage == 3) != partitions_parameters:
            raise CheckpointError(f"{optim_files[0]!r} records ZeRO stage {self.stage} but holds "
                                  f"{self._flat_key!r}: a layout this version does not read")
        model_files = self._rank_files("model_states") if partitions_parameters else \
            [os.path.join(self.directory, "mp_rank_00_model_states.pt")]
        if not all(os.path.isfile(p) for p in model_files) or len(model_files) not in (1, self.world):
            raise CheckpointError(f"{self.directory!r}: the model-states files {model_files} do not match its "
                                  f"{self.world} optimizer files")
        self._model = [load_file(p) for p in model_files]
        model = self._model[0]
        dp = model.get("dp_world_size", self.world)
        if dp != self.world:
            raise CheckpointError(f"{self.directory!r} was saved by {dp} data-parallel ranks but holds "
                                  f"{self.world} optimizer files")
        self.global_steps = int(model.get("global_steps", 0))
        self.skipped_steps = int(model.get("skipped_steps", 0))
        self.client_state = client_state_of(model)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.buckets: list[_Bucket] = []
        """What DeepSpeed partitioned as one, in the order of each rank's buffers."""
        self._where: dict[str, list[tuple[int, int, int, int]]] = {}
        """parameter -> (rank, offset in that rank's joined flat buffer, first, end element)."""
        self.group_of: dict[str, int] = {}
        """parameter -> its DeepSpeed param group."""
        if partitions_parameters:
            self._index_stage3()
        else:
            self._index_stages12()
        self.frozen_shapes = self._frozen_shapes()
        self.loss_scale = loss_scale_of(self._optim[0], self.skipped_steps)
        self.state_keys, self.counts_steps = self._state_keys()
        module = model.get("module") or {}
        self.buffers = {n: module[n] for n in model.get("buffer_names", []) if n in module}

    # -- the files --

    def _refuse_other_layouts(self) -> None:
        names = os.listdir(self.directory)
        other_mp = sorted(n for n in names if re.search(r"mp_rank_(?!00)\d+", n))
        if other_mp:
            raise CheckpointError(f"{self.directory!r} is a tensor-parallel DeepSpeed checkpoint ({other_mp[0]}): "
                                  f"tiertrain reads data-parallel ZeRO checkpoints (mp_rank_00 only); {_WEIGHTS_ONLY}")
        layers = sorted(n for n in names if n.startswith("layer_"))
        if layers:
            raise CheckpointError(f"{self.directory!r} is a pipeline DeepSpeed checkpoint ({layers[0]}): tiertrain "
                                  f"reads data-parallel ZeRO checkpoints; {_WEIGHTS_ONLY}")
        experts = sorted(n for n in names if "expert" in n)
        if experts:
            raise CheckpointError(f"{self.directory!r} holds DeepSpeed MoE expert files ({experts[0]}), which "
                                  f"tiertrain does not read; {_WEIGHTS_ONLY}")

    def _refuse_stage0(self) -> None:
        """A run without ZeRO (stage 0) keeps its optimizer state in the model-states file, as
        torch's state_dict by index: the file does not say which parameter each index was
        (param_shapes is None), and neither shapes (a frozen layer, equal matrices in two
        groups) nor values tell it in general. Its weights are the module's values."""
        path = os.path.join(self.directory, "mp_rank_00_model_states.pt")
        model = load_file(path) if os.path.isfile(path) else {}
        if model.get("optimizer") is None or model.get("param_shapes") is not None:
            return
        raise CheckpointError(f"{self.directory!r} is a DeepSpeed checkpoint without ZeRO (stage 0): its optimizer "
                              f"state is kept by index, with no record of which parameter each index was "
                              f"(param_shapes is None), so it cannot be moved; its weights load with "
                              f"tiertrain.load_pretrained(engine, {path!r}) (the module's values: of a 16-bit run, "
                              f"in the compute dtype, not the fp32 masters), the optimizer starting afresh")

    def _rank_files(self, kind: str) -> list[str]:
        return rank_files(self.directory, kind)

    def _param_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        groups = self._model[0].get("param_shapes")
        if not isinstance(groups, list):
            raise CheckpointError(f"{self.directory!r}: the model states hold no 'param_shapes' list")
        return [{n: tuple(s) for n, s in g.items()} for g in groups]

    def _moments(self, rank: int) -> list[dict]:
        """Rank's optimizer state per flat buffer, in buffer order (torch's state_dict by index,
        or DeepSpeed's list of per-group states)."""
        optim = self._optim[rank]
        state = optim.get("base_optimizer_state", optim.get("optimizer_state_dict"))
        if isinstance(state, dict) and "state" in state:
            groups = [g["params"][0] for g in state["param_groups"]]
            return [state["state"].get(i, {}) for i in groups]
        if isinstance(state, list):
            return state
        raise CheckpointError(f"{self.directory!r}: rank {rank}'s optimizer state is {type(state).__name__}, not a "
                              f"torch optimizer's state_dict")

    def _state_keys(self) -> tuple[tuple[str, ...], bool]:
        """The optimizer state of each element (the keys holding one value per element of
        their buffer, alike in every buffer of every rank) and whether a step is kept."""
        found: set[tuple[str, ...]] = set()
        steps = set()
        for rank in range(self.world):
            for state, buffer in zip(self._moments(rank), self._optim[rank][self._flat_key]):
                found.add(tuple(sorted(k for k, v in state.items()
                                       if isinstance(v, torch.Tensor) and v.numel() == buffer.numel() > 1)))
                steps.add("step" in state)
        if len(found) > 1 or len(steps) > 1:
            raise CheckpointError(f"{self.directory!r}: its flat buffers keep different optimizer states "
                                  f"{sorted(found)} (steps kept: {sorted(steps)}): not one optimizer's state")
        return (next(iter(found)) if found else ()), (steps == {True})

    # -- where each parameter lies --

    def _index_stages12(self) -> None:
        """One bucket per param group: its parameters one after the other, rank r holding
        elements [r·size, (r+1)·size) of them (its fp32 partition of the group)."""
        shapes = self._param_shapes()
        partitions = [self._optim[r]["single_partition_of_fp32_groups"] for r in range(self.world)]
        if any(len(p) != len(shapes) for p in partitions):
            raise CheckpointError(f"{self.directory!r}: {len(shapes)} param groups in the model states, "
                                  f"{[len(p) for p in partitions]} fp32 partitions in the ranks' files")
        start = 0
        for g, group in enumerate(shapes):
            sizes = [partitions[r][g].numel() for r in range(self.world)]
            if len(set(sizes)) != 1:
                raise CheckpointError(f"{self.directory!r}: param group {g}'s fp32 partitions differ in size "
                                      f"across ranks: {sizes}")
            slots, at = [], 0
            for name, shape in group.items():
                slots.append(Slot(name, at, math.prod(shape), shape))
                at += math.prod(shape)
            if at > sizes[0] * self.world:
                raise CheckpointError(f"{self.directory!r}: param group {g} holds {sizes[0] * self.world} elements, "
                                      f"fewer than its parameters' {at}")
            self._add_bucket(_Bucket(tuple(slots), sizes[0], start, g))
            start += sizes[0]
        self._check_slice_mappings()

    def _check_slice_mappings(self) -> None:
        """Where DeepSpeed recorded each rank's fragment of each parameter, it must be where the
        layout above put it (a format this module misreads fails here, not in training)."""
        for r in range(self.world):
            mappings = self._optim[r].get("param_slice_mappings")
            if not mappings:
                continue
            base = 0
            for g, mapping in enumerate(mappings):
                for name, address in mapping.items():
                    found = [(off - base, b - a) for rank, off, a, b in self._where.get(name, []) if rank == r]
                    recorded = getattr(address, "state", None) or {}
                    want = (recorded.get("start"), recorded.get("numel"))
                    if found != [want]:
                        raise CheckpointError(f"{self.directory!r}: rank {r} records {name!r} at (start, numel) "
                                              f"{want} of param group {g}, tiertrain's reading of the format puts it "
                                              f"at {found}: a DeepSpeed layout this version does not read")
                base += self._optim[r]["single_partition_of_fp32_groups"][g].numel()

    def _index_stage3(self) -> None:
        """One bucket per parameter: rank r holding elements [r·n, (r+1)·n) of it, n =
        ceil(numel / world), the parameters' parts one after the other in each rank's buffers."""
        total = [sum(t.numel() for t in self._optim[r]["fp32_flat_groups"]) for r in range(self.world)]
        start = 0
        for g, group in enumerate(self._param_shapes()):
            for name, shape in group.items():
                part = -(-math.prod(shape) // self.world)
                self._add_bucket(_Bucket((Slot(name, 0, math.prod(shape), shape),), part, start, g))
                start += part
        if any(t < start for t in total):
            raise CheckpointError(f"{self.directory!r}: the ranks' fp32 buffers hold {total} elements, fewer than "
                                  f"their parameters' {start} each")

    def _add_bucket(self, bucket: "_Bucket") -> None:
        self.buckets.append(bucket)
        for slot in bucket.slots:
            if slot.name in self.shapes:
                raise CheckpointError(f"{self.directory!r}: parameter {slot.name!r} is in two param groups")
            self.shapes[slot.name], self.group_of[slot.name] = slot.shape, bucket.group
            self._where[slot.name] = [
                (r, bucket.start + lo - r * bucket.shard, lo - slot.offset, hi - slot.offset)
                for r in range(self.world)
                for lo, hi in [(max(slot.offset, r * bucket.shard), min(slot.end, (r + 1) * bucket.shard))] if lo < hi]

    # -- values --

    def _buffers_of(self, rank: int, key: str) -> list[torch.Tensor]:
        """Rank's flat fp32 buffers (key "master") or its optimizer state `key`, in buffer order
        (memory-mapped: only what is sliced from them is read)."""
        if key == "master":
            return [_flat(t) for t in self._optim[rank][self._flat_key]]
        states = self._moments(rank)
        missing = [i for i, s in enumerate(states) if key not in s]
        if missing:
            have = sorted(k for k in states[missing[0]] if k != "step")
            raise CheckpointError(f"{self.directory!r}: rank {rank}'s optimizer state holds {have}, not {key!r}")
        return [_flat(s[key]) for s in states]

    def read(self, rank: int, key: str, offset: int, numel: int) -> torch.Tensor:
        """Elements [offset, offset + numel) of rank's buffers joined: of its fp32 masters (key
        "master") or of its optimizer state `key` (one of state_keys)."""
        out = torch.empty(numel, dtype=torch.float32)
        at = 0  # (where each buffer starts in the rank's buffers joined)
        for buffer in self._buffers_of(rank, key):
            a, b = max(offset, at), min(offset + numel, at + buffer.numel())
            if a < b:
                out[a - offset:b - offset] = buffer[a - at:b - at]
            at += buffer.numel()
        if at < offset + numel:  # (what is left of out would be leftovers of memory, not values)
            raise CheckpointError(f"{self.directory!r}: rank {rank}'s {key} buffers hold {at} elements; its "
                                  f"parameters need {offset + numel}")
        return out

    def value(self, name: str, key: str = "master") -> torch.Tensor:
        """Parameter name's fp32 master ("master") or optimizer state (one of state_keys), whole
        and flat."""
        out = torch.empty(math.prod(self.shapes[name]), dtype=torch.float32)
        for rank, offset, lo, hi in self._where[name]:
            out[lo:hi] = self.read(rank, key, offset, hi - lo)
        return out

    def step_at(self, rank: int, offset: int) -> int:
        """Adam's update count of the buffer of rank holding element offset of its buffers joined."""
        at = 0
        for state, buffer in zip(self._moments(rank), self._optim[rank][self._flat_key]):
            if offset < at + buffer.numel():
                return int(state.get("step", self.global_steps - self.skipped_steps))
            at += buffer.numel()
        return self.global_steps - self.skipped_steps

    def step(self, name: str) -> int:
        """Adam's update count of the buffer holding parameter name's first element."""
        return self.step_at(*self._where[name][0][:2])

    # -- frozen parameters --

    def _frozen_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every frozen parameter's shape: as recorded (frozen_param_shapes), or at stages 1-2,
        where DeepSpeed may record none, the module state dict's entries that are neither
        trained, a buffer nor a tied alias. Each must have a value: checked here."""
        model = self._model[0]
        module = model.get("module") or {}
        shapes = {n: tuple(s) for n, s in (model.get("frozen_param_shapes") or {}).items()}
        if not shapes and self._flat_key != "fp32_flat_groups":
            skip = set(self.shapes) | set(model.get("buffer_names") or ()) | set(model.get("shared_params") or {})
            shapes = {n: tuple(v.shape) for n, v in module.items() if n not in skip}
        for name, shape in shapes.items():
            whole = name in module and module[name].numel() == math.prod(shape)
            held = sum(self._frozen_part(r, name).numel() for r in range(len(self._model)))
            if not whole and held < math.prod(shape):
                raise CheckpointError(f"{self.directory!r}: frozen {name!r} {shape} has neither a whole value in the "
                                      f"module's state dict nor fragments holding its {math.prod(shape)} elements "
                                      f"(they hold {held})")
        return shapes

    def _frozen_part(self, rank: int, name: str) -> torch.Tensor:
        return _flat((self._model[rank].get("frozen_param_fragments") or {}).get(name, torch.empty(0)))

    @property
    def frozen_sharded(self) -> bool:
        """Stage 3: each rank's file holds its part of every frozen parameter (ceil(numel / world)
        elements), not the whole value."""
        return self._flat_key == "fp32_flat_groups" and len(self._model) == self.world

    def frozen_value(self, name: str) -> torch.Tensor:
        """Frozen parameter name's value, whole, in the dtype it was saved in."""
        shape = self.frozen_shapes[name]
        module = self._model[0].get("module") or {}
        if name in module and module[name].numel() == math.prod(shape):
            return module[name].reshape(shape)
        joined = torch.cat([self._frozen_part(r, name) for r in range(len(self._model))])
        return joined[:math.prod(shape)].reshape(shape)

    def frozen_piece(self, rank: int, name: str, start: int, numel: int) -> torch.Tensor:
        """Elements [start, start + numel) of rank's part of frozen name (frozen_sharded), or of
        its whole value."""
        flat = self._frozen_part(rank, name) if self.frozen_sharded else self.frozen_value(name).reshape(-1)
        return flat[start:start + numel]

    @property
    def frozen_dtype(self) -> torch.dtype:
        name = next(iter(self.frozen_shapes), None)
        return torch.float32 if name is None else self.frozen_piece(0, name, 0, 0).dtype


@dataclass(frozen=True)
class _Bucket:
    """A run of parameters DeepSpeed partitions as one: a param group's flat buffer at stages
    1-2, one parameter at stage 3. Rank r holds elements [r·shard, (r+1)·shard) of it, from
    element ``start`` of its buffers joined."""

    slots: tuple[Slot, ...]
    shard: int
    start: int
    group: int


__all__ = ["DEEPSPEED_OBJECTS", "DeepSpeedCheckpoint", "client_state_of", "load_file", "loss_scale_of", "rank_files"]
