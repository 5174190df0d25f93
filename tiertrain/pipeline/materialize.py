"""A pipeline rank builds only its own stages: a model made on the meta device (shapes, no
values; ``with torch.device("meta"): model = AutoModelForCausalLM.from_config(config)``) is cut
into stages as any other, and each rank gives values only to the tensors of the stages it keeps.
The rest of the model stays on the meta device and costs no memory, as Megatron's and
DeepSpeed's ``PipelineModule`` build only their stage's layers; ``tiertrain.load_pretrained(
engine, path)`` then reads each rank's tensors from the checkpoint (tiertrain/state/pretrained.py).

Values come from the model's own initialisation: a Hugging Face model's ``_init_weights`` (the
function transformers itself applies after building on the meta device, which also recomputes
derived buffers such as rotary frequencies and position ids), else each module's
``reset_parameters``. A tensor neither covers is never trained from whatever memory it was
given: every tensor is first filled with a value no initialiser writes (NaN; an integer type's
minimum) and checked after, and the engine refuses to train, naming it, until a checkpoint gives
it a value (:class:`UnsetTensors`). A weight tied across the first and last
stage is sent from the first stage's rank to the last one's, so the copies start equal (as a
whole build's clone makes them); the data-parallel replicas of a stage start from their rank
0's values, as for any model (tiertrain/engine_build.py initial_value).
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import ConfigError
from ..topology import Topology
from ..waits import run_timeout
from .engine import tied_names

__all__ = ["UnsetTensors", "has_meta", "materialize_stages", "ranks_with"]

_TIED_WEIGHT_TAG = 0x7E1EE
"""The tag of the tied weight's transfer (stage.sum_tied_gradients' is 0x7E1ED)."""


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def materialize_stages(model: nn.Module, stages: list[nn.Module], topology: Topology) -> "UnsetTensors":
    """Give host memory and initial values to the meta tensors of this rank's ``stages`` (cut
    from ``model``), leaving every other stage's on the meta device; see the module docstring.
    Returns the tensors no initialiser gave a value, which a checkpoint may still give
    (collective: every rank learns which ranks have any)."""
    initialisers = _initialisers(model)
    fresh: dict[int, torch.Tensor] = {}  # id(meta tensor) → its replacement (a tensor held twice stays one)
    owners: dict[int, nn.Module] = {}  # the modules that held meta tensors themselves, each once
    for stage in stages:
        for module in stage.modules():
            if _replace_meta(module, fresh):
                owners.setdefault(id(module), module)
    with torch.no_grad():
        for module in owners.values():
            initialisers.get(id(module), _reset)(module)
        _send_tied_weight(stages, topology)
    made = {id(v) for v in fresh.values()}
    unset = [f"{name}.{attr}" if name else attr for stage in stages for name, module in stage.named_modules()
             for attr, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
             if id(t) in made and _unset(t)]
    return UnsetTensors(list(dict.fromkeys(unset)), topology)


class UnsetTensors:
    """The tensors of this rank's stages a meta-device build left without a value (no
    initialiser covers them, or they hold booleans, which no marker tells from written ones),
    and the global ranks that have any, agreed by every rank. A pipeline engine refuses to train
    or evaluate while any rank has one (:meth:`check`): tiertrain.load_pretrained gives them
    their checkpoint's values (:meth:`loaded`), as transformers' own meta-device loading does."""

    def __init__(self, names: list[str], topology: Topology):
        self.names = names
        self._topology = topology
        self.ranks = ranks_with(bool(names), topology)

    def loaded(self, names: list[str]) -> None:
        """These now hold a checkpoint's values (collective: the ranks agree again)."""
        done = set(names)
        self.names = [n for n in self.names if n not in done]
        self.ranks = ranks_with(bool(self.names), self._topology)

    def check(self, what: str) -> None:
        """ConfigError when any rank still holds a tensor without a value."""
        if self.names:
            raise ConfigError(f"{what}: the model was built on the meta device and no initialiser gave "
                              f"{', '.join(self.names)} a value that can be checked (its module has no "
                              f"reset_parameters and the model's own _init_weights does not cover it, or it holds "
                              f"booleans, which no marker tells from written ones): load a checkpoint holding them "
                              f"(tiertrain.load_pretrained(engine, path)), give the module a reset_parameters() "
                              f"method, or build the model with its values (not under torch.device('meta'))")
        if self.ranks:
            raise ConfigError(f"{what}: the model was built on the meta device and global rank(s) {self.ranks} hold "
                              f"tensors no initialiser gave a value (named there): load a checkpoint holding them "
                              f"(tiertrain.load_pretrained(engine, path)), or build the model with its values")


