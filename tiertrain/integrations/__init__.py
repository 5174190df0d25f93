"""Integrations of tiertrain's engine with other training front ends.

* :mod:`tiertrain.integrations.hf_trainer`: ``TiertrainTrainer``, a ``transformers.Trainer``
  that trains on the engine (ZeRO stages 1-3, CPU/NVMe offload); docs/hf_trainer.md.

Nothing here is imported by ``import tiertrain``: transformers and accelerate are needed only
by the integration that uses them.
"""
