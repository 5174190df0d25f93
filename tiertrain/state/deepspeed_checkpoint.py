"""A DeepSpeed ZeRO checkpoint read into an engine of any layout: each trained parameter's fp32
master and Adam moments and step, the frozen values, the buffers, the step count and the
client state, so a run moved from DeepSpeed continues where it stopped instead of restarting
its optimizer (docs/migrate-deepspeed.md).

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
  state (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``) is cut as those flat buffers are.

DeepSpeed pickles some of its own objects there (its loss scaler, the ZeRO stage enum, fragment
addresses): they are read as inert placeholders, so reading needs no DeepSpeed installed and runs
no code of the file (``torch.load(weights_only=True)``). The values are then loaded through
the resharding path (tiertrain/state/reshard.py), as a one-rank run with one unit per parameter.
"""
from __future__ import annotations

import glob
import math
import os
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .checkpoint import CheckpointError
from .reshard import REPLICATED_PARTS, check_reshardable_format, compare_params, load_run
from .saved_run import MASTER, _joined, _SavedRun, _slice
from .shard_layout import _unit_of, parameter_slots
from ..optimizer_list import OptimizerList
from ..update.state_format import TorchOptimizerState
from ..zero.layout import Slot

if TYPE_CHECKING:
    from ..training_core import TrainingCore

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
               "ds_version", "checkpoint_parallel_dimensions", "csr_tensor_module_names", "mp_rank", "iteration"}
"""The model-states keys DeepSpeed writes itself; any other key is the client state."""


class _Opaque:
    """A DeepSpeed object in a checkpoint, kept inert: its class need not be importable and none
    of its code runs (what it was built from is kept, for an error message)."""

    def __init__(self, *args: Any):
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _load(path: str) -> dict:
    """One DeepSpeed file, memory-mapped (a file in torch's legacy format, which cannot be, read
    whole), with torch's weights-only unpickler; DeepSpeed's objects, and any other class the
    file names (a client state's), read as inert placeholders: the latter said in a warning."""
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
                      f"placeholders (tiertrain.state.deepspeed_checkpoint._Opaque: .args, .state), none of their "
                      f"code run", stacklevel=2)
    return state


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
                raise CheckpointError(f"{directory!r} has no 'latest' file naming the DeepSpeed checkpoint's tag: "
                                      f"give tag= (its subdirectories: {tags[:10]})")
            with open(latest) as f:
                tag = f.read().strip()
        self.directory = os.path.join(directory, tag)
        if not os.path.isdir(self.directory):
            raise CheckpointError(f"{self.directory!r} does not exist (tag {tag!r} of {directory!r})")
        self._refuse_other_layouts()
        optim_files = self._rank_files("optim_states")
        if not optim_files:
            raise CheckpointError(f"{self.directory!r} holds no ZeRO optimizer files (*zero_pp_rank_R_mp_rank_00_"
                                  f"optim_states.pt): tiertrain reads checkpoints of DeepSpeed's ZeRO stages 1-3; "
                                  f"{_WEIGHTS_ONLY}")
        self.world = len(optim_files)
        self._optim = [_load(p)["optimizer_state_dict"] for p in optim_files]
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
        self._model = [_load(p) for p in model_files]
        model = self._model[0]
        dp = model.get("dp_world_size", self.world)
        if dp != self.world:
            raise CheckpointError(f"{self.directory!r} was saved by {dp} data-parallel ranks but holds "
                                  f"{self.world} optimizer files")
        self.global_steps = int(model.get("global_steps", 0))
        self.skipped_steps = int(model.get("skipped_steps", 0))
        self.client_state = {k: v for k, v in model.items() if k not in _MODEL_KEYS}
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
        self.loss_scale = self._loss_scale()
        module = model.get("module") or {}
        self.buffers = {n: module[n] for n in model.get("buffer_names", []) if n in module}

    def _loss_scale(self) -> dict | None:
        """DeepSpeed's fp16 dynamic loss scale as tiertrain's scaler state keeps it (the scale,
        the good steps since the last overflow, the overflows left before it is lowered), or
        None where it scaled no loss dynamically (bf16, fp32, a static scale)."""
        state = getattr(self._optim[0].get("loss_scaler"), "state", None) or {}
        if not state.get("dynamic") or "cur_scale" not in state:
            return None
        return {"scale": float(state["cur_scale"]),
                "good_steps": int(state.get("cur_iter", 0)) - int(state.get("last_overflow_iter", -1)) - 1,
                "hysteresis_left": int(state.get("cur_hysteresis", 1)), "overflows": self.skipped_steps,
                "consecutive_skips": 0}

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

    def _rank_files(self, kind: str) -> list[str]:
        found = {}
        for path in glob.glob(os.path.join(self.directory, f"*zero_pp_rank_*_mp_rank_00_{kind}.pt")):
            rank = int(re.search(r"zero_pp_rank_(\d+)_", os.path.basename(path)).group(1))
            if rank in found:
                raise CheckpointError(f"{self.directory!r} holds two {kind} files of rank {rank}: "
                                      f"{found[rank]!r} and {path!r}")
            found[rank] = path
        if sorted(found) != list(range(len(found))):
            raise CheckpointError(f"{self.directory!r}: the {kind} files are of ranks {sorted(found)}, "
                                  f"not 0..{len(found) - 1}: some are missing")
        return [found[r] for r in range(len(found))]

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
            raise CheckpointError(f"{self.directory!r}: rank {rank}'s optimizer state holds {have}, not {key!r}: "
                                  f"tiertrain reads the moments of DeepSpeed's Adam and AdamW")
        return [_flat(s[key]) for s in states]

    def read(self, rank: int, key: str, offset: int, numel: int) -> torch.Tensor:
        """Elements [offset, offset + numel) of rank's buffers joined: of its fp32 masters (key
        "master") or of its optimizer state `key` ("exp_avg", "exp_avg_sq")."""
        out = torch.empty(numel, dtype=torch.float32)
        at = 0  # (where each buffer starts in the rank's buffers joined)
        for buffer in self._buffers_of(rank, key):
            a, b = max(offset, at), min(offset + numel, at + buffer.numel())
            if a < b:
                out[a - offset:b - offset] = buffer[a - at:b - at]
            at += buffer.numel()
        return out

    def value(self, name: str, key: str = "master") -> torch.Tensor:
        """Parameter name's fp32 master ("master") or optimizer state ("exp_avg", "exp_avg_sq"),
        whole and flat."""
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


