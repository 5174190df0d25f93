"""Writes the DeepSpeed checkpoints that tests/test_deepspeed_checkpoint.py loads, with real
DeepSpeed (a test-time tool, never the library's dependency):

    DS_ACCELERATOR=cpu python tests/deepspeed_checkpoints/make.py [OUT [NAME ...]]

A tiny Hugging Face Llama (tied embeddings, one frozen MLP, the decay / no-decay param groups
of transformers' Trainer) trained 3 steps by DeepSpeed on CPU ranks over gloo, clip 1.0, then
``engine.save_checkpoint(OUT/<name>, client_state={"epoch": 7})``: ZeRO stages 1, 2 and 3 in
bf16 on 2 ranks, stage 2 in fp16 (dynamic loss scale from 2^8) on 2 and in fp32 on 1, and stage
2 in bf16 on 2 with torch's SGD (momentum 0.9) as the client optimizer (SGD), and without ZeRO
(stage 0) in fp16 on 2 (read for its weights alone). Beside each, ``expected.pt``: every trained parameter's fp32
master (DeepSpeed's ``safe_get_full_fp32_param``; at stage 0, which it does not serve, DeepSpeed's
optimizer in memory) and Adam moments (its universal-checkpoint converter), the frozen
values and buffers, and the optimizer's step: what a reader of the files must find. Of the runs
in UNIVERSAL, ``OUT/<name>_universal``: DeepSpeed's universal checkpoint of it (ds_to_universal:
``latest_universal`` and ``global_step3_universal/``), read against the same expected.pt.

    DS_ACCELERATOR=cpu python tests/deepspeed_checkpoints/make.py --universal-only [OUT]

writes only the universal checkpoints, of the runs already in OUT.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from deepspeed_models import build_llama, no_decay  # noqa: E402

UNIVERSAL = ("z3_bf16_w2", "z2_fp16_w2")
"""The runs also written as universal checkpoints (stage 3's per-rank model states; fp16's loss scale)."""
RUNS = {"z1_bf16_w2": (1, "bf16", 2), "z2_bf16_w2": (2, "bf16", 2), "z3_bf16_w2": (3, "bf16", 2),
        "z2_fp32_w1": (2, "fp32", 1), "z2_fp16_w2": (2, "fp16", 2), "z2_sgd_w2": (2, "bf16", 2),
        "z0_fp16_w2": (0, "fp16", 2)}
SGD = ("z2_sgd_w2",)
"""Runs whose optimizer is torch's SGD with momentum, given to deepspeed.initialize (its state:
momentum_buffer, no step), one param group; expected.pt holds each parameter's momentum as
DeepSpeed's safe_get_full_optimizer_state gives it."""


def _run(rank: int, world: int, stage: int, dtype: str, out: str, port: int, sgd: bool = False) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    torch.manual_seed(0)
    model = build_llama()
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in trained if not no_decay(n)], "weight_decay": 0.1},
              {"params": [p for n, p in trained if no_decay(n)], "weight_decay": 0.0}]
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == "bf16"},
              "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8}},
              "steps_per_print": 10**9}
    client = None
    if sgd:
        del config["optimizer"]
        config["zero_allow_untested_optimizer"] = True
        client = torch.optim.SGD([p for _, p in trained], lr=1e-2, momentum=0.9)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=None if sgd else groups,
                                                   optimizer=client, config=config, dist_init_required=False)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    expected = {"masters": {}, "exp_avg": {}, "exp_avg_sq": {}, "frozen": {}, "buffers": {}}
    unpartitioned = _unpartitioned(engine) if stage == 0 else {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad and stage == 0:
            for key in ("masters", "exp_avg", "exp_avg_sq"):
                expected[key][name] = unpartitioned[key][p].clone()
        elif p.requires_grad:
            expected["masters"][name] = safe_get_full_fp32_param(p).clone()
        else:
            with deepspeed.zero.GatheredParameters([p]):
                expected["frozen"][name] = p.detach().clone()
    for name, b in engine.module.named_buffers():
        expected["buffers"][name] = b.detach().clone()
    expected["global_steps"] = engine.global_steps
    expected["step"] = 3  # (Adam's count: 3 updates, none skipped: no fp16 overflow here)
    if sgd:
        expected["momentum_buffer"] = {n: safe_get_full_optimizer_state(p, "momentum_buffer").clone()
                                       for n, p in engine.module.named_parameters() if p.requires_grad}
    engine.save_checkpoint(out, client_state={"epoch": 7})
    if rank == 0:
        torch.save(expected, os.path.join(out, "expected.pt"))
    dist.barrier()


def _unpartitioned(engine) -> dict:
    """Without ZeRO (stage 0), from DeepSpeed's FP16_Optimizer in memory: each trained
    parameter's piece of its param group's flat fp32 buffer (the master) and of that buffer's
    Adam moments."""
    optimizer = engine.optimizer
    out = {"masters": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for params, flat in zip(optimizer.fp16_groups, optimizer.fp32_groups_flat):
        state, at = optimizer.optimizer.state[flat], 0
        for p in params:
            for key, buffer in (("masters", flat), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])):
                out[key][p] = buffer.detach()[at:at + p.numel()].view(p.shape)
            at += p.numel()
    return out


