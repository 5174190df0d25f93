"""Know before you launch: memory and bandwidth estimates and a hardware probe.

* :mod:`~tiertrain.estimate.memory` — the papers' memory formulas (ZeRO §5 Table 1/2,
  ZeRO-Infinity §3) and the engine's own per-rank accounting, :func:`estimate`.
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
  ``zero.offload: auto``).
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
from tiertrain.estimate.memory import (
    PRECISION_BYTES,
    TIERS,
    Estimate,
    EstimateLine,
    ModelDims,
    ModelStateBytes,
    ZeroLayout,
    activation_bytes_head,
    activation_bytes_per_layer,
    count_module_parameters,
    engine_model_state_bytes,
    estimate,
    estimate_from_args,
    infinity_activation_checkpoint_bytes,
    infinity_awm_bytes,
    infinity_model_state_bytes,
    infinity_mswm_bytes,
    infinity_parameters,
    model_state_bytes,
    module_parameter_sizes,
    zero_activation_bytes,
    padded_shard,
    zero_max_parameters,
    zero_model_state_bytes,
)
from tiertrain.estimate.modules import HFModelDims, dims_of_hf_config, dims_of_module
from tiertrain.estimate.overhead import HostOverhead
from tiertrain.estimate.plan import Hardware, Plan, PlanError, plan, plan_to_json, render_plan
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
