"""Bit-identity across a refactoring: run 16 engine configurations (every ZeRO stage, CPU and
NVMe tiers, the overlapped and synchronous NVMe steps, the delayed update, fp16, bf16, pp=2 at
stages 1 and 3 (1F1B, the stage-3 one on the CPU tier), tp=2, the overlapped parameter
gather) for 4 steps, and every Hugging Face model of the zoo (tests/zoo.py: decoder, encoder,
encoder-decoder, MoE, adapters) at stage 3 on the device and with parameters and optimizer on
NVMe for 3 steps, on 2 ranks from the tiertrain tree TREE, and
save every loss and final parameter; then compare two such files bit for bit.

    git worktree add /tmp/base <commit>
    python tests/bit_identity.py run /tmp/base /tmp/base.pt
    python tests/bit_identity.py run . /tmp/new.pt
    python tests/bit_identity.py compare /tmp/base.pt /tmp/new.pt
"""
import os
import sys
import tempfile

if len(sys.argv) != 4 or sys.argv[1] not in ("run", "compare"):
    sys.exit(__doc__)
mode, first, second = sys.argv[1:]
if mode == "run":
    first, second = os.path.abspath(first), os.path.abspath(second)
    sys.path.insert(0, first)
    sys.path.insert(0, os.path.join(first, "tests"))
    # The ranks start from a forkserver, which imports tiertrain before it forks them and does
    # not read this sys.path (only the environment): without this, an editable install's tree
    # is the one run, whatever TREE says. Its sys.path starts with the working directory, so
    # that is TREE too (run from another checkout, the ranks imported that checkout's tiertrain).
    os.environ["PYTHONPATH"] = os.pathsep.join([first, os.path.join(first, "tests")] +
                                               [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    os.chdir(first)
import torch

if mode == "run":
    import zoo
    from reference import engine_train, global_batches, make_config, make_model
    from tiertrain.parallel import apply_tensor_parallel
    from tiertrain.testing import run_distributed

CASES = {
  "s0": dict(zero={"stage": 0}), "s1": dict(zero={"stage": 1}), "s2clip": dict(zero={"stage": 2}, optimizer={"grad_clip": 0.05}),
  "s3": dict(zero={"stage": 3}), "s2cpu": dict(zero={"stage": 2, "offload_optimizer": "cpu"}),
  "s3cpu": dict(zero={"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}),
  "nvme2": dict(zero={"stage": 2, "offload_optimizer": "nvme"}),
  "nvme3": dict(zero={"stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme"}),
  "nvme3clip": dict(zero={"stage": 3, "offload_optimizer": "nvme"}, optimizer={"grad_clip": 0.05}),
  "delayed": dict(zero={"stage": 2, "offload_optimizer": "cpu", "delayed_update": True, "delayed_update_warmup": 1}),
  "fp16": dict(zero={"stage": 2}, precision={"dtype": "fp16"}), "bf16": dict(zero={"stage": 3}, precision={"dtype": "bf16"}),
  "pp2": dict(zero={"stage": 1}, parallel={"pp": 2}, batch={"grad_accum_steps": 2}),
  "tp2": dict(zero={"stage": 2}, parallel={"tp": 2}),
  "gather": dict(zero={"stage": 2, "overlap_param_gather": True}),
  "pp2s3cpu": dict(zero={"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
                   parallel={"pp": 2, "schedule": "1f1b"}, batch={"grad_accum_steps": 2}),
}
ONE_REPLICA = ("tp2", "pp2", "pp2s3cpu")
"""The configurations whose 2 ranks are one data-parallel replica (dp=1)."""

ZOO_CASES = {"zoo s3": {"stage": 3},
             "zoo nvme3": {"stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme"}}
"""The zoo's configurations (2 ranks, micro-batch 2, 3 steps, eps 1e-3, as tests/test_zoo.py)."""


def run_zoo(rank, world, tmp):
    res = {}
    for model_name in zoo.MODELS:
        for case, zero in ZOO_CASES.items():
            n = f"{case} {model_name}"
            zero = dict(zero, nvme_path=os.path.join(tmp, n.replace(" ", "_"))) if "nvme" in case else zero
            cfg = make_config(zero=zero, batch={"micro_batch_size": 2}, optimizer={"eps": 1e-3})
            losses, params, eng = engine_train(rank, world, zoo.build(model_name), cfg,
                                               zoo.batches(model_name, 3, 2 * world))
            eng.close()
            res[n] = (losses, params)
    return res


def run(rank, world, names, tmp):
    import tiertrain
    tree = os.path.realpath(first)
    assert os.path.realpath(tiertrain.__file__).startswith(tree + os.sep), (
        f"the ranks run {tiertrain.__file__}, not the tree {tree}")
    res = run_zoo(rank, world, tmp)
    for n in names:
        sec = {k: dict(v) for k, v in CASES[n].items()}
        if "nvme" in n:
            sec["zero"]["nvme_path"] = os.path.join(tmp, n)
        sec.setdefault("batch", {}); sec["batch"].setdefault("micro_batch_size", 2)
        sec.setdefault("optimizer", {}); sec["optimizer"].setdefault("eps", 1e-3)
        cfg = make_config(**sec)
        dp = 2 if n not in ONE_REPLICA else 1
        prep = (lambda m, t: apply_tensor_parallel(m, t)) if n == "tp2" else None
        losses, params, eng = engine_train(rank, world, make_model(n_layers=4), cfg, global_batches(4, 2 * dp * cfg.batch.grad_accum_steps), prep)
        eng.close()
        res[n] = (losses, params)
    return res

def compare(a_path, b_path) -> int:
    a, b = torch.load(a_path, weights_only=False), torch.load(b_path, weights_only=False)
    missing = sorted({name for rank in range(len(a)) for name in a[rank].keys() ^ b[rank].keys()})
    if missing:
        print(f"runs in one file only (compared without them): {missing}")
    differ = [(rank, name) for rank in range(len(a)) for name in a[rank] if name in b[rank] and (
               a[rank][name][0] != b[rank][name][0]
              or any(not torch.equal(a[rank][name][1][k], b[rank][name][1][k]) for k in a[rank][name][1]))]
    both = sum(len(a[rank].keys() & b[rank].keys()) for rank in range(len(a)))
    print(f"{both - len(differ)} of {both} runs bit-identical; differ: {differ}")
    return 1 if differ else 0


if __name__ == "__main__":
    if mode == "compare":
        sys.exit(compare(first, second))
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(run_distributed(run, 2, list(CASES), tmp, timeout=900), second)
