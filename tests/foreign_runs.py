"""What the tests of runs moved from another framework share (tests/test_deepspeed_checkpoint.py,
tests/test_dcp_checkpoint.py): their batches, the engine configurations they move to, and plain
PyTorch continuing the saved run (the reference)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tiertrain.optim import build_adamw, lr_factor, param_groups

from reference import make_config, rank_slices, reference_train


def batches(n: int, global_batch: int = 4, seed: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, (global_batch, 8), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def engine_config(stage: int, tier: str, dp: int, directory: str):
    return make_config(zero={"stage": stage, "offload_optimizer": tier, "nvme_path": os.path.join(directory, "swap"),
                             "bucket_mb": 0.01},
                       precision={"dtype": "fp32"}, parallel={"dp": dp},
                       batch={"micro_batch_size": 4 // dp, "grad_accum_steps": 1},
                       optimizer={"lr": 1e-4, "grad_clip": 1.0, "weight_decay": 0.1},
                       schedule={"warmup_steps": 2, "decay_steps": 8})


def continued(model, config, batches, saved: dict | None, steps: int):
    """Plain PyTorch continuing a saved run from step ``steps``: the model holding its values,
    AdamW holding its moments and step (saved: {"step", "exp_avg": {name: ...}, "exp_avg_sq"};
    None: a fresh AdamW), the schedule at that step."""
    def optimizer(m):
        opt = build_adamw(param_groups(m.named_parameters(), config.optimizer), config.optimizer)
        if saved is not None:
            for name, p in m.named_parameters():
                if p.requires_grad:
                    opt.state[p] = {"step": torch.tensor(float(saved["step"])),
                                    **{k: saved[k][name].reshape(p.shape).to(p.dtype, copy=True)
                                       for k in ("exp_avg", "exp_avg_sq")}}  # (copies: the saved ones stay)
        return opt

    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s + steps, config.schedule))

    return reference_train(model, config, batches, build_optimizer=optimizer, lr_scheduler=schedule)


def train_on(engine, rank: int, world: int, batches) -> tuple[list[float], dict]:
    """Train the loaded engine on the batches (this rank's rows of each) and close it; (each
    step's loss averaged over the ranks, every parameter's value in fp32)."""
    losses = []
    for batch in batches:
        loss = torch.tensor([engine.train_batch(rank_slices(batch, rank, world, 4 // world, 1))], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(loss)
        losses.append(float(loss) / world)
    params = {n: v.float() for n, v in engine.full_state_dict().items()}
    engine.close()
    return losses, params


def trainer_resumed(checkpoint: str, out: str, steps: int, saved_steps: int):
    """TiertrainTrainer (the tiny Llama, other initial values) trained to ``steps`` from a
    checkpoint-N that transformers' Trainer saved at ``saved_steps`` (its trainer_state.json
    written here beside the framework's files); returns the trainer."""
    import transformers

    from deepspeed_models import build_llama
    from tiertrain.integrations.hf_trainer import TiertrainTrainer

    transformers.TrainerState(global_step=saved_steps, max_steps=saved_steps, train_batch_size=4).save_to_json(
        os.path.join(checkpoint, "trainer_state.json"))
    samples = [{"input_ids": b["input_ids"][i], "labels": b["labels"][i]} for b in batches(3) for i in range(4)]
    args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=steps,
                                          learning_rate=1e-4, report_to="none", save_strategy="no", disable_tqdm=True)
    trainer = TiertrainTrainer(model=build_llama(seed=11), args=args, train_dataset=samples)
    trainer.train(resume_from_checkpoint=checkpoint)
    return trainer
