"""A torch.distributed.checkpoint (DCP) checkpoint of an FSDP2 run (read by
tiertrain/state/dcp_files.py) loaded into an engine of any layout: each trained parameter's
value as its fp32 master, the optimizer's state (Adam's moments and step, or whatever the
engine's optimizer keeps: tiertrain/state/optimizer_state.py), the frozen values, the buffers
and the step count, so a run moved from FSDP2 (torchtitan, Accelerate, transformers' Trainer) continues
where it stopped instead of restarting its optimizer (docs/migrate-fsdp2.md).

Where the values are is found, not assumed: the saved dict nests the model's state dict
somewhere (``{"model": ...}``, torchtitan's top level, a wrapper's ``module.`` prefix) and the
optimizer's state keyed by parameter name (``get_optimizer_state_dict``, nested or flattened:
``...state.<name>.exp_avg``); the one place holding every parameter of the engine's model is
taken, and an ambiguity or a gap is an error naming it. The checkpoint then goes through the
resharding path (tiertrain/state/reshard.py) as the tiertrain run of one rank holding each
parameter whole, read by range: each rank reads the chunks its shards overlap.
"""
from __future__ import annotations

import math
import os
import re
from typing import TYPE_CHECKING, Any

import torch

from .checkpoint import CheckpointError
from .dcp_files import METADATA, DcpCheckpoint, DcpItem
from .foreign import ForeignRun, check_buffers, copy_held, frozen_kept, held_frozen, replicated_at
from .optimizer_state import OptimizerStateKeys, saved_count, saved_per_element
from .reshard import check_reshardable_format, compare_models, load_run
from .shard_layout import _unit_of, parameter_slots
from ..update.state_format import TorchOptimizerState

if TYPE_CHECKING:
    from ..training_core import TrainingCore

