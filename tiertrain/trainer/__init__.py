"""One training loop for any model (:class:`Trainer`), its config (:class:`LoopConfig`,
:class:`EvalConfig`), and what it is built from: data streams (batches.py), model FLOPs
and the peak (flops.py), ``zero.offload: auto`` for any model (auto.py)."""

from tiertrain.trainer.auto import apply_plan, plan_for, predicted_tier_bytes, resolve_auto_offload
from tiertrain.trainer.batches import batch_stream, count_tokens, eval_batches
from tiertrain.trainer.config import EvalConfig, LoopConfig
from tiertrain.trainer.flops import flops_per_token, peak_flops_per_rank
from tiertrain.trainer.loop import Trainer, format_summary, model_fingerprint

__all__ = ["Trainer", "LoopConfig", "EvalConfig", "apply_plan", "plan_for", "predicted_tier_bytes",
           "resolve_auto_offload", "batch_stream", "count_tokens", "eval_batches", "flops_per_token",
           "peak_flops_per_rank", "format_summary", "model_fingerprint"]
