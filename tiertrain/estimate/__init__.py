"""Know before you launch: memory and bandwidth estimates and a hardware probe.

* :mod:`~tiertrain.estimate.memory` — per-rank memory of a run, :func:`estimate`, in the
  papers' accounting or the engine's own; the papers' formulas (ZeRO §5 Table 1/2,
  ZeRO-Infinity §3) are :mod:`~tiertrain.estimate.formulas`, the model's size
  :mod:`~tiertrain.estimate.dims` and the layout over ranks and tiers
  :mod:`~tiertrain.estimate.layout`.
* :mod:`~tiertrain.estimate.bandwidth` — ZeRO-Infinity §4 arithmetic intensity and efficiency.
* :mod:`~tiertrain.estimate.probe` — measured CPU/RAM/disk/GPU figures, saved as JSON
  (``probe.probe()``, re-exported here as :func:`probe_hardware` so that
  ``tiertrain.estimate.probe`` remains the module).
* :mod:`~tiertrain.estimate.peak` — tiertrain's engine buffer by buffer: model states from
  its own layout and a simulated step giving the per-rank peak (what :func:`estimate`
  reports with engine accounting), on the engine's units (:mod:`~tiertrain.estimate.units`),
  the activations of its GPT (:mod:`~tiertrain.estimate.activations`) and the process
  overhead (:mod:`~tiertrain.estimate.overhead`); the peak of building the model and
  wrapping it is :mod:`~tiertrain.estimate.build_peak`'s.
* :mod:`~tiertrain.estimate.modules` — any Hugging Face model (or module) described for the
  estimator and the planner: exact parameter counts, activations per block by family.
* :mod:`~tiertrain.estimate.plan` — the placement planner (``tiertrain plan``,
  ``zero.offload: auto``), for the machines of :mod:`~tiertrain.estimate.hardware`, each
  layout evaluated by :mod:`~tiertrain.estimate.candidates`; the 3D layout search is
  :mod:`~tiertrain.estimate.layout3d`, its cost model :mod:`~tiertrain.estimate.cost3d`.
* :mod:`~tiertrain.estimate.measure` — measured peak memory of real engine runs, and the
  overhead calibration ``tiertrain probe`` runs.
* :mod:`~tiertrain.estimate.report` — a plain-text table and JSON of an estimate.
"""

from tiertrain.estimate.bandwidth import (
    BandwidthPrediction,
    TierEfficiency,
    ait_activation_checkpoints,
    ait_optimizer_states,
    ait_params_grads,
    combined_efficiency,
    efficiency,
    iteration_flops,
    predict_efficiency,
    required_bandwidth,
)
from tiertrain.estimate.dims import ModelDims, count_module_parameters, module_parameter_sizes
from tiertrain.estimate.formulas import (
    activation_bytes_head,
    activation_bytes_per_layer,
    infinity_activation_checkpoint_bytes,
    infinity_awm_bytes,
    infinity_model_state_bytes,
    infinity_mswm_bytes,
    infinity_parameters,
    model_state_bytes,
    zero_activation_bytes,
    zero_max_parameters,
    zero_model_state_bytes,
)
from tiertrain.estimate.layout import ModelStateBytes, ZeroLayout, engine_model_state_bytes, padded_shard
from tiertrain.estimate.memory import PRECISION_BYTES, TIERS, Estimate, EstimateLine, estimate, estimate_from_args
from tiertrain.estimate.modules import HFModelDims, dims_of_hf_config, dims_of_module
from tiertrain.estimate.overhead import HostOverhead
from tiertrain.estimate.hardware import Hardware
from tiertrain.estimate.plan import Plan, PlanError, plan, plan_to_json, render_plan
from tiertrain.estimate.probe import HardwareProbe, load_probe
from tiertrain.estimate.probe import probe as probe_hardware  # the name ``probe`` stays the module
from tiertrain.estimate.report import human_bytes, render_table, to_json

__all__ = [
    "BandwidthPrediction", "TierEfficiency", "ait_activation_checkpoints", "ait_optimizer_states",
    "ait_params_grads", "combined_efficiency", "efficiency", "iteration_flops",
    "predict_efficiency", "required_bandwidth",
    "PRECISION_BYTES", "TIERS", "Estimate", "EstimateLine", "ModelDims", "ModelStateBytes",
    "ZeroLayout", "activation_bytes_head", "activation_bytes_per_layer",
    "count_module_parameters", "engine_model_state_bytes", "estimate", "estimate_from_args",
    "infinity_activation_checkpoint_bytes", "infinity_awm_bytes", "infinity_model_state_bytes",
    "infinity_mswm_bytes", "infinity_parameters", "model_state_bytes", "module_parameter_sizes",
    "padded_shard", "zero_activation_bytes", "zero_max_parameters", "zero_model_state_bytes",
    "HardwareProbe", "load_probe", "probe_hardware",
    "HostOverhead", "Hardware", "Plan", "PlanError", "plan", "plan_to_json", "render_plan",
    "human_bytes", "render_table", "to_json",
    "HFModelDims", "dims_of_hf_config", "dims_of_module",
]
