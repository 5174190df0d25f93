"""Host memory of a pipeline rank from build to its first step: the whole model built on every
rank against the model built on the meta device, each rank giving values only to its own stages
(tiertrain/pipeline/materialize.py), the checkpoint read after wrap() (load_pretrained of a
PipelineEngine).

Two gloo ranks (pp = 2, ZeRO stage 1, fp32) train a Hugging Face Llama from a safetensors
checkpoint saved once in a temporary directory:

* whole: ``from_config`` on every rank, ``load_pretrained(model, path)``, ``wrap()`` (what a
  pipeline needed before);
* meta: ``from_config`` under ``torch.device("meta")``, ``wrap()``, ``load_pretrained(engine,
  path)``.

Each mode runs in fresh processes. Per rank: the resident memory before the model is built
(VmRSS: the interpreter, torch, transformers), the peak (VmHWM) less it by the time the weights
are loaded and by the end of the first training step, and the seconds from build to loaded.
Both modes' first-step losses are printed: equal, the same weights trained.

    python bench/pipeline_build_memory.py --out bench/results/pipeline_build_memory.md
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from _common import machine_lines, print_and_write  # noqa: E402
from tiertrain.estimate.measure import status_bytes  # noqa: E402

MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False)
SEQ, MICRO, ACCUM = 64, 1, 2


def _rank(rank: int, world: int, mode: str, directory: str) -> dict:
    import torch
    import transformers

    import tiertrain

    config = tiertrain.Config()
    config.parallel.pp, config.zero.stage, config.precision.dtype = 2, 1, "fp32"
    config.batch.micro_batch_size, config.batch.grad_accum_steps = MICRO, ACCUM
    config.validate()
    topology = tiertrain.Topology.build(config.parallel)
    before = status_bytes("VmRSS")
    start = time.perf_counter()
    hf_config = transformers.LlamaConfig(**MODEL)
    if mode == "whole":
        model = transformers.LlamaForCausalLM(hf_config)
        tiertrain.load_pretrained(model, directory)
        engine = tiertrain.wrap(model, config, topology)
    else:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(hf_config)
        engine = tiertrain.wrap(model, config, topology)
        tiertrain.load_pretrained(engine, directory)
    seconds = time.perf_counter() - start
    loaded = status_bytes("VmHWM") - before
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODEL["vocab_size"], (MICRO, SEQ), generator=g)
    loss = engine.train_batch([{"input_ids": ids, "labels": ids}] * ACCUM)
    params = sum(p.numel() for p in model.parameters() if not p.is_meta)
    return {"rank": rank, "before": before, "loaded": loaded, "peak": status_bytes("VmHWM") - before,
            "seconds": seconds, "loss": loss, "built_params": params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    import torch
    import transformers

    from tiertrain.testing import run_distributed

    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        whole = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL))
        total = sum(p.numel() for p in whole.parameters())
        whole.save_pretrained(directory)
        del whole
        for mode in ("whole", "meta"):
            rows.append((mode, run_distributed(_rank, 2, mode, directory, timeout=900)))
    mib = 2 ** 20
    lines = ["# Host memory of a pipeline rank: the whole model on every rank, or only its stages", "",
             *machine_lines(), "",
             f"Command: `python bench/pipeline_build_memory.py --out {a.out or '...'}` ({time.strftime('%Y-%m-%d')}).",
             "", f"Llama {MODEL['num_hidden_layers']} × {MODEL['hidden_size']} (vocabulary {MODEL['vocab_size']}, "
             f"untied head): {total / 1e6:.1f} M parameters, {total * 4 / mib:.0f} MiB in fp32. Two gloo ranks, "
             f"pp = 2, ZeRO stage 1, fp32, {ACCUM} micro-batches of {MICRO} × {SEQ} tokens. Peak: VmHWM (by the "
             f"time the weights are loaded; by the end of the first step) less VmRSS before the model is built.", "",
             "| mode | rank | parameters built (M) | peak by loaded (MiB) | peak by first step (MiB) "
             "| build + load (s) "
             "| first loss |",
             "|---|---|---|---|---|---|---|"]
    for mode, ranks in rows:
        for r in ranks:
            lines.append(f"| {mode} | {r['rank']} | {r['built_params'] / 1e6:.1f} | {r['loaded'] / mib:.0f} | "
                         f"{r['peak'] / mib:.0f} | "
                         f"{r['seconds']:.1f} | {r['loss']:.6f} |")
    ratio = {key: max(r[key] for r in dict(rows)["meta"]) / max(r[key] for r in dict(rows)["whole"])
             for key in ("loaded", "peak")}
    lines += ["", f"Largest rank's peak, meta / whole: {ratio['loaded']:.2f} by the time the weights are loaded, "
                  f"{ratio['peak']:.2f} by the end of the first step (the optimizer's state, the same in both, "
                  f"is made at the first step)."]
    print_and_write("\n".join(lines) + "\n", a.out)


if __name__ == "__main__":
    main()