def open_checkpoints(path: str | os.PathLike) -> list[DcpCheckpoint]:
    """The DCP directory at path, or the DCP directories directly inside it (a transformers
    Trainer's ``checkpoint-N/``: ``pytorch_model_fsdp_0/`` and ``optimizer_0/``)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is not a directory (a torch.distributed.checkpoint directory, or one "
                              f"holding such directories)")
    if os.path.lexists(os.path.join(path, METADATA)):
        return [DcpCheckpoint(path)]
    inside = sorted(e.path for e in os.scandir(path) if e.is_dir() and os.path.isfile(os.path.join(e.path, METADATA)))
    if not inside:
        raise CheckpointError(f"{path!r} holds no {METADATA!r} file, nor does any directory in it: not a "
                              f"torch.distributed.checkpoint checkpoint")
    return [DcpCheckpoint(p) for p in inside]


class DcpModel:
    """The checkpoint's items matched to an engine's model: the item of each parameter's value
    (``shapes``: trained, ``frozen_shapes``: frozen, by the engine's names), of its optimizer
    state, and each persistent buffer's value (``buffers``). With whole_model, a value under the
    model's place that is none of these (nor a transient, non-persistent buffer) is an error."""

    def __init__(self, path: str, checkpoints: list[DcpCheckpoint], aliases: dict[str, list[str]],
                 trained: list[str], frozen: list[str], buffers: list[str], whole_model: bool,
                 kept: OptimizerStateKeys, transient: set[str] = frozenset()):
        self.directory = path
        self._items: dict[str, tuple[DcpCheckpoint, DcpItem]] = {}
        for c in checkpoints:
            for key, item in c.tensors.items():
                if key in self._items:
                    raise CheckpointError(f"{path!r}: the item {key!r} is in two of its DCP directories")
                self._items[key] = (c, item)
        self.checkpoints = checkpoints
        self._aliases = aliases
        self._suffixes = self._suffix_index()
        prefix = self._model_prefix(trained, frozen)
        self._value_key = {n: k for n in trained + frozen + buffers
                           if (k := self._key_under(prefix, n)) is not None}
        self.shapes = {n: self._item(self._value_key[n]).shape for n in trained if n in self._value_key}
        self.frozen_shapes = {n: self._item(self._value_key[n]).shape for n in frozen if n in self._value_key}
        self.buffers = {n: self._whole(self._value_key[n]) for n in buffers if n in self._value_key}
        if whole_model:
            self._refuse_unknown(prefix, set(trained) | set(frozen) | set(buffers) | set(transient))
        self.kept = kept
        self._state = self._optimizer_state(trained)
        self._steps = {n: self._saved_step(n) for n in self._state if "step" in self._state[n]}
        self.steps = max(self._steps.values()) if self._steps else None
        """The most updates a parameter took (its optimizer's step); None where the optimizer
        counts none (SGD)."""

    def _item(self, key: str) -> DcpItem:
        return self._items[key][1]

    def _whole(self, key: str) -> torch.Tensor:
        checkpoint, item = self._items[key]
        return checkpoint.whole(key).reshape(item.shape)

    # -- where the model's values are --

    def _places(self, name: str) -> set[tuple[tuple, str]]:
        """(the path above, the prefix within the last key) of every item holding name (or an
        alias of it) as its last path element, after a prefix ending in a dot."""
        out = set()
        for alias in self._aliases.get(name, [name]):
            for key in self._suffixes.get(alias, ()):
                item = self._item(key)
                last = str(item.path[-1])
                out.add((tuple(item.path[:-1]), last[:len(last) - len(alias)]))
        return out

    def _suffix_index(self) -> dict[str, list[str]]:
        """Every dot-suffix of each tensor item's last path element -> the items ending so."""
        out: dict[str, list[str]] = {}
        for key, (_, item) in self._items.items():
            last = str(item.path[-1]).split(".")
            for i in range(len(last)):
                out.setdefault(".".join(last[i:]), []).append(key)
        return out

    def _model_prefix(self, trained: list[str], frozen: list[str]) -> tuple[tuple, str]:
        common: set | None = None
        for name in trained + frozen:
            places = self._places(name)
            if not places and name in frozen:
                continue  # (a checkpoint may leave frozen parameters out: foreign.frozen_kept)
            common = places if common is None else common & places
            if not common:
                shown = sorted(self._items)[:6]
                raise CheckpointError(f"{self.directory!r}: no part of the saved state dict holds every trained "
                                      f"parameter of this model; {name!r} is missing"
                                      f"{' where the others are' if places else ''} (its tensor items begin "
                                      f"{shown})")
        if common is None:
            raise CheckpointError(f"{self.directory!r}: this model has no parameter to load")
        if len(common) > 1:
            raise CheckpointError(f"{self.directory!r}: the model's parameters are in more than one place of the "
                                  f"saved state dict: {sorted(_words(p) for p in common)}")
        return next(iter(common))

    def _key_under(self, prefix: tuple[tuple, str], name: str) -> str | None:
        above, within = prefix
        for alias in self._aliases.get(name, [name]):
            for key in self._suffixes.get(alias, ()):
                path = self._item(key).path
                if tuple(path[:-1]) == above and str(path[-1]) == within + alias:
                    return key
        return None

    def _refuse_unknown(self, prefix: tuple[tuple, str], known: set[str]) -> None:
        above, within = prefix
        names = {a for n in known for a in self._aliases.get(n, [n])}
        under = [str(i.path[-1]) for _, i in self._items.values() if tuple(i.path[:-1]) == above]
        unknown = sorted(last[len(within):] for last in under
                         if last.startswith(within) and last[len(within):] not in names and not _optimizer_key(last))
        if unknown:
            raise CheckpointError(f"{self.directory!r} holds the model values {unknown[:10]} "
                                  f"(under {_words(prefix)}), which this model does not have")

    # -- the optimizer's state --

    def _state_index(self) -> dict[str, dict[str, dict[str, tuple]]]:
        """parameter name -> the path above -> state name -> (checkpoint, key), of every item
        whose path joined reads ``<above>state.<parameter name>.<state name>`` (tensors, and
        objects: a step saved as a number)."""
        index: dict[str, dict[str, dict[str, tuple]]] = {}
        for c in self.checkpoints:
            for key, path in [*((k, i.path) for k, i in c.tensors.items()), *c.objects.items()]:
                joined = ".".join(str(p) for p in path)
                for m in re.finditer(r"(?:^|\.)state\.", joined):
                    rest = joined[m.end():]
                    if "." in rest:
                        name, state_name = rest.rsplit(".", 1)
                        above = joined[:m.end() - len("state.")]
                        index.setdefault(name, {}).setdefault(above, {})[state_name] = (c, key)
        return index

    def _optimizer_state(self, trained: list[str]) -> dict[str, dict[str, tuple]]:
        """{trained name: {state name: (checkpoint, key)}} of the parameters with optimizer state."""
        index = self._state_index()
        out: dict[str, dict[str, dict[str, tuple]]] = {}
        places: set[str] | None = None
        for name in trained:
            by_place = next((index[a] for a in self._aliases.get(name, [name]) if a in index), None)
            if by_place is None:
                continue  # (never stepped)
            places = set(by_place) if places is None else places & set(by_place)
            if not places:
                raise CheckpointError(f"{self.directory!r}: the optimizer state of {name!r} is not where the "
                                      f"other parameters' is")
            out[name] = by_place
        if not out and all(self.kept.expected(n, self.shapes[n]) == {} for n in trained if n in self.shapes):
            return {}  # (an optimizer that keeps no state: SGD without momentum)
        if not out:
            numbered = sorted(n for n in index if n.isdigit())
            if numbered:
                raise CheckpointError(f"{self.directory!r} keys its optimizer state by parameter number (state."
                                      f"{numbered[0]}: torch's optimizer.state_dict()), which names no parameter; "
                                      f"save it by name: torch.distributed.checkpoint.state_dict."
                                      f"get_optimizer_state_dict(model, optimizer)")
            raise CheckpointError(f"{self.directory!r} holds no optimizer state for this model's parameters (no "
                                  f"item '...state.<parameter name>.<state>', as get_optimizer_state_dict saves it)"
                                  f"; a model's weights alone load through tiertrain.load_pretrained from a "
                                  f"safetensors export (torch.distributed.checkpoint.format_utils.dcp_to_torch_save)")
        if len(places) > 1:
            raise CheckpointError(f"{self.directory!r}: optimizer states are in more than one place: {sorted(places)}")
        place = next(iter(places))
        state = {name: by_place[place] for name, by_place in out.items()}
        for name, keys in state.items():
            saved = {key: (c.tensors[k].shape if k in c.tensors else None) for key, (c, k) in keys.items()}
            self.kept.check(repr(self.directory), name, self.shapes[name], saved)
        return state

    def has_state(self, name: str) -> bool:
        return name in self._state

    def recorded_steps(self) -> int | None:
        """The run's step count where the saved dict records one beside the model (torchtitan's
        ``train_state.step``); None where none is."""
        found = [(c, key) for c in self.checkpoints for key, path in [*((k, i.path) for k, i in c.tensors.items()),
                                                                       *c.objects.items()]
                 if tuple(map(str, path[-2:])) == ("train_state", "step")]
        if len(found) != 1:
            return None
        c, key = found[0]
        return saved_count(c.whole(key) if key in c.tensors else c.object(key), repr(self.directory), "train_state")

    def _saved_step(self, name: str) -> int:
        return saved_count(self._whole_state(name, "step"), repr(self.directory), name)

    def _whole_state(self, name: str, key: str) -> Any:
        """The parameter's state key whole: a tensor in its saved dtype, or the number saved."""
        c, item_key = self._state[name][key]
        return c.whole(item_key) if item_key in c.tensors else c.object(item_key)

    def state_values(self, name: str, a: int, b: int) -> dict[str, Any]:
        """The parameter's optimizer state as its optimizer keeps it: each per-element value's
        elements [a, b) (in the dtype the optimizer keeps it: fp32 moments, bitsandbytes' uint8
        states), the others whole, the step in the optimizer's own form."""
        shape = self.shapes[name]
        out: dict[str, Any] = {}
        for key, (c, item_key) in self._state[name].items():
            if key == "step":
                out[key] = self.kept.step_as_kept(name, shape, self._steps[name])
            elif item_key in c.tensors and saved_per_element(c.tensors[item_key].shape, shape):
                out[key] = c.read(item_key, a, b).to(self.kept.dtype_of(name, shape, key))
            else:
                value = self._whole_state(name, key)
                out[key] = value.clone() if isinstance(value, torch.Tensor) else value
        return out

    # -- values --

    def read(self, name: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of the parameter's value (trained or frozen)."""
        item_key = self._value_key[name]
        return self._items[item_key][0].read(item_key, a, b)

    def frozen_value(self, name: str) -> torch.Tensor:
        return self._whole(self._value_key[name])

    @property
    def frozen_dtype(self) -> torch.dtype:
        return next((self._item(self._value_key[n]).dtype for n in self.frozen_shapes), torch.float32)


def _optimizer_key(last: str) -> bool:
    return last.startswith("state.") or last.startswith("param_groups.")


def _words(prefix: tuple[tuple, str]) -> str:
    above, within = prefix
    return "the top level" if not above and not within else repr(".".join([*map(str, above), within]).strip("."))


class DcpRun(ForeignRun):
    """A DCP checkpoint seen as the tiertrain checkpoint of one rank holding every parameter
    whole, one unit each, read by range."""

    def __init__(self, model: DcpModel, replicated: dict, trained: list[str], frozen: list[str], extra: dict):
        self.model = model

        def unit(name: str, shape: tuple) -> list:
            numel = math.prod(shape)
            return [name, numel, 1, [[name, 0, numel, list(shape)]]]

        units = [unit(n, model.shapes[n]) for n in trained]
        pieces = [[k, slot.name, a, b, 0] for k in range(len(units))
                  for slot, a, b in _unit_of(units[k], k).shard_pieces(0)]
        layout = {"state_format": TorchOptimizerState().record(), "shard_rank": 0, "units": units,
                  "frozen": [unit(n, model.frozen_shapes[n]) for n in frozen], "pieces": pieces, "tp": [0, 1],
                  "split": {}, "copies": {}}
        super().__init__(model.directory, [layout], {**replicated, "buffers": model.buffers, "extra": extra})

    def values(self, key: str, piece, a: int, b: int) -> torch.Tensor:
        value = self.model.read(piece.name, a, b)
        return value if key == "frozen" else value.float()

    def frozen_dtype(self) -> torch.dtype:
        return self.model.frozen_dtype

    def state_values(self, piece, a: int, b: int) -> dict | None:
        if not self.model.has_state(piece.name):
            return None  # (never stepped)
        return self.model.state_values(piece.name, a, b)


# -- into an engine --------------------------------------------------------------------------

def _aliases(engine: "TrainingCore") -> dict[str, list[str]]:
    """Each parameter name of the engine's modules -> every name of that parameter (tied)."""
    by_id: dict[int, list[str]] = {}
    for module in engine.named_modules_of_state():
        for name, param in module.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(param), []).append(name)
    return {name: names for names in by_id.values() for name in names}


def load_into(engine: "TrainingCore", path: str | os.PathLike) -> dict:
    """Load the DCP checkpoint at path into the engine's parts; returns {} (the saved dict's
    other items stay in the files: read them with torch.distributed.checkpoint). The counters
    continue from the optimizer's step (so does the schedule: the config's, or a client lr_scheduler
    stepped once per update applied); the optimizer's hyper-parameters and the RNG stay this
    engine's."""
    return load_items(engine, os.fspath(path), open_checkpoints(path), f"the DCP checkpoint {os.fspath(path)!r}")


def load_items(engine: "TrainingCore", path: str, checkpoints: list, where: str, counted: int | None = None,
               loss_scale: dict | None = None, extra: dict | None = None) -> dict:
    """load_into of the items of checkpoints (DcpCheckpoint or NestedState) found at path.
    counted: the steps the saving run counted, fp16 steps skipped on overflow included (the
    optimizer's step leaves them out; SGD keeps none); loss_scale: its loss scaler's state, as
    tiertrain's scaler keeps it; extra: the client state to return (default {})."""
    shards = engine.shard_description()
    check_reshardable_format(shards, where)
    parts = engine.checkpoint_parts()
    copies = shards["copies"]
    trained = list(dict.fromkeys(copies.get(s.name, s.name) for _, s in parameter_slots(shards, "units")))
    own_frozen = {n for module in engine.named_modules_of_state()
                  for n, p in module.named_parameters() if not p.requires_grad}
    sharded = [s.name for _, s in parameter_slots(shards, "frozen")]
    frozen = sorted(own_frozen | set(sharded))
    buffers = sorted(parts["buffers"].named()) if "buffers" in parts else []
    # (a non-persistent buffer an older version of the model saved is no unknown value: it is left)
    transient = {n for module in engine.named_modules_of_state() for n, _ in module.named_buffers()} - set(buffers)
    whole_model = engine.topology.size("pp") == 1
    kept_state = OptimizerStateKeys(engine)
    model = DcpModel(path, checkpoints, _aliases(engine), trained, frozen, buffers, whole_model, kept_state,
                     transient)
    steps = model.steps if model.steps is not None else counted if counted is not None else model.recorded_steps()
    if steps is None:
        raise CheckpointError(f"{where}: its optimizer state counts no steps ({kept_state.name} keeps no step) and "
                              f"nothing else read here says how many updates the run took (no 'train_state.step', "
                              f"as torchtitan saves it); resume it through the trainer that saved it with its step "
                              f"count (TiertrainTrainer reads trainer_state.json)")
    skipped = 0 if counted is None else counted - steps
    if skipped < 0:
        raise CheckpointError(f"{where}: the optimizer took {steps} steps but the run counted {counted}: a "
                              f"checkpoint of another run than its step count's")
    replicated = replicated_at(engine, parts, steps, skipped, loss_scale)
    kept = frozen_kept(engine, model, "the trainable parameters alone")
    if kept:
        parts = {name: part for name, part in parts.items() if name != "frozen"}
    run = DcpRun(model, replicated, [n for n in trained if n in model.shapes],
                 [n for n in sharded if n in model.frozen_shapes], extra or {})
    compare_models(run, shards, path, whole_model=whole_model, kinds=("units",) if kept else ("units", "frozen"))
    held = {} if kept else held_frozen(engine, model, set(sharded))
    if "buffers" in parts:
        check_buffers(parts["buffers"].named(), model)
    extra = load_run(parts, run, engine.topology.rank, shards, engine.update, 1, 0)
    engine.update.schedule.fast_forward(steps)  # (a client lr_scheduler: built afresh, at step 0)
    copy_held(held)
    return extra


__all__ = ["DcpModel", "DcpRun", "load_into", "open_checkpoints"]
