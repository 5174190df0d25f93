"""tiertrain: train models larger than device memory on PyTorch.

ZeRO stages 1-3 (Rajbhandari et al.), ZeRO-Offload and ZeRO-Infinity tiers, and
Megatron-style tensor/pipeline/data parallelism, behind one engine contract::

    topology = tiertrain.Topology.build(config.parallel)
    engine = tiertrain.wrap(model, config, topology)
    loss = engine(batch); engine.backward(loss); engine.step()
"""
from .compiling import compile_blocks
from .config import Config, ConfigError
from .engine import Engine
from .training_core import TrainingCore
from .errors import ReleasedParameterError, TiertrainError
from .held_gradients import HeldGradientError
from .in_place_edits import InPlaceEditError
from .memory_report import MemoryReport
from .label_conventions import LabelConventionError
from .update.native_adamw import KernelUnavailable
from .wrapping import AlreadyWrappedError, wrap
from .topology import Topology
from .zero.construct import partitioned_init
from .state.export import ExportReport
from .state.peft_export import PeftExport
from .state.pretrained import (LoadReport, NonFiniteWeightsError, PretrainedMismatchError, PretrainedMissingWarning,
                               QuantizedCheckpointError, load_pretrained)
from .trainer import EvalConfig, LoopConfig, Trainer

__all__ = ["AlreadyWrappedError", "Config", "ConfigError", "Engine", "EvalConfig", "ExportReport",
           "HeldGradientError", "InPlaceEditError", "KernelUnavailable", "LabelConventionError", "LoadReport",
           "LoopConfig", "MemoryReport", "NonFiniteWeightsError", "PeftExport", "PretrainedMismatchError",
           "PretrainedMissingWarning", "QuantizedCheckpointError", "ReleasedParameterError", "TiertrainError",
           "Topology", "Trainer", "TrainingCore", "compile_blocks", "load_pretrained", "partitioned_init", "wrap"]
__version__ = "0.1.0"
