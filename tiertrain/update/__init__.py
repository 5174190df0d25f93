"""The optimizer step as one protocol (:class:`OptimizerUpdate`) with one implementation per
form: in memory (``in_memory.py``), whole parameters (``whole.py``), from NVMe (the package
``nvme/``, also overlapped with backward) and ZeRO-Offload's one-step delayed update
(``delayed.py``). :func:`tiertrain.update.factory.build_update` picks the
form once, from the configuration; the engine only calls the protocol. Each form declares the
format of its checkpoint state as a type (``state_format.py``)."""
from .protocol import OptimizerUpdate, UpdateMemory, restore_masters, scale_gradients, shard_param_groups
from .state_format import FormOwnState, NVMeStreamState, StateFormat, TorchOptimizerState

__all__ = ["FormOwnState", "NVMeStreamState", "OptimizerUpdate", "StateFormat", "TorchOptimizerState", "UpdateMemory",
           "restore_masters", "scale_gradients", "shard_param_groups"]
