"""Make a tiny Hugging Face model and a text corpus to try the tutorial offline.

    python docs/tiny_hf_model.py runs/tiny-llama

writes, without downloading anything:

* ``runs/tiny-llama/model/``: a 2-layer Llama as ``save_pretrained`` writes it (config.json,
  model.safetensors), with a byte-level BPE tokenizer trained here (tokenizer.json,
  tokenizer_config.json);
* ``runs/tiny-llama/corpus.jsonl``: one ``{"text": ...}`` line per paragraph of the corpus
  bundled with tiertrain.

Any directory that ``save_pretrained`` wrote (a model you downloaded from the Hub, say) takes
the place of ``model/`` in the tutorial (docs/tutorial.md). Needs ``pip install -e ".[hf]"``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory to write model/ and corpus.jsonl into")
    parser.add_argument("--vocab", type=int, default=512, help="tokenizer vocabulary size (default 512)")
    args = parser.parse_args()
    out = Path(args.out)

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from tiertrain.data import load_bundled_corpus

    lines = [line for line in load_bundled_corpus()[:200_000].splitlines() if line.strip()]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=args.vocab,
                                                       special_tokens=["<unk>", "<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>")

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model_dir = out / "model"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    corpus = out / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    print(f"wrote {model_dir}/ (a {sum(1 for _ in model_dir.iterdir())}-file Llama directory) and {corpus} "
          f"({len(lines)} lines)")


if __name__ == "__main__":
    main()