class DeepSpeedRun(_SavedRun):
    """A DeepSpeed checkpoint seen as the tiertrain checkpoint of the same ranks and partitions
    (what tiertrain/state/reshard.py rebuilds any layout from, reading of each rank's buffers
    only the pieces it needs): one unit per bucket, cut in as many shards as DeepSpeed had
    ranks. The optimizer's hyper-parameters are the loading run's own (param_group: None); the
    replicated parts (counters, RNG, loss scaler) are the ones given; of the frozen parameters,
    those named (the ones the loading engine keeps in shards: stage 3's), one unit each."""

    def __init__(self, checkpoint: DeepSpeedCheckpoint, replicated: dict, frozen: list[str]):
        self.checkpoint = checkpoint
        world = checkpoint.world
        slots = [[[s.name, s.offset, s.numel, list(s.shape)] for s in b.slots] for b in checkpoint.buckets]
        units = [[f"deepspeed {k}", b.shard * world, world, slots[k]] for k, b in enumerate(checkpoint.buckets)]
        shards = world if checkpoint.frozen_sharded else 1
        frozen_units = []
        for name in frozen:
            shape = checkpoint.frozen_shapes[name]
            part = -(-math.prod(shape) // shards)
            frozen_units.append([name, part * shards, shards, [[name, 0, math.prod(shape), list(shape)]]])
        layouts = []
        for r in range(world):
            pieces = [[k, slot.name, a, b, bucket.group] for k, bucket in enumerate(checkpoint.buckets)
                      for slot, a, b in _unit_of(units[k], k).shard_pieces(r)]
            layouts.append({"state_format": TorchOptimizerState().record(), "shard_rank": r, "units": units,
                            "frozen": frozen_units, "pieces": pieces, "tp": [0, 1], "split": {}, "copies": {}})
        super().__init__(checkpoint.directory, {"shards": layouts}, prefer=0, verified=True)
        self.states[0] = {**replicated, "buffers": checkpoint.buffers, "extra": checkpoint.client_state}

    def file(self, rank: int) -> dict:
        return self.states[0]

    def _at(self, piece, a: int) -> tuple[int, int]:
        """(rank, offset in its buffers joined) of element a of a piece of a trained unit."""
        return piece.rank, self.checkpoint.buckets[piece.unit].start + piece.start + a - piece.lo

    def values(self, key: str, piece, a: int, b: int) -> torch.Tensor:
        if key == "frozen":
            return self.checkpoint.frozen_piece(piece.rank, piece.name, piece.start + a - piece.lo, b - a)
        rank, offset = self._at(piece, a)
        return self.checkpoint.read(rank, key, offset, b - a)

    def master(self, piece) -> torch.Tensor:
        return self.values(MASTER, piece, piece.lo, piece.hi)

    def frozen(self, piece) -> torch.Tensor:
        return self.values("frozen", piece, piece.lo, piece.hi)

    def frozen_dtype(self) -> torch.dtype:
        return self.checkpoint.frozen_dtype

    def holds_published(self) -> bool:
        return False

    def param_group(self, rank: int, group: int) -> dict | None:
        return None

    def state(self, piece) -> dict | None:
        return self.state_values(piece, piece.lo, piece.hi)

    def state_values(self, piece, a: int, b: int) -> dict | None:
        rank, offset = self._at(piece, a)
        c = self.checkpoint
        return {"step": torch.tensor(float(c.step_at(rank, offset))),
                **{key: c.read(rank, key, offset, b - a) for key in ("exp_avg", "exp_avg_sq")}}


# -- into an engine --------------------------------------------------------------------------

def _check_adam(update: Any, where: str) -> None:
    """The engine's optimizer keeps Adam's two moments and step, as DeepSpeed's Adam did: torch's
    Adam or AdamW (without amsgrad) in memory, or the NVMe stream under AdamW's names."""
    fmt = update.state_format
    if isinstance(fmt, TorchOptimizerState):
        optimizer = update.optimizer
        parts = optimizer.parts if isinstance(optimizer, OptimizerList) else [optimizer]
        other = [type(p).__name__ for p in parts if not isinstance(p, (torch.optim.Adam, torch.optim.AdamW))]
        amsgrad = any(g.get("amsgrad") for p in parts for g in p.param_groups)
        if other or amsgrad:
            raise CheckpointError(f"{where}: it holds the moments of DeepSpeed's Adam/AdamW; this engine's optimizer "
                                  f"is {other[0] if other else 'AdamW with amsgrad=True'}: use tiertrain's AdamW "
                                  f"(the default optimizer) or torch's Adam/AdamW without amsgrad")
    elif tuple(fmt.state_names) != ("exp_avg", "exp_avg_sq"):
        raise CheckpointError(f"{where}: it holds the moments of DeepSpeed's Adam/AdamW; this engine's NVMe optimizer "
                              f"keeps {list(fmt.state_names)}")


def load_into(engine: "TrainingCore", directory: str | os.PathLike, tag: str | None = None) -> dict:
    """Load the DeepSpeed checkpoint into the engine's parts (every rank reads the files it
    needs, memory-mapped); returns its client state. The counters continue from DeepSpeed's
    global step (so does the config's learning-rate schedule), an fp16 engine's loss scale from
    DeepSpeed's dynamic one; the optimizer's hyper-parameters and the RNG stay this engine's."""
    try:
        checkpoint = DeepSpeedCheckpoint(directory, tag)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{os.fspath(directory)!r} (tag {tag!r}) is not a DeepSpeed ZeRO checkpoint this "
                              f"version reads ({type(e).__name__}: {e})") from e
    where = f"the DeepSpeed checkpoint {checkpoint.directory!r}"
    shards = engine.shard_description()
    check_reshardable_format(shards, where)
    _check_adam(engine.update, where)
    parts = engine.checkpoint_parts()
    replicated = {name: parts[name].state_dict() for name in REPLICATED_PARTS if name in parts}
    # (DeepSpeed's global_steps counts the fp16 steps skipped on overflow too)
    applied = checkpoint.global_steps - checkpoint.skipped_steps
    replicated["train_state"] = {"micro_steps": checkpoint.global_steps * engine.config.batch.grad_accum_steps,
                                 "steps": applied, "skipped_steps": checkpoint.skipped_steps}
    replicated["update"] = {"schedule": engine.update.schedule.state_dict()}
    if "scaler" in parts and getattr(parts["scaler"], "enabled", False) and checkpoint.loss_scale is not None:
        replicated["scaler"] = {**replicated["scaler"], **checkpoint.loss_scale}
    sharded = {slot.name for _, slot in parameter_slots(shards, "frozen")}
    run = DeepSpeedRun(checkpoint, replicated, [n for n in checkpoint.frozen_shapes if n in sharded])
    tp_size = _SavedRun.tp(shards)[1]
    kept = _frozen_kept(engine, checkpoint)
    if kept:
        parts = {name: part for name, part in parts.items() if name != "frozen"}
    for kind, what in (("units", "trained"),) + ((("frozen", "frozen"),) if not kept else ()):
        own = {slot.name: _joined(slot.shape, shards["split"].get(slot.name), tp_size)
               for _, slot in parameter_slots(shards, kind)}
        compare_params(what, run.shapes[kind], own, {}, shards["copies"], checkpoint.directory,
                       whole_model=engine.topology.size("pp") == 1)
    held = {} if kept else _held_frozen(engine, checkpoint, sharded)
    extra = load_run(parts, run, engine.topology.rank, shards, engine.update, checkpoint.world, 0)
    with torch.no_grad():
        for name, (param, value) in held.items():
            param.copy_(value)
    return extra


