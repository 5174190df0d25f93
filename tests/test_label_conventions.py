"""Next-token labels in the other family's convention fail by name; labels in the right one
never do.

tiertrain's GPT takes labels shifted already; a Hugging Face causal LM takes labels =
input_ids and shifts them itself. Mixed up, both trained without a word toward the wrong
objective (copy the input token; predict the token after next).
"""
from __future__ import annotations

import pytest
import torch
import transformers

import tiertrain
from reference import global_batches, make_config, make_model
from tiertrain.label_conventions import IGNORE_INDEX, LabelConventionError, check_batch_labels, check_gpt_labels

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]


def _llama():
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _wrap(model):
    cfg = make_config(zero={"stage": 2}, batch={"micro_batch_size": 2})
    return tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))


def test_hugging_face_labels_given_to_tiertrains_gpt_are_refused():
    batch = global_batches(1, 2)[0]  # input_ids = tokens[:-1], labels = tokens[1:]
    engine = _wrap(make_model())
    engine(batch)  # the right convention
    padded = batch["input_ids"].clone()
    labels = padded.clone()
    labels[:, -3:] = IGNORE_INDEX  # (a collator's padding)
    with pytest.raises(LabelConventionError, match=r"labels equal input_ids .* tiertrain's GPT takes its labels "
                                                   r"shifted already"):
        engine({"input_ids": padded, "labels": labels})
    engine.close()


def test_labels_shifted_already_given_to_a_hugging_face_causal_lm_are_refused():
    tokens = global_batches(1, 2)[0]
    ids = torch.cat([tokens["input_ids"], tokens["labels"][:, -1:]], dim=1)
    engine = _wrap(_llama())
    engine({"input_ids": ids, "labels": ids})  # the right convention: the model shifts
    with pytest.raises(LabelConventionError, match=r"LlamaForCausalLM shifts its labels itself: it would learn to "
                                                   r"predict the token after next"):
        engine({"input_ids": tokens["input_ids"], "labels": tokens["labels"]})
    engine.close()


def test_a_loss_of_the_users_own_reads_the_labels_its_way_unchecked():
    """A loss function of the user's own (as tiertrain's own Hugging Face runs have, passing
    labels shifted already as transformers' shift_labels) decides what labels mean: nothing
    to refuse there."""
    tokens = global_batches(1, 2)[0]
    model = _llama()
    cfg = make_config(zero={"stage": 2}, batch={"micro_batch_size": 2})
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel),
                            loss_fn=lambda m, b: torch.nn.functional.cross_entropy(
                                m(input_ids=b["input_ids"]).logits.flatten(0, 1), b["labels"].flatten()))
    engine.backward(engine(tokens))
    engine.close()


def test_a_peft_model_of_a_causal_lm_is_checked_as_the_model_it_wraps():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    tokens = global_batches(1, 2)[0]
    with pytest.raises(LabelConventionError, match="LlamaForCausalLM shifts its labels itself"):
        check_batch_labels(model, {"input_ids": tokens["input_ids"], "labels": tokens["labels"]})
    check_batch_labels(model, {"input_ids": tokens["input_ids"], "labels": tokens["input_ids"]})


def test_labels_in_the_right_convention_are_never_refused():
    """Random sequences over a vocabulary of 2 (many repeats), with random -100 masks: labels
    of the right convention pass, every time; a sequence of one repeated token (both
    conventions at once) passes too."""
    g = torch.Generator().manual_seed(0)
    llama = _llama()
    refused = 0
    for _ in range(300):
        tokens = torch.randint(0, 2, (2, 9), generator=g)
        mask = torch.rand(2, 8, generator=g) < 0.3
        gpt_labels = tokens[:, 1:].masked_fill(mask, IGNORE_INDEX)
        check_gpt_labels(tokens[:, :-1], gpt_labels)
        check_batch_labels(llama, {"input_ids": tokens, "labels": tokens.masked_fill(
            torch.rand(2, 9, generator=g) < 0.3, IGNORE_INDEX)})
        try:  # the wrong conventions, for the count below
            check_gpt_labels(tokens[:, :-1], tokens[:, :-1].masked_fill(mask, IGNORE_INDEX))
        except LabelConventionError:
            refused += 1
    assert refused > 250, f"only {refused} of 300 mixed-up batches refused"  # (the rest: one repeated token where labelled)
    constant = torch.full((2, 8), 7)
    check_gpt_labels(constant, constant)
    check_batch_labels(llama, {"input_ids": constant, "labels": constant})
    check_batch_labels(llama, {"input_ids": constant, "labels": torch.full((2, 8), IGNORE_INDEX)})
