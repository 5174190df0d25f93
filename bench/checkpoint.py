#!/usr/bin/env python
"""Checkpoint save and load: tiertrain's sharded checkpoints vs FSDP2 with
``torch.distributed.checkpoint`` (DCP), same model, same ranks, same disk (issue 16).

Rows, each in a fresh set of ``--world`` gloo processes, alternating over ``--rounds``:

* ``dcp``  FSDP2 (``fully_shard`` per block, then the root), torch AdamW;
  ``get_state_dict`` (model + optimizer, sharded DTensors) saved with ``dcp.save`` /
  ``dcp.async_save`` (its thread checkpointer, the default, with a gloo group of its own as
  torch's docs advise; tiertrain's background save does the same) to a ``FileSystemWriter``
  directory, loaded with ``dcp.load`` + ``set_state_dict``.
* ``tiertrain``  ZeRO stage 3 over the same ranks, AdamW; ``engine.save_checkpoint`` (one
  ``torch.save`` file per rank, fsynced, sha256 in ``COMMITTED.json``), with
  ``background=True`` for the async row; ``engine.load_checkpoint`` (checksum verified,
  ``torch.load(weights_only=True)``).

After one training step (so Adam's moments exist), per rank:

* ``save``: wall time of a synchronous save (until committed on every rank).
* ``async stall``: what an asynchronous save costs the training loop: the time the save call
  blocks, plus how much longer the next training step takes while the write goes on than a
  step without one (``stall = call + (step during write - step)``); ``async total``: call to
  committed.
* ``load``: wall time to restore the synchronous checkpoint into the live model/engine.
* ``bytes``: the files this rank wrote (DCP: its ``__R_0.distcp``; rank 0 also writes the
  ``.metadata``; tiertrain: its ``rank0000R.pt``; rank 0 the ``COMMITTED.json`` and the export
  files).

The files are written to ``--dir`` (default: a temporary directory on the disk that holds
the repository) and read back from the page cache, the same way for both. Both fsync
(DCP's ``FileSystemWriter(sync_files=True)`` default, tiertrain's atomic write).

Usage:
    python bench/checkpoint.py --hidden 768 --layers 12 --world 2 --rounds 3 \\
        --out bench/results/checkpoint.md
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time

from _common import free_port, init_gloo, loadavg, machine_lines, spawn_ranks


def _model(args):
    import torch

    from tiertrain.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layers=args.layers, hidden=args.hidden,
                         n_heads=args.heads))


def _batch(args, rank):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, args.vocab, (args.micro, args.seq + 1), generator=g)
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def _dir_bytes(paths: list[str]) -> int:
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))


def _timed(fn, barrier) -> tuple[float, object]:
    barrier()
    t = time.perf_counter()
    out = fn()
    barrier()
    return time.perf_counter() - t, out


def _dcp_worker(rank, args, port, root, result):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    init_gloo(rank, args.world, port, threads=args.threads, timeout_s=1800)
    model = _model(args)
    mesh = init_device_mesh("cpu", (args.world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    batch = _batch(args, rank)

    def step():
        loss = model(batch["input_ids"], batch["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def state():
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optim_state}

    # (as torch's docs advise: the background collectives on a group of their own, else they
    # interleave with the training step's on the default group)
    async_group = dist.new_group(backend="gloo")
    sync_dir, async_dir = os.path.join(root, "dcp_sync"), os.path.join(root, "dcp_async")

    def load():
        target = state()
        dcp.load(target, checkpoint_id=sync_dir)
        set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"])

    def files():
        found = [os.path.join(sync_dir, f) for f in os.listdir(sync_dir) if f.startswith(f"__{rank}_")]
        return found + ([os.path.join(sync_dir, ".metadata")] if rank == 0 else [])

    out = _measure(rank, step, save=lambda: dcp.save(state(), checkpoint_id=sync_dir),
                   save_async=lambda: dcp.async_save(state(), checkpoint_id=async_dir,
                                                     process_group=async_group).result,
                   load=load, files=files)
    _gather(out, result)
    dist.destroy_process_group()


def _measure(rank, step, save, save_async, load, files) -> dict:
    """The measurements of the module docstring, the same way for every row. save_async()
    starts a background save and returns the function that waits for it to be committed."""
    import torch.distributed as dist

    barrier = dist.barrier
    step()
    step_s = [_timed(step, barrier)[0] for _ in range(2)]
    save_s, _ = _timed(save, barrier)
    barrier()
    t0 = time.perf_counter()
    wait = save_async()
    call_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    step()
    during_s = time.perf_counter() - t1
    wait()
    total_s = time.perf_counter() - t0
    barrier()
    load_s, _ = _timed(load, barrier)
    return {"rank": rank, "step_s": min(step_s), "save_s": save_s, "call_s": call_s, "during_s": during_s,
            "total_s": total_s, "load_s": load_s, "bytes": _dir_bytes(files())}


def _tiertrain_worker(rank, args, port, root, result):
    import torch.distributed as dist

    import tiertrain

    init_gloo(rank, args.world, port, threads=args.threads, timeout_s=1800)
    cfg = tiertrain.Config()
    cfg.zero.stage = 3
    cfg.parallel.dp = args.world
    cfg.optimizer.lr = 1e-4
    cfg.optimizer.weight_decay = 0.1
    cfg.optimizer.grad_clip = 0.0
    cfg.batch.micro_batch_size = args.micro
    cfg.validate()
    engine = tiertrain.wrap(_model(args), cfg, tiertrain.Topology.build(cfg.parallel))
    batch = _batch(args, rank)

    def step():
        engine.train_batch(iter([batch]))

    sync_dir, async_dir = os.path.join(root, "tt_sync"), os.path.join(root, "tt_async")

    def save_async():
        engine.save_checkpoint(async_dir, background=True)
        return engine.wait_for_checkpoint

    def files():
        step_dir = os.path.join(sync_dir, sorted(os.listdir(sync_dir))[-1])
        found = [os.path.join(step_dir, f"rank{rank:05d}.pt")]
        return found + ([os.path.join(step_dir, f) for f in os.listdir(step_dir) if not f.startswith("rank")]
                        if rank == 0 else [])

    out = _measure(rank, step, save=lambda: engine.save_checkpoint(sync_dir), save_async=save_async,
                   load=lambda: engine.load_checkpoint(sync_dir), files=files)
    _gather(out, result)
    engine.close()
    dist.destroy_process_group()


def _gather(out: dict, result: str) -> None:
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, out)
    if dist.get_rank() == 0:
        with open(result, "w") as f:
            json.dump(every, f)


WORKERS = {"dcp": _dcp_worker, "tiertrain": _tiertrain_worker}


def _row(ranks: list[dict]) -> dict:
    """Per-rank measurements reduced to the job's: the slowest rank's times (a collective
    save ends when its last rank does), each rank's bytes."""
    worst = {k: max(r[k] for r in ranks) for k in ("step_s", "save_s", "call_s", "during_s", "total_s", "load_s")}
    worst["stall_s"] = max(r["call_s"] + max(0.0, r["during_s"] - r["step_s"]) for r in ranks)
    worst["bytes"] = [r["bytes"] for r in ranks]
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir under bench/)")
    p.add_argument("--out", default=None, help="write a markdown report here")
    args = p.parse_args()
    base = args.dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), ".checkpoint_bench")
    os.makedirs(base, exist_ok=True)
    rows: dict[str, list[dict]] = {name: [] for name in WORKERS}
    for r in range(args.rounds):
        for name, worker in (WORKERS.items() if r % 2 == 0 else reversed(list(WORKERS.items()))):
            root = tempfile.mkdtemp(prefix=f"{name}_", dir=base)
            result = os.path.join(root, "result.json")
            try:
                spawn_ranks(worker, (args, free_port(), root, result), args.world, 1800, name)
                with open(result) as f:
                    rows[name].append(_row(json.load(f)))
            finally:
                shutil.rmtree(root, ignore_errors=True)
            print(name, json.dumps(rows[name][-1]), flush=True)
    shutil.rmtree(base, ignore_errors=True) if not args.dir else None
    report = _report(args, rows)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _report(args, rows: dict[str, list[dict]]) -> str:
    import torch

    from tiertrain.models.gpt import GPT, GPTConfig

    n_params = sum(p.numel() for p in GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layers=args.layers,
                                                    hidden=args.hidden, n_heads=args.heads)).parameters())
    lines = [f"# Checkpoint save/load: tiertrain vs FSDP2 + torch.distributed.checkpoint", "",
             f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
             f"(load average before: {loadavg()}).", "",
             "```", *machine_lines(dirs=[args.dir or os.path.dirname(os.path.abspath(__file__))]), "```", "",
             f"Command: `python bench/checkpoint.py {' '.join(shlex.quote(a) for a in sys.argv[1:])}`", "",
             f"Model: tiertrain GPT, {n_params / 1e6:.1f} M parameters (hidden {args.hidden}, {args.layers} layers, "
             f"vocab {args.vocab}), fp32, AdamW; {args.world} gloo ranks, {args.threads} torch thread(s) each. "
             f"Median of {args.rounds} fresh launches per row; each time is the slowest rank's. torch "
             f"{torch.__version__}.", "",
             "| row | step s | save s | async call s | step during async write s | async stall s | async total s "
             "| load s | bytes per rank (MB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, rs in rows.items():
        if not rs:
            continue
        mb = " / ".join(f"{b / 1e6:.0f}" for b in rs[0]["bytes"])
        lines.append(f"| {name} | {_median(rs, 'step_s'):.3f} | {_median(rs, 'save_s'):.3f} | "
                     f"{_median(rs, 'call_s'):.3f} | {_median(rs, 'during_s'):.3f} | {_median(rs, 'stall_s'):.3f} | "
                     f"{_median(rs, 'total_s'):.3f} | {_median(rs, 'load_s'):.3f} | {mb} |")
    if rows.get("dcp") and rows.get("tiertrain"):
        d, t = rows["dcp"], rows["tiertrain"]
        lines += ["", "Ratios tiertrain / DCP (medians; targets from issue 16: async stall <= 1, load <= 1.1):", "",
                  f"- save: {_median(t, 'save_s') / _median(d, 'save_s'):.2f}",
                  f"- async stall: {_median(t, 'stall_s') / max(_median(d, 'stall_s'), 1e-9):.2f}",
                  f"- async total: {_median(t, 'total_s') / _median(d, 'total_s'):.2f}",
                  f"- load: {_median(t, 'load_s') / _median(d, 'load_s'):.2f}"]
    lines += ["", "Per launch (JSON, slowest rank's times):", "", "```"]
    for name, rs in rows.items():
        for r in rs:
            lines.append(f"{name} {json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})}")
    lines += ["```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
