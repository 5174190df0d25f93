"""The optimizer step as one protocol (:class:`OptimizerUpdate`) with one implementation per
form: in memory (``in_memory.py``), whole parameters (``whole.py``), from NVMe (the package
``nvme/``, also overlapped with backward) and ZeRO-Offload's one-step delayed update
(``delayed.py``). :func:`tiertrain.update.factory.build_update` picks the
form once, from the configuration; the engine only calls the protocol."""
from .protocol import OptimizerUpdate, UpdateMemory, restore_masters, scale_gradients, shard_param_groups

__all__ = ["OptimizerUpdate", "UpdateMemory", "restore_masters", "scale_gradients", "shard_param_groups"]