def ranks_with(flag: bool, topology: Topology) -> list[int]:
    """The global ranks where flag is set (every rank learns of them, so that all refuse alike
    and none goes on to wait for the others in its first collective)."""
    flags = torch.zeros(topology.world_size, dtype=torch.int64, device=topology.device)  # (nccl: on the device)
    flags[topology.rank] = int(flag)
    if topology.world_size > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=topology.world_group())
    return [r for r, f in enumerate(flags.tolist()) if f]


def _replace_meta(module: nn.Module, fresh: dict[int, torch.Tensor]) -> bool:
    """Replace the meta tensors ``module`` holds itself (not its children's) by host tensors
    filled with the unset marker; True when it held any."""
    found = False
    for attr, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
        if not t.is_meta:
            continue
        found = True
        if id(t) not in fresh:
            value = _marked(torch.empty_like(t, device="cpu"))
            if isinstance(t, nn.Parameter):
                value = nn.Parameter(value, requires_grad=t.requires_grad)
                vars(value).update(vars(t))
            fresh[id(t)] = value
        setattr(module, attr, fresh[id(t)])  # (a buffer keeps its persistence: Module.__setattr__)
    return found


def _marked(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype != torch.bool:
        return t.fill_(torch.iinfo(t.dtype).min)
    return t.zero_()


def _unset(t: torch.Tensor) -> bool:
    """Still holding the marker; a boolean tensor always counts (no value marks it: a mask
    left all False would pass for one an initialiser wrote)."""
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype != torch.bool:
        return bool((t == torch.iinfo(t.dtype).min).any())
    return True


def _reset(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def _initialisers(model: nn.Module) -> dict[int, object]:
    """id(submodule) → the ``_init_weights`` of the innermost Hugging Face pretrained model
    holding it (a composite model's parts initialise as their own class does)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return {}
    out: dict[int, object] = {}

    def visit(module: nn.Module, owner: object) -> None:
        if isinstance(module, PreTrainedModel):
            owner = module._init_weights
        if owner is not None:
            out[id(module)] = owner
        for child in module.children():
            visit(child, owner)

    visit(model, None)
    return out


def _send_tied_weight(stages: list[nn.Module], topology: Topology) -> None:
    """The last stage's copy of a tied weight takes the first stage's values (another rank's)."""
    ranks = topology.ranks("pp")
    for stage in stages:
        if not getattr(stage, "tied", False) or stage.is_first == stage.is_last:
            continue
        first, last = tied_names(stage)
        weight = stage.get_parameter(first if stage.is_first else last)
        peer = ranks[-1] if stage.is_first else ranks[0]
        what = (f"the tied weight {first!r} from pipeline rank 0 (global rank {ranks[0]}) to its copy {last!r} on "
                f"pipeline rank {len(ranks) - 1} (global rank {ranks[-1]})")
        buffer = weight.detach().to(topology.device).contiguous()  # (nccl sends device tensors; the stage's are host)
        transfer = dist.isend if stage.is_first else dist.irecv  # (as stage.sum_tied_gradients exchanges gradients)
        work = transfer(buffer, peer, group=topology.group("pp"), tag=_TIED_WEIGHT_TAG)
        timeout = run_timeout()
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            raise RuntimeError(f"sending {what} did not complete within {timeout:g} s (the run's timeout): {e}") from e
        if stage.is_last:
            weight.copy_(buffer)
