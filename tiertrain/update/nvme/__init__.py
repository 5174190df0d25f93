"""ZeRO-Infinity's optimizer step from NVMe (docs/concepts.md#optimizer-step-with-nvme).

* :mod:`.optimizer`: :class:`NVMeAdamW`, AdamW whose fp32 masters and moments live in swap
  files and stream through a few chunk buffers at each step;
* :mod:`.chunk_update`: one step's update of each chunk, and the statistics of a pass;
* :mod:`.overlapped_step`: the same step run during backward, each unit's chunks once its
  gradient is final;
* :mod:`.form`: the update forms the engine drives (:class:`~.form.NVMeUpdate`,
  :class:`~.form.OverlappedNVMeUpdate`; tiertrain/update/protocol.py).
"""
from .chunk_update import StepStats
from .optimizer import NVMeAdamW, pieces_from_param_groups

__all__ = ["NVMeAdamW", "StepStats", "pieces_from_param_groups"]
