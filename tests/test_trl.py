"""TRL's trainers on tiertrain's engine: ``SFTTrainer``, ``DPOTrainer`` and ``GRPOTrainer``
(transformers.Trainer subclasses) keep their class by mixing TiertrainTrainer in, as Seq2SeqTrainer does
(docs/hf_trainer.md, "TRL's trainers"): ``class TiertrainSFTTrainer(TiertrainTrainer, SFTTrainer)``.

Each is run twice on the same tiny Llama, data and seed at fp32 (TRL's configs default to bf16
autocast, which the engine replaces by its compute dtype: a comparison of two arithmetics), once
by TRL's own class and once mixed in at ZeRO stage 3: the losses logged, SFT's token accuracy,
DPO's rewards (the policy through the engine, the reference model TRL's own) and GRPO's rewards
(its completions sampled by ``generate`` on the stage-3 model, from the same random stream) are
TRL's.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from test_hf_trainer import EPS, STEPS, VOCAB, _model, _samples  # noqa: E402
from tiertrain.config import Config, from_dict  # noqa: E402
from tiertrain.integrations.hf_trainer import TiertrainTrainer  # noqa: E402

pytestmark = pytest.mark.timeout(120)
STAGE3 = dict(tiertrain_config=from_dict(Config, {"zero": {"stage": 3}}))


def _tokenizer():
    """Words t0 … t126 as token ids 0 … 126, and a padding token: TRL needs a processing class."""
    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"<pad>": VOCAB - 1}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<pad>")


def _logged(trainer, *keys) -> list[tuple]:
    return [tuple(e.get(k) for k in ("loss", *keys)) for e in trainer.state.log_history if "loss" in e]


def _flat(rows: list[tuple]) -> list[float]:
    """The values of rows in one list: pytest.approx compares nested sequences by ==, not within bounds."""
    return [value for row in rows for value in row]


def _common(tmp_path, name: str) -> dict:
    return dict(output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=STEPS, learning_rate=1e-2,
                adam_epsilon=EPS, logging_steps=1, report_to="none", disable_tqdm=True, seed=0, save_strategy="no",
                use_cpu=True, bf16=False)


def test_sft_trainer_mixed_in_logs_trls_losses_and_token_accuracy(tmp_path):
    data = datasets.Dataset.from_list([{"input_ids": s["input_ids"].tolist()} for s in _samples(STEPS * 4, seed=1)])

    class TiertrainSFTTrainer(TiertrainTrainer, trl.SFTTrainer):
        pass

    def train(cls, name, **extra):
        trainer = cls(model=_model(), args=trl.SFTConfig(**_common(tmp_path, name)), train_dataset=data,
                      processing_class=_tokenizer(), **extra)
        trainer.train()
        return _logged(trainer, "mean_token_accuracy", "entropy")

    ours, theirs = train(TiertrainSFTTrainer, "tiertrain", **STAGE3), train(trl.SFTTrainer, "trl")
    assert len(ours) == STEPS and _flat(ours) == pytest.approx(_flat(theirs), rel=1e-5)


def test_dpo_trainer_mixed_in_logs_trls_losses_and_rewards(tmp_path):
    g = torch.Generator().manual_seed(0)

    def words(n: int) -> str:
        return " ".join(f"t{int(i)}" for i in torch.randint(0, VOCAB - 1, (n,), generator=g))
    data = datasets.Dataset.from_list([{"prompt": words(5), "chosen": words(4), "rejected": words(3)}
                                       for _ in range(STEPS * 4)])

    class TiertrainDPOTrainer(TiertrainTrainer, trl.DPOTrainer):
        pass

    def train(cls, name, **extra):
        trainer = cls(model=_model(), ref_model=_model(), args=trl.DPOConfig(**_common(tmp_path, name)),
                      train_dataset=data, processing_class=_tokenizer(), **extra)
        trainer.train()
        return _logged(trainer, "rewards/chosen", "rewards/rejected")

    ours, theirs = train(TiertrainDPOTrainer, "tiertrain", **STAGE3), train(trl.DPOTrainer, "trl")
    assert len(ours) == STEPS and ours[0][1] == 0.0  # (the policy is the reference before the first step)
    assert _flat(ours) == pytest.approx(_flat(theirs), rel=1e-5, abs=1e-7)


def test_grpo_trainer_mixed_in_samples_and_scores_as_trl_does(tmp_path):
    """GRPO generates its completions with the policy (at stage 3: the model called outside the
    engine under no_grad, each unit gathered for its forward) and scores them with a reward
    function: the same completions, rewards and losses as TRL's own trainer."""
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(f"t{int(i)}" for i in torch.randint(0, 100, (5,), generator=g)) for _ in range(16)]
    data = datasets.Dataset.from_list([{"prompt": p} for p in prompts])

    def mean_token(completions, **_):  # (a reward that varies within a group: a learning signal)
        ids = [[int(w[1:]) for w in c.split() if w[1:].isdigit()] for c in completions]
        return [sum(i) / (100.0 * max(len(i), 1)) for i in ids]

    class TiertrainGRPOTrainer(TiertrainTrainer, trl.GRPOTrainer):
        pass

    def train(cls, name, **extra):
        args = trl.GRPOConfig(**_common(tmp_path, name), num_generations=4, max_completion_length=6)
        trainer = cls(model=_model(), reward_funcs=mean_token, args=args, train_dataset=data,
                      processing_class=_tokenizer(), **extra)
        trainer.train()
        return _logged(trainer, "reward", "reward_std")

    ours, theirs = train(TiertrainGRPOTrainer, "tiertrain", **STAGE3), train(trl.GRPOTrainer, "trl")
    assert len(ours) == STEPS and any(loss != 0 for loss, *_ in ours)
    assert _flat(ours) == pytest.approx(_flat(theirs), rel=1e-5, abs=1e-7)