def _frozen_kept(engine: "TrainingCore", checkpoint: DeepSpeedCheckpoint) -> int:
    """How many frozen parameters of this engine keep their values because the checkpoint holds
    none (DeepSpeed's save_checkpoint(exclude_frozen_parameters=True), as a LoRA run saves: the
    frozen weights are the pretrained ones, loaded before), said in a warning; 0 otherwise."""
    if checkpoint.frozen_shapes:
        return 0
    frozen = {n for module in engine.named_modules_of_state() for n, p in module.named_parameters()
              if not p.requires_grad} - set(checkpoint.shapes)
    if frozen:
        warnings.warn(f"the DeepSpeed checkpoint {checkpoint.directory!r} holds no frozen parameter (saved with "
                      f"exclude_frozen_parameters=True): this model's {len(frozen)} frozen parameters keep the "
                      f"values they have (e.g. {sorted(frozen)[0]!r}); load the pretrained weights they come from "
                      f"before (from_pretrained, or tiertrain.load_pretrained before the DeepSpeed checkpoint)",
                      FrozenKeptWarning, stacklevel=4)
    return len(frozen)


class FrozenKeptWarning(UserWarning):
    """A DeepSpeed checkpoint without frozen parameters left the model's own frozen values."""


def _held_frozen(engine: "TrainingCore", checkpoint: DeepSpeedCheckpoint, sharded: set[str]) -> dict:
    """{name: (the engine's parameter, its value)} for the checkpoint's frozen parameters that
    the engine's module holds whole (stages 0-2; a tensor-parallel slice: its slice)."""
    own = {n: p for module in engine.named_modules_of_state()
           for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    out = {}
    for name in checkpoint.frozen_shapes:
        if name in sharded:
            continue
        value = checkpoint.frozen_value(name)
        param = own.get(name)
        if param is None:
            if engine.topology.size("pp") > 1:
                continue  # (another pipeline stage's)
            raise CheckpointError(f"{checkpoint.directory!r} holds the frozen parameter {name!r} "
                                  f"{tuple(value.shape)}, which this model does not have (as a frozen parameter)")
        if getattr(param, "tp_sharded", False):
            size, coord = engine.topology.size("tp"), engine.topology.coord("tp")
            value = _slice(value.reshape(-1), tuple(value.shape), int(param.tp_shard_dim), coord, size)
        if value.numel() != param.numel():
            raise CheckpointError(f"{checkpoint.directory!r} holds frozen {name!r} with shape "
                                  f"{tuple(value.shape)}, this model has shape {tuple(param.shape)}")
        out[name] = (param, value.reshape(param.shape))
    loaded = {id(p) for p, _ in out.values()}
    missing = sorted(n for n, p in own.items() if id(p) not in loaded and n not in sharded
                     and n not in checkpoint.shapes)
    if missing:
        raise CheckpointError(f"{checkpoint.directory!r} holds no value for the frozen parameters {missing[:10]} of "
                              f"this model (it has {sorted(checkpoint.frozen_shapes)[:10]})")
    return out


__all__ = ["DEEPSPEED_OBJECTS", "DeepSpeedCheckpoint", "DeepSpeedRun", "FrozenKeptWarning", "load_into"]
