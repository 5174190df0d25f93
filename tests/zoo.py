"""Small Hugging Face models built from configs (no download) for tests/test_zoo.py: one of each
structure a wrapper can get wrong. Every builder seeds torch, so two calls build the same
weights; dropout is off everywhere (the reference and the engine must compute one function)."""
from __future__ import annotations

import torch

from adapters import lora_llama
from reference import global_batches

VOCAB, HIDDEN, SEQ = 256, 32, 16


def _transformers():
    import transformers

    return transformers


def llama_gqa():
    """Decoder-only with grouped-query attention: 4 query heads share 2 key/value heads."""
    T = _transformers()
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False))


def gpt2_tied():
    """Decoder-only whose output head is the token embedding (one parameter, two uses)."""
    T = _transformers()
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def bert_mlm():
    """Encoder-only masked LM (its decoder tied to the word embedding). The attention's key
    bias is frozen: its gradient is exactly zero (a bias on every key adds one constant to all of
    a query's scores, which softmax ignores), so it stays 0 in exact arithmetic, but in fp32 Adam
    turns the gradient's rounding residue (~1e-9) into steps of ~1e-8 that no two summation orders
    agree on, and a distance relative to a value of 0 is unbounded (the oracle measured 6e8).
    Frozen, it is exactly 0 in every run and the trajectory of everything else is unchanged."""
    T = _transformers()
    model = T.BertForMaskedLM(T.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    for layer in model.bert.encoder.layer:
        layer.attention.self.key.bias.requires_grad_(False)
    return model


def t5():
    """Encoder-decoder: one embedding shared by both stacks and the head; each stack's
    relative-position bias is a parameter of its block 0, computed there and passed on to every
    later block (its gradient completes only after the last of them); blocks nest
    block[i].layer[j]."""
    T = _transformers()
    return T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=8,
        relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))


def mixtral():
    """Sparse mixture of experts: a top-2 router over 4 experts per layer (the experts' weights
    are stacked 3-D parameters), no auxiliary loss, no router jitter. The experts run as a loop
    of matmuls ("eager"): torch's grouped matmul, transformers' default, has no float64 kernel
    for the oracle's reference."""
    T = _transformers()
    return T.MixtralForCausalLM(T.MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
        router_jitter_noise=0.0, output_router_logits=False, tie_word_embeddings=False,
        experts_implementation="eager"))


def qwen2_moe():
    """Mixture of experts with a shared expert beside the routed ones (Qwen2-MoE; its
    checkpoints, like Mixtral's, hold one tensor per expert where the model stacks them)."""
    T = _transformers()
    return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32, num_experts=4, num_experts_per_tok=2, output_router_logits=False,
        tie_word_embeddings=False, experts_implementation="eager"))


def switch():
    """Nested module lists: a T5-style encoder-decoder (block[i].layer[j]) whose sparse layers
    hold a dict of expert modules (block[i].layer[j].mlp.experts.expert_k), top-1 routed, with
    capacity for every token (no token is dropped, so micro-batching does not change routing).
    Unlike Mixtral's stacked experts, an expert module that no token of a micro-batch reaches
    receives no gradient in that backward. (Its router computes in float32, router_dtype, in the
    float64 reference too: the oracle is fp32-exact there, which only widens the measured noise.)"""
    T = _transformers()
    return T.SwitchTransformersForConditionalGeneration(T.SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=HIDDEN, d_ff=64, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2,
        num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_experts=4, expert_capacity=2 * SEQ,
        relative_attention_num_buckets=8, dropout_rate=0.0, router_jitter_noise=0.0,
        decoder_start_token_id=0, pad_token_id=0))


def lora():
    """A frozen Llama backbone with trainable low-rank adapters on q_proj and v_proj."""
    return lora_llama(layers=2)


def mistral_window():
    """Decoder-only with sliding-window attention narrower than the sequence (4 < 16)."""
    T = _transformers()
    return T.MistralForCausalLM(T.MistralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, sliding_window=4, tie_word_embeddings=False))


def bart():
    """Encoder-decoder with learned positions: a persistent buffer (final_logits_bias) and one
    embedding shared by both stacks (for the export tests; not in the zoo's MODELS)."""
    T = _transformers()
    return T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2))


# name -> (builder, whether the model predicts its inputs: causal LMs take labels=input_ids and
# shift them themselves; seq2seq and masked-LM heads take labels of their own)
MODELS = {
    "llama-gqa": (llama_gqa, True),
    "gpt2-tied": (gpt2_tied, True),
    "bert-mlm": (bert_mlm, False),
    "t5": (t5, False),
    "mixtral-moe": (mixtral, True),
    "switch-nested-experts": (switch, False),
    "llama-lora-frozen": (lora, True),
    "mistral-sliding-window": (mistral_window, True),
}


def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                   **kwargs):
    """transformers' ForCausalLMLoss without its cast of the logits to float32: the same
    operations in the same order (the cast is a no-op on fp32 logits, so the fp32 reference and
    the engine compute exactly what transformers computes), but in the float64 reference the cast
    would round the logits, and the loss and its gradient, to fp32."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = torch.nn.functional.cross_entropy(logits.view(-1, vocab_size), shift_labels.view(-1).to(logits.device),
                                             ignore_index=ignore_index, reduction=reduction)
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


def build(name: str):
    torch.manual_seed(0)
    builder, causal = MODELS[name]
    model = builder()
    if causal:
        model.loss_function = causal_lm_loss
    model.train()
    return model


def batches(name: str, steps: int, global_batch: int):
    """The global batches for model `name`."""
    causal = MODELS[name][1]
    return [{"input_ids": b["input_ids"], "labels": b["input_ids"] if causal else b["labels"]}
            for b in global_batches(steps, global_batch, seq_len=SEQ)]