def _free_port() -> int:
    """A port no process listens on now, for a run's master (a fixed one may be taken)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _universal(directory: str, out: str) -> None:
    """DeepSpeed's universal checkpoint of the run in directory, written to out/global_step3_universal."""
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    os.path.join(directory, "global_step3"), "--output_folder",
                    os.path.join(out, "global_step3_universal"), "--num_extract_workers", "1",
                    "--num_merge_workers", "1", "--inject_missing_state"], check=True, capture_output=True)


def _add_moments(directory: str, universal: str) -> None:
    """expected.pt gets each trained parameter's Adam moments and step whole, as DeepSpeed's
    universal-checkpoint converter (ds_to_universal) writes them (its own accessor for a
    parameter's optimizer state, safe_get_full_optimizer_state, finds none for the second
    param group's parameters at ZeRO-1/2 in this version)."""
    path = os.path.join(directory, "expected.pt")
    expected = torch.load(path, weights_only=True)
    for key in ("exp_avg", "exp_avg_sq"):
        expected[key] = {}
        for name in expected["masters"]:
            value = torch.load(os.path.join(universal, "global_step3_universal", "zero", name, f"{key}.pt"),
                               weights_only=False)
            expected[key][name] = value["param"] if isinstance(value, dict) else value
    torch.save(expected, path)


def runs_fp16() -> bool:
    """Whether the installed DeepSpeed runs fp16 here: on the CPU only where oneDNN has fp16
    kernels (an Intel CPU with AVX-512 FP16 or AMX; not the AMD EPYC machines), else its engine
    refuses ("Type fp16 is not supported on your device")."""
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def main(out: str, names: list[str], universal_only: bool = False) -> None:
    fp16 = runs_fp16()
    for name, (stage, dtype, world) in sorted(RUNS.items()):
        if names and name not in names:
            continue
        if dtype == "fp16" and not fp16:
            print(f"make.py: {name} not written: this DeepSpeed does not run fp16 on this CPU", file=sys.stderr)
            continue
        directory = os.path.join(out, name)
        if not universal_only:
            mp.spawn(_run, args=(world, stage, dtype, directory, _free_port(), name in SGD), nprocs=world)
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # (DeepSpeed's own tools: not needed)
            if os.path.exists(os.path.join(directory, script)):
                os.remove(os.path.join(directory, script))
        if name in SGD or stage == 0:  # (ds_to_universal converts Adam's state of ZeRO's files alone)
            continue
        with tempfile.TemporaryDirectory() as converted:
            universal = directory + "_universal" if name in UNIVERSAL else converted
            shutil.rmtree(os.path.join(universal, "global_step3_universal"), ignore_errors=True)
            _universal(directory, universal)
            if not universal_only:
                _add_moments(directory, universal)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    args = [a for a in sys.argv[1:] if a != "--universal-only"]
    main(args[0] if args else HERE, args[1:], universal_only="--universal-only" in sys.argv)
