"""The memory tiers of ZeRO-Infinity (§5): where each kind of model state lives. One
vocabulary for the configuration, the engine and the estimator."""
from __future__ import annotations

from enum import Enum


class Tier(str, Enum):
    """A memory tier. A str enum: ``Tier.CPU == "cpu"``, and it prints as its value.
    Configuration files may spell the device tier ``none`` (no offload), the spelling of
    DeepSpeed's ``offload_optimizer.device: none``."""

    DEVICE = "device"
    """The compute device's memory (GPU memory; host memory on a CPU-only machine)."""
    CPU = "cpu"
    """Host memory, pinned when the device is a GPU."""
    NVME = "nvme"
    """Swap files on a local NVMe (or any) file system, through the async IO stack."""

    @classmethod
    def _missing_(cls, value):
        if value == "none":
            return cls.DEVICE
        return None

    def __str__(self) -> str:
        return self.value

    @property
    def config_name(self) -> str:
        """The configuration's spelling: "none" for the device (nothing offloaded)."""
        return "none" if self is Tier.DEVICE else self.value

    @property
    def offloaded(self) -> bool:
        """Whether the state lives outside the compute device."""
        return self is not Tier.DEVICE


TIER_CHOICES = ("none", "device", "cpu", "nvme")
"""What a configuration or command line may write for a tier ("none" = "device")."""
