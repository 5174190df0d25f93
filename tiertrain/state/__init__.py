"""Reading and writing model and optimizer state: checkpoints, resharding, export, pretrained loading.

Sharded checkpoint files and their commit protocol (checkpoint.py, files.py, directory.py,
plain.py), resharding a checkpoint to another layout (reshard.py, with the shard layouts
of shard_layout.py and the saved run's values of saved_run.py), live and offline export to
Hugging Face safetensors with its naming and conversions (export.py, export_plan.py,
export_files.py, export_groups.py, hf_conversion.py, peft_export.py, consolidate.py), loading
pretrained weights into an engine's shards (pretrained.py), another framework's checkpoint read
into an engine (DeepSpeed's: deepspeed_files.py, deepspeed_checkpoint.py; torch.distributed.
checkpoint's: dcp_files.py, dcp_checkpoint.py; transformers' Trainer's own: trainer_checkpoint.py;
what all check: foreign.py), and the engine's checkpoint and export operations (engine_io.py,
which tiertrain.wrap() hands the engine). The package sits above the engine: it works through the
engine's parts (its stateful parts, flat layout, update form and collectives) and never
through the trainer; the engine never imports it. Nothing is imported here, so importing one
module (tiertrain.state.checkpoint) loads only what it needs.
"""
