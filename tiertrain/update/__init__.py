"""The optimizer step as one protocol (:class:`OptimizerUpdate`) with one implementation per
form: in memory (``in_memory.py``), from NVMe (``tiertrain/offload/nvme_update.py``, also
overlapped with backward) and ZeRO-Offload's one-step delayed update
(``tiertrain/offload/delayed.py``). :func:`tiertrain.update.factory.build_update` picks the
form once, from the configuration; the engine only calls the protocol."""
from .protocol import OptimizerUpdate, UpdateMemory, restore_masters, scale_gradients, shard_param_groups

__all__ = ["OptimizerUpdate", "UpdateMemory", "restore_masters", "scale_gradients", "shard_param_groups"]
