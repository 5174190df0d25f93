#!/usr/bin/env python
"""ZeRO-3 with parameters and optimizer state on NVMe (ZeRO-Infinity): tiertrain vs DeepSpeed's
same configuration on the same model, on CPU/gloo (issue 4, acceptance benchmark (c): target
tiertrain / DeepSpeed <= 0.8 in step time).

Rows (each in its own fresh set of ``--world`` processes, round-robin over ``--rounds``):

* ``ds_nvme``  DeepSpeed ZeRO-3, ``offload_param: {device: nvme}`` and
  ``offload_optimizer: {device: nvme}`` (async_io op over libaio, DeepSpeedCPUAdam from the
  swapped-in state, ``pin_memory: false``; see ``--ds-zero-overrides`` / ``--ds-aio``).
* ``tt_nvme``  tiertrain ZeRO-3, ``zero.offload_params="nvme"`` and
  ``zero.offload_optimizer=--tiertrain-optimizer`` (nvme once ZeroConfig accepts it, else cpu,
  announced loudly).
* ``tt_ram``   tiertrain ZeRO-3 with every state in RAM (no offload): the floor that the NVMe
  tier's overhead is measured against.
* optional: ``ds_ram`` (DeepSpeed ZeRO-3 with every state in RAM, torch fused AdamW: DeepSpeed's
  own floor), ``ds_cpu`` (DeepSpeed ZeRO-3 with params and optimizer offloaded to CPU), ``tt_cpu``
  (tiertrain, both on the CPU tier).

Same GPT (``tiertrain.models.gpt``, ``--preset``), same seed, same per-rank batches, fp32, AdamW
with decay on >= 2-D parameters only (DeepSpeed gets a client ``DeepSpeedCPUAdam`` with those
two parameter groups, which its NVMe offload accepts), no clipping, constant LR. So the loss
column must agree across rows (to float rounding: DeepSpeedCPUAdam vs torch's fused AdamW).

Per timed step, per rank: wall time, process CPU time, main-thread run-queue wait (as
``bench/baselines.py``), and the bytes the process read from / wrote to the block device:
``read_bytes`` / ``write_bytes`` deltas of ``/proc/self/io`` (all threads, including IO
workers; both frameworks swap with O_DIRECT, so these are the disk bytes, not page-cache hits).
For tiertrain, the swapper's own logical byte counters (``engine.swapper.stats``) are recorded
too as a cross-check. Peak RSS per rank is ``ru_maxrss``.

Disk bandwidth is measured in the same run, on the swap directory, before every run:
``dd bs=8M oflag=direct`` (write) and ``iflag=direct`` (read) of ``--dd-mib`` MiB. The IO lower
bound of a step is (read bytes of both ranks) / read bandwidth + (written bytes of both ranks)
/ write bandwidth: both ranks share one disk, and reads and writes are counted one after the
other (the disk's mixed throughput is not higher here).

    python bench/zero3_nvme.py                                   # bench preset, 2 ranks, 3 rounds, ~8 min
    python bench/zero3_nvme.py --rounds 1 --steps 2 --warmup 1 --no-md          # quick check
    python bench/zero3_nvme.py --frameworks tt_nvme tt_ram --tiertrain-optimizer cpu

DeepSpeed's NVMe path needs its async_io op: ``apt-get install libaio-dev``, then
``BENCH_PREBUILD=all bash bench/setup_env.sh`` (JIT-builds async_io, pin_memory, cpu_adam).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (HERE, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import free_port, gather_results, init_gloo, loadavg, machine_lines, spawn_ranks  # noqa: E402

MiB = 1 << 20
DEFAULT_FRAMEWORKS = ["ds_nvme", "tt_nvme", "tt_ram"]
ALL_FRAMEWORKS = ["ds_nvme", "tt_nvme", "tt_ram", "ds_ram", "ds_cpu", "tt_cpu"]
TARGET = 0.8


# ----------------------------------------------------------------------------- helpers


def proc_io() -> dict[str, int]:
    """This process's IO counters (all threads, live and exited)."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def tiertrain_nvme_optimizer_supported() -> tuple[bool, str]:
    """Whether tiertrain's ZeroConfig.validate accepts offload_optimizer='nvme' (stage 3)."""
    from tiertrain.config import ConfigError, ZeroConfig

    try:
        ZeroConfig(stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_path="/tmp").validate()
        return True, ""
    except ConfigError as e:
        return False, str(e)


def ds_config(args, swap_dir: str, offload: str, micro_batch: int) -> dict:
    """DeepSpeed ZeRO-3 config (fp32, no clipping); offload = nvme | cpu | none."""
    from baselines import OptimConfig, deepspeed_config

    zero: dict = {"stage3_param_persistence_threshold": args.ds_persistence}
    if offload == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": swap_dir, "pin_memory": False,
                                 "buffer_count": args.ds_param_buffers, "buffer_size": args.ds_param_buffer_numel,
                                 "max_in_cpu": 0}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": swap_dir, "pin_memory": False,
                                     "buffer_count": 4, "fast_init": False,
                                     "pipeline_read": args.ds_pipeline, "pipeline_write": args.ds_pipeline}
        # With the default reuse distance (1e9) a fetched parameter is never released during
        # the step, so its swap-in buffer is never returned and the 17th swappable parameter
        # of the forward fails ("AssertionError: Not enough buffers 0 for swapping 1").
        zero["stage3_max_reuse_distance"] = 0
    elif offload == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    zero.update(json.loads(args.ds_zero_overrides))
    cfg = deepspeed_config(3, micro_batch, OptimConfig(), ds_optimizer="client", zero_overrides=zero)
    if offload == "nvme":
        cfg["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1,
                      "single_submit": False, "overlap_events": True, "use_gds": False}
        cfg["aio"].update(json.loads(args.ds_aio))
    if offload != "none":
        cfg["zero_force_ds_cpu_optimizer"] = True
    return cfg


def tt_config(args, swap_dir: str, offload_params: str, offload_optimizer: str, micro_batch: int) -> dict:
    from baselines import OptimConfig, tiertrain_config_dict

    optim = OptimConfig(lr=args.lr, impl="fused", decay="matrices")
    zero = {"offload_params": offload_params, "offload_optimizer": offload_optimizer}
    if "nvme" in (offload_params, offload_optimizer):
        zero["nvme_path"] = swap_dir
    zero.update(json.loads(args.tt_zero_overrides))
    return tiertrain_config_dict(3, micro_batch, optim, zero_overrides=zero)


# ----------------------------------------------------------------------------- worker


def worker(rank, world, port, fw, args, swap_dir, result_path):
    init_gloo(rank, world, port, threads=args.threads, timeout_s=args.timeout, ignore=Warning)
    from baselines import OptimConfig, current_rss_mib, peak_rss_mib, thread_runqueue_s
    from run_baselines import Batches, ModelFactory

    factory = ModelFactory(args.preset, json.loads(args.model_overrides))
    mcfg = factory.config()
    seq = args.seq_len or mcfg.seq_len
    batches = Batches(rank, args.batch_size, seq, mcfg.vocab_size, args.warmup + args.steps)
    optim = OptimConfig(lr=args.lr, impl="fused", decay="matrices")
    out: dict = {"rank": rank, "ok": False}
    engine = None
    try:
        import gc
        gc.collect()
        rss0 = current_rss_mib()
        t_setup = time.perf_counter()
        io_setup = proc_io()
        swapper = None
        phases: dict[str, float] = {}
        if fw.startswith("ds"):
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            import deepspeed
            from deepspeed.accelerator import get_accelerator
            assert get_accelerator().device_name() == "cpu", get_accelerator().device_name()
            deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
            offload = {"ds_nvme": "nvme", "ds_cpu": "cpu", "ds_ram": "none"}[fw]
            cfg = ds_config(args, swap_dir, offload, args.batch_size)
            torch.manual_seed(args.seed)
            model = factory()
            n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
            if offload == "none":
                opt = optim.make(model.parameters())
                opt_name = "torch AdamW(fused)"
            else:
                from deepspeed.ops.adam import DeepSpeedCPUAdam
                opt = DeepSpeedCPUAdam(optim.groups(model.parameters()), lr=optim.lr, betas=optim.betas,
                                       eps=optim.eps, weight_decay=optim.weight_decay, adamw_mode=True)
                opt_name = "DeepSpeedCPUAdam"
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg,
                                                   dist_init_required=False)

            def step(b):
                t0 = time.perf_counter()
                loss = engine(*b)
                t1 = time.perf_counter()
                engine.backward(loss)
                t2 = time.perf_counter()
                engine.step()
                phases.update(fwd=t1 - t0, bwd=t2 - t1, opt=time.perf_counter() - t2)
                return loss.detach()
            out["config"] = cfg
        else:
            import tiertrain
            from tiertrain.config import Config, from_dict
            tiers = {"tt_nvme": ("nvme", args.tiertrain_optimizer), "tt_cpu": ("cpu", "cpu"),
                     "tt_ram": ("none", "none")}[fw]
            cfg_dict = tt_config(args, swap_dir, tiers[0], tiers[1], args.batch_size)
            cfg = from_dict(Config, cfg_dict)
            cfg.validate()
            torch.manual_seed(args.seed)
            model = factory()
            n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
            topology = tiertrain.Topology.build(cfg.parallel)
            engine = tiertrain.wrap(model, cfg, topology)
            swapper = engine.swapper
            opt_name = f"tiertrain AdamW(fused), params:{tiers[0]} optimizer:{tiers[1]}"

            if swapper is not None:  # measurement only: time the main thread blocks reading param shards
                _read_shard = engine.flat.shards.read

                def timed_read_shard(index, shard):
                    t = time.perf_counter()
                    try:
                        return _read_shard(index, shard)
                    finally:
                        phases["param_read_wait"] = phases.get("param_read_wait", 0.0) + time.perf_counter() - t
                engine.flat.shards.read = timed_read_shard

            def step(b):
                phases["param_read_wait"] = 0.0
                t0 = time.perf_counter()
                loss = engine(b)
                t1 = time.perf_counter()
                engine.backward(loss)
                t2 = time.perf_counter()
                engine.step()
                phases.update(fwd=t1 - t0, bwd=t2 - t1, opt=time.perf_counter() - t2)
                st = getattr(getattr(getattr(engine, "update", None), "nvme", None), "last_stats", None)
                if st is not None:
                    phases.update(nvme_opt_s=st.seconds, nvme_opt_io_wait=st.io_wait_seconds,
                                  nvme_opt_compute=st.compute_seconds, nvme_opt_ready_wait=st.ready_wait_seconds)
                overlapped = getattr(engine, "last_overlapped_step", None)
                if overlapped:
                    phases["chunks_in_bwd"] = overlapped["chunks_done"] / overlapped["chunks"]
                return loss.detach()
            out["config"] = cfg_dict
        setup_s = time.perf_counter() - t_setup
        io_after_setup = proc_io()
        rec = {k: [] for k in ("wall", "cpu", "runq", "read_bytes", "write_bytes", "rchar", "wchar",
                               "swap_in_bytes", "swap_out_bytes")}
        losses = []
        for i in range(args.warmup + args.steps):
            b = batches(i)
            dist.barrier()
            s0 = dict(swapper.stats) if swapper is not None else None
            io0 = proc_io()
            q0 = thread_runqueue_s()
            c0 = time.process_time()
            t0 = time.perf_counter()
            loss = step(b)
            t1 = time.perf_counter()
            c1 = time.process_time()
            q1 = thread_runqueue_s()
            io1 = proc_io()
            s1 = dict(swapper.stats) if swapper is not None else None
            losses.append(float(loss))
            if i >= args.warmup:
                rec["wall"].append(t1 - t0)
                rec["cpu"].append(c1 - c0)
                rec["runq"].append(q1 - q0)
                for k in ("read_bytes", "write_bytes", "rchar", "wchar"):
                    rec[k].append(io1[k] - io0[k])
                for k, v in phases.items():
                    rec.setdefault("phase_" + k, []).append(v)
                if s0 is not None:
                    rec["swap_in_bytes"].append(s1["bytes_in"] - s0["bytes_in"])
                    rec["swap_out_bytes"].append(s1["bytes_out"] - s0["bytes_out"])
        extra = {}
        if not fw.startswith("ds"):
            mem = engine.memory_report()
            extra["memory_report_mib"] = {k: getattr(mem, k) / MiB for k in
                                          ("params", "gathered_params", "grads", "optimizer",
                                           "cpu_tier", "nvme_tier")}
            if swapper is not None:
                extra["swapper_stats"] = dict(swapper.stats)
                extra["swapper_pool_mib"] = getattr(getattr(swapper, "pool", None), "capacity", 0) / MiB \
                    if hasattr(getattr(swapper, "pool", None), "capacity") else None
        swap_files_mib = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(swap_dir)
                             for f in fs) / MiB if os.path.isdir(swap_dir) else 0.0
        out.update(ok=True, n_params=n_params, seq_len=seq, optimizer=opt_name, setup_s=setup_s,
                   setup_write_bytes=io_after_setup["write_bytes"] - io_setup["write_bytes"],
                   rss_start_mib=rss0, rss_end_mib=current_rss_mib(), peak_rss_mib=peak_rss_mib(),
                   losses=losses, rec=rec, extra=extra, swap_files_mib=swap_files_mib)
    except Exception as e:  # noqa: BLE001
        out.update(error=f"{type(e).__name__}: {e}", tb=traceback.format_exc())
    gather_results(out, result_path)
    if engine is not None and hasattr(engine, "destroy"):
        try:
            engine.destroy()
        except Exception:  # noqa: BLE001
            pass
    dist.barrier()
    dist.destroy_process_group()


def launch(fw, args) -> list[dict]:
    swap_dir = os.path.join(args.nvme_dir, fw)
    shutil.rmtree(swap_dir, ignore_errors=True)
    os.makedirs(swap_dir, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=f"zero3_nvme_{fw}_", suffix=".json")
    os.close(fd)
    try:
        spawn_ranks(worker, (args.world, free_port(), fw, args, swap_dir, path), args.world, args.run_timeout, fw)
        with open(path) as f:
            return json.load(f)
    except BaseException as e:  # noqa: BLE001
        return [{"rank": -1, "ok": False, "error": f"{type(e).__name__}: {str(e)[:3000]}"}]
    finally:
        os.unlink(path)
        shutil.rmtree(swap_dir, ignore_errors=True)


# ----------------------------------------------------------------------------- disk bandwidth


def dd_bandwidth(d: str, mib: int) -> dict[str, float]:
    """O_DIRECT write then read of mib MiB with dd bs=8M in directory d: GB/s as dd reports."""
    path = os.path.join(d, "dd_probe.bin")
    res = {}
    for op, argv in (("write", ["if=/dev/zero", f"of={path}", "bs=8M", f"count={max(1, mib // 8)}",
                                "oflag=direct"]),
                     ("read", [f"if={path}", "of=/dev/null", "bs=8M", "iflag=direct"])):
        p = subprocess.run(["dd", *argv], capture_output=True, text=True, timeout=300)
        m = re.search(r"(\d+) bytes.*copied, ([0-9.eE+-]+) s", p.stderr)
        if p.returncode != 0 or not m:
            raise RuntimeError(f"dd {' '.join(argv)} failed: {p.stderr}")
        res[op] = int(m.group(1)) / float(m.group(2)) / 1e9
    os.unlink(path)
    return res


# ----------------------------------------------------------------------------- report


def summarize(fw: str, rounds: list[list[dict]], bw: dict[str, float]) -> dict:
    bad = [r for ranks in rounds for r in ranks if not r.get("ok")]
    if bad:
        return {"framework": fw, "ok": False, "error": bad[0].get("error", "?"), "tb": bad[0].get("tb")}
    world = len(rounds[0])
    # per-step values pooled over rounds; the step time of a step = slowest rank's wall
    walls = [max(r["rec"]["wall"][i] for r in ranks) for ranks in rounds for i in range(len(ranks[0]["rec"]["wall"]))]

    def pooled(key, agg=sum):
        return [agg(r["rec"][key][i] for r in ranks) for ranks in rounds
                for i in range(len(ranks[0]["rec"][key]))]
    med = statistics.median
    rd, wr = pooled("read_bytes"), pooled("write_bytes")
    lb = [a / (bw["read"] * 1e9) + b / (bw["write"] * 1e9) for a, b in zip(rd, wr)]
    row = {
        "framework": fw, "ok": True, "n_params": rounds[0][0]["n_params"], "seq_len": rounds[0][0]["seq_len"],
        "optimizer": rounds[0][0]["optimizer"], "timed_steps": len(walls),
        "median_step_s": med(walls), "min_step_s": min(walls),
        "round_medians_s": [med([max(r["rec"]["wall"][i] for r in ranks) for i in range(len(ranks[0]["rec"]["wall"]))])
                            for ranks in rounds],
        "median_cpu_s": med(pooled("cpu", max)), "median_runq_s": med(pooled("runq", max)),
        "median_read_mib": med(rd) / MiB, "median_write_mib": med(wr) / MiB,
        "median_rchar_mib": med(pooled("rchar")) / MiB, "median_wchar_mib": med(pooled("wchar")) / MiB,
        "io_lower_bound_s": med(lb),
        "peak_rss_mib": [max(ranks[k]["peak_rss_mib"] for ranks in rounds) for k in range(world)],
        "peak_over_start_mib": [max(ranks[k]["peak_rss_mib"] - ranks[k]["rss_start_mib"] for ranks in rounds)
                                for k in range(world)],
        "setup_s": max(r["setup_s"] for ranks in rounds for r in ranks),
        "swap_files_mib": rounds[0][0].get("swap_files_mib", 0.0),  # rank 0 walks the whole run's swap dir
        "losses_per_rank": [r["losses"] for r in rounds[0]],
        "extra": rounds[0][0].get("extra", {}),
    }
    row["phases_s"] = {k[6:]: med(pooled(k, max)) for k in rounds[0][0]["rec"] if k.startswith("phase_")}
    if rounds[0][0]["rec"]["swap_in_bytes"]:
        row["median_swap_in_mib"] = med(pooled("swap_in_bytes")) / MiB
        row["median_swap_out_mib"] = med(pooled("swap_out_bytes")) / MiB
    return row


def render(rows, args, machine, cmd, bws, loads, load_after, wall_s, tt_opt_note) -> str:
    by = {r["framework"]: r for r in rows if r["ok"]}
    ref = by.get("tt_ram") or next(iter(by.values()), None)
    for r in rows:
        if r["ok"] and ref is not None:
            r["max_abs_loss_diff"] = max(abs(a - b) for la, lb in zip(r["losses_per_rank"], ref["losses_per_rank"])
                                         for a, b in zip(la, lb))
    bw_r = statistics.median(b["read"] for b in bws)
    bw_w = statistics.median(b["write"] for b in bws)
    n = next((r["n_params"] for r in rows if r["ok"]), 0)
    seq = next((r["seq_len"] for r in rows if r["ok"]), 0)
    L = ["# ZeRO-3 with parameters + optimizer state on NVMe: tiertrain vs DeepSpeed (ZeRO-Infinity) on CPU", "",
         f"Command: `{cmd}` — {datetime.datetime.now().isoformat(timespec='seconds')}, {wall_s:.0f} s.", "",
         "## Machine", *machine,
         f"- 1-min load average at the start of each run (round 1, 2, ...): "
         + "; ".join(f"{fw} {', '.join(v)}" for fw, v in loads.items()) + f"; after: {load_after}"
         + " (2 shared cores; other sessions were running)", ""]
    if tt_opt_note:
        L += [f"**NOTE: tiertrain's optimizer tier is `{args.tiertrain_optimizer}`, not nvme** — {tt_opt_note} "
              "So `tt_nvme` has only its parameters on NVMe and its fp32 master + Adam moments in RAM, while "
              "`ds_nvme` swaps both: the ratio below is NOT yet the acceptance configuration.", ""]
    L += ["## Setup",
          f"- Model: tiertrain.models.gpt.GPT preset `{args.preset}` {args.model_overrides if args.model_overrides != '{}' else ''}"
          f"({n / 1e6:.2f}M params), fp32 compute, fp32 master + AdamW state; world={args.world} gloo ranks, "
          f"{args.threads} torch thread/rank; micro-batch {args.batch_size} x seq {seq} per rank; "
          f"{args.warmup} warmup + {args.steps} timed steps x {args.rounds} round(s), frameworks round-robin "
          f"(odd rounds reversed), each run in fresh processes; value = median over the pooled timed steps "
          f"of the slowest rank's step.",
          "- AdamW lr=3e-4 betas=(0.9,0.95) eps=1e-8 wd=0.1 on >= 2-D params only, no clipping, constant LR: "
          "tiertrain `optimizer.impl=fused` (torch fused AdamW), DeepSpeed a client `DeepSpeedCPUAdam` "
          "(adamw_mode) with the same two groups (torch fused AdamW for `ds_ram`). Loss diff = max |loss - "
          f"{ref['framework'] if ref else '?'}'s| over both ranks and every step.",
          f"- DeepSpeed ZeRO-3: `stage3_param_persistence_threshold={args.ds_persistence}`; offload_param "
          f"nvme: buffer_count {args.ds_param_buffers}, buffer_size {args.ds_param_buffer_numel}, max_in_cpu 0, pin_memory false; "
          f"offload_optimizer nvme: buffer_count 4, pipeline_read/write {args.ds_pipeline}, pin_memory false; "
          f"stage3_max_reuse_distance 0 (needed with NVMe params, see Notes); "
          f"`aio`: block_size 1 MiB, queue_depth 8, intra_op_parallelism 1, overlap_events true "
          f"(overrides: zero `{args.ds_zero_overrides}`, aio `{args.ds_aio}`). Full config in the JSON.",
          f"- tiertrain ZeRO-3: persistence_threshold 0, prefetch_mb default (0 on CPU); offload_params nvme, "
          f"offload_optimizer {args.tiertrain_optimizer}; swapper: AsyncIO 4 threads, 1 MiB blocks, O_DIRECT "
          f"(overrides: `{args.tt_zero_overrides}`).",
          f"- IO: read/written MiB = `/proc/self/io` read_bytes / write_bytes deltas over the step, summed over "
          f"both ranks (block-device bytes of all threads; both frameworks use O_DIRECT). Disk bandwidth: dd "
          f"bs=8M O_DIRECT, {args.dd_mib} MiB, on the swap directory before every run: read "
          f"{bw_r:.2f} GB/s, write {bw_w:.2f} GB/s (medians of "
          + ", ".join(f"{b['read']:.2f}/{b['write']:.2f}" for b in bws) + " r/w). "
          "IO lower bound = read bytes / read bw + written bytes / write bw (both ranks share the disk).",
          "- Memory: peak RSS = ru_maxrss per rank (whole process, incl. ~300-500 MiB of imports); "
          "peak-start = peak minus RSS before the model was built.", "",
          "## Results", "",
          "| run | optimizer | median step (s) | min step (s) | per-round medians (s) | CPU/step (s) | runq (s) "
          "| read MiB/step | written MiB/step | IO lower bound (s) | step / IO bound | peak RSS per rank (MiB) "
          "| peak-start per rank (MiB) | swap files (MiB) | setup (s) | loss first -> last | max abs loss diff |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["ok"]:
            L.append(f"| {r['framework']} | FAILED: {r['error'][:300]} |" + " |" * 15)
            continue
        lb = r["io_lower_bound_s"]
        L.append(f"| {r['framework']} | {r['optimizer']} | {r['median_step_s']:.2f} | {r['min_step_s']:.2f} | "
                 f"{' / '.join(f'{x:.2f}' for x in r['round_medians_s'])} | {r['median_cpu_s']:.2f} | "
                 f"{r['median_runq_s']:.2f} | {r['median_read_mib']:.0f} | {r['median_write_mib']:.0f} | "
                 f"{lb:.2f} | {(r['median_step_s'] / lb) if lb > 0 else float('nan'):.1f} | "
                 f"{' / '.join(f'{x:.0f}' for x in r['peak_rss_mib'])} | "
                 f"{' / '.join(f'{x:.0f}' for x in r['peak_over_start_mib'])} | {r['swap_files_mib']:.0f} | "
                 f"{r['setup_s']:.1f} | "
                 f"{r['losses_per_rank'][0][0]:.4f} -> {r['losses_per_rank'][0][-1]:.4f} | "
                 f"{r.get('max_abs_loss_diff', float('nan')):.1e} |")
    L += ["", "## Ratios (same run)", "",
          "median step = ratio of the pooled medians (the target applies to it); per round = the ratio of "
          "the two runs' medians in each round (adjacent runs, so similar background load), and their median.", "",
          "| ratio | median step | target | | per round (median) | min step | peak RSS (max rank) | read bytes | written bytes |",
          "|---|---|---|---|---|---|---|---|---|"]
    for num, den, target in (("tt_nvme", "ds_nvme", TARGET), ("tt_nvme", "tt_ram", None),
                             ("ds_nvme", "ds_ram", None), ("tt_cpu", "ds_cpu", None), ("tt_ram", "ds_ram", None)):
        if num in by and den in by:
            a, b = by[num], by[den]
            t = a["median_step_s"] / b["median_step_s"]
            verdict = "" if target is None else ("PASS" if t <= target else "FAIL")
            rb = a["median_read_mib"] / b["median_read_mib"] if b["median_read_mib"] > 0 else float("nan")
            wb = a["median_write_mib"] / b["median_write_mib"] if b["median_write_mib"] > 0 else float("nan")
            per = [x / y for x, y in zip(a["round_medians_s"], b["round_medians_s"])]
            L.append(f"| {num} / {den} | {t:.3f} | {'<= ' + str(target) if target else ''} | {verdict} | "
                     f"{' / '.join(f'{x:.2f}' for x in per)} ({statistics.median(per):.3f}) | "
                     f"{a['min_step_s'] / b['min_step_s']:.3f} | {max(a['peak_rss_mib']) / max(b['peak_rss_mib']):.3f} | "
                     f"{rb:.2f} | {wb:.2f} |")
    ph = [r for r in rows if r["ok"] and r.get("phases_s")]
    if ph:
        keys = ["fwd", "bwd", "opt", "param_read_wait", "nvme_opt_s", "nvme_opt_io_wait", "nvme_opt_compute",
                "nvme_opt_ready_wait", "chunks_in_bwd"]
        L += ["", "## Where the step goes (median over steps of the slowest rank, seconds)", "",
              "fwd / bwd / opt = engine forward, backward, step (the optimizer phase includes the NVMe "
              "optimizer's streaming and the parameter write-back); param_read_wait = time tiertrain's main "
              "thread spent in `flat.shards.read` (NVMe -> RAM parameter reads at gather time, fwd + bwd); "
              "nvme_opt_* = tiertrain's `engine.update.nvme.last_stats` (seconds, io_wait_seconds, compute_seconds, "
              "ready_wait_seconds). Without clipping tiertrain's step runs during backward "
              "(`zero.overlap_nvme_step`, tiertrain/update/nvme/overlapped_step.py): its pass then starts with the "
              "boundary backward, so nvme_opt_s spans backward and step, and ready_wait is the time its worker "
              "waited for gradients; chunks_in_bwd = fraction of the optimizer's chunks updated before "
              "`engine.step()` was called (`engine.last_overlapped_step`).", "",
              "| run | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        for r in ph:
            L.append(f"| {r['framework']} | " + " | ".join(
                f"{r['phases_s'][k]:.2f}" if k in r["phases_s"] else "" for k in keys) + " |")
    tt = [r for r in rows if r["ok"] and "median_swap_in_mib" in r]
    if tt:
        L += ["", "## tiertrain swapper accounting (rank 0's engine.swapper.stats, summed over ranks per step)", "",
              "| run | swap_in MiB/step (logical) | swap_out MiB/step (logical) | /proc read MiB/step | /proc written MiB/step | memory_report (rank 0, MiB) |",
              "|---|---|---|---|---|---|"]
        for r in tt:
            m = r["extra"].get("memory_report_mib", {})
            L.append(f"| {r['framework']} | {r['median_swap_in_mib']:.0f} | {r['median_swap_out_mib']:.0f} | "
                     f"{r['median_read_mib']:.0f} | {r['median_write_mib']:.0f} | "
                     + ", ".join(f"{k} {v:.0f}" for k, v in m.items()) + " |")
    L += ["", "## Notes", "",
          "What DeepSpeed 0.19.8's NVMe offload needed on the CPU accelerator (it does run there):",
          "- its `async_io` op, which links libaio: `apt-get install libaio-dev` (now in `bench/setup_env.sh`), "
          "then the op JIT-builds from `deepspeed/ops/op_builder/cpu/async_io.py` (it first builds the "
          "`pin_memory` op); ~5.5 min cold on the 2 busy cores here (pin_memory 107 s + async_io 220 s), "
          "cached in `~/.cache/torch_extensions/py311_cpu` afterwards (`BENCH_PREBUILD=all bash bench/setup_env.sh`).",
          "- `pin_memory: false` for both offloads, and a DeepSpeed CPU optimizer (a client `DeepSpeedCPUAdam` "
          "here, which also lets both frameworks use the same two weight-decay groups).",
          "- `stage3_max_reuse_distance: 0`. At the default (1e9) a fetched parameter is never released within "
          "the step, so its swap-in buffer is never returned, and the first forward fails with "
          "`AssertionError: Not enough buffers 0 for swapping 1` (`partitioned_param_swapper.py`, swap_in) "
          "once `offload_param.buffer_count` parameters have been fetched: with the default 5 buffers and with 16. "
          "With reuse distance 0, 16 buffers of 1e6 elements (64 MiB, the size of tiertrain's swap pool) suffice.",
          "- DeepSpeed keeps every parameter partition under 1 MiB (`MIN_AIO_BYTES`) in RAM instead of on NVMe "
          "(in the `bench` preset: the 640x640 attention projections, 0.8 MB per rank, and the embeddings); "
          "tiertrain swaps every partitioned unit whatever its size. The read/written columns count what "
          "each actually moved.",
          "- Setup time: DeepSpeed's initialisation with NVMe offload (partitioning, swapping every "
          "parameter and the optimizer state out once, `fast_init: false`) is the `setup` column; the "
          "step times exclude it for both."]
    return "\n".join(L) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frameworks", nargs="+", default=DEFAULT_FRAMEWORKS,
                   help=f"any of {' '.join(ALL_FRAMEWORKS)} or 'all' (default: {' '.join(DEFAULT_FRAMEWORKS)})")
    p.add_argument("--tiertrain-optimizer", choices=["nvme", "cpu"], default=None,
                   help="tiertrain's zero.offload_optimizer in tt_nvme (default: nvme if ZeroConfig accepts it, else cpu)")
    p.add_argument("--nvme-dir", default="/tmp/zero3_nvme_swap", help="swap directory (one subdirectory per run)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--preset", default="bench", choices=["tiny", "small", "bench"])
    p.add_argument("--model-overrides", default="{}", help='JSON, e.g. \'{"n_layers": 12}\'')
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=0, help="0 = preset's seq_len")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--ds-persistence", type=int, default=0,
                   help="DeepSpeed stage3_param_persistence_threshold (0 = every param partitioned, like tiertrain)")
    p.add_argument("--ds-param-buffer-numel", type=int, default=int(1e6),
                   help="DeepSpeed offload_param.buffer_size (elements; >= the largest parameter partition)")
    p.add_argument("--ds-param-buffers", type=int, default=16,
                   help="DeepSpeed offload_param.buffer_count (its default 5 fails: 'Not enough buffers 0 for "
                        "swapping 1', its prefetcher holds them all)")
    p.add_argument("--ds-pipeline", action="store_true", help="DeepSpeed offload_optimizer pipeline_read/write")
    p.add_argument("--ds-zero-overrides", default="{}", help="JSON merged into DeepSpeed's zero_optimization")
    p.add_argument("--ds-aio", default="{}", help="JSON merged into DeepSpeed's aio section")
    p.add_argument("--tt-zero-overrides", default="{}", help="JSON merged into tiertrain's zero section")
    p.add_argument("--dd-mib", type=int, default=256, help="size of the dd bandwidth probe before every run")
    p.add_argument("--timeout", type=float, default=300, help="process-group timeout (s)")
    p.add_argument("--run-timeout", type=float, default=600, help="kill one run's ranks after (s)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "zero3_nvme.md"))
    p.add_argument("--no-md", action="store_true", help="print only, write nothing")
    args = p.parse_args(argv)
    fws = []
    for f in args.frameworks:
        for x in (ALL_FRAMEWORKS if f == "all" else [f]):
            if x not in ALL_FRAMEWORKS:
                p.error(f"unknown framework {x!r}: expected one of {ALL_FRAMEWORKS}")
            if x not in fws:
                fws.append(x)
    args.frameworks = fws
    supported, why = tiertrain_nvme_optimizer_supported()
    tt_opt_note = ""
    if args.tiertrain_optimizer is None:
        args.tiertrain_optimizer = "nvme" if supported else "cpu"
    if args.tiertrain_optimizer == "cpu":
        tt_opt_note = ("tiertrain's ZeroConfig does not accept offload_optimizer='nvme' yet "
                       f"(`{why}`)." if not supported else "--tiertrain-optimizer cpu was given.")
        if "tt_nvme" in fws:
            print("=" * 100 + f"\nNOTE: tt_nvme runs with zero.offload_optimizer='cpu' (params on NVMe only): "
                  f"{tt_opt_note}\n" + "=" * 100, flush=True)
    os.makedirs(args.nvme_dir, exist_ok=True)
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    machine = [f"- {line}" for line in machine_lines(dirs=[args.nvme_dir], packages=["deepspeed"], debs=["libaio-dev"])]
    print("\n".join(machine), flush=True)
    t_start = time.perf_counter()
    rounds: dict[str, list] = {fw: [] for fw in fws}
    loads: dict[str, list] = {fw: [] for fw in fws}
    bws = []
    for rnd in range(args.rounds):
        for fw in (fws if rnd % 2 == 0 else fws[::-1]):
            bw = dd_bandwidth(args.nvme_dir, args.dd_mib)
            bws.append(bw)
            print(f"[round {rnd + 1}/{args.rounds}] dd O_DIRECT: read {bw['read']:.2f} GB/s, write {bw['write']:.2f} GB/s",
                  flush=True)
            loads[fw].append(loadavg().split()[0])
            t0 = time.perf_counter()
            ranks = launch(fw, args)
            rounds[fw].append(ranks)
            bad = [r for r in ranks if not r.get("ok")]
            if bad:
                print(f"[round {rnd + 1}/{args.rounds}] {fw:8s} FAILED: {bad[0].get('error', '?')[:1500]}", flush=True)
                if bad[0].get("tb"):
                    print(bad[0]["tb"][-4000:], flush=True)
                continue
            w = [max(r["rec"]["wall"][i] for r in ranks) for i in range(len(ranks[0]["rec"]["wall"]))]
            rd = [sum(r["rec"]["read_bytes"][i] for r in ranks) / MiB for i in range(len(w))]
            wr = [sum(r["rec"]["write_bytes"][i] for r in ranks) / MiB for i in range(len(w))]
            print(f"[round {rnd + 1}/{args.rounds}] {fw:8s} steps {' '.join(f'{x:.2f}' for x in w)} s; "
                  f"read {statistics.median(rd):.0f} MiB, wrote {statistics.median(wr):.0f} MiB per step; "
                  f"peak RSS {' / '.join('%.0f' % r['peak_rss_mib'] for r in ranks)} MiB; "
                  f"loss {ranks[0]['losses'][0]:.4f} -> {ranks[0]['losses'][-1]:.4f} "
                  f"({time.perf_counter() - t0:.0f} s, load {loadavg()})", flush=True)
    bw_med = {k: statistics.median(b[k] for b in bws) for k in ("read", "write")}
    rows = []
    for fw in fws:
        ok_rounds = [r for r in rounds[fw] if all(x.get("ok") for x in r)]
        rows.append(summarize(fw, ok_rounds if ok_rounds and len(ok_rounds) == len(rounds[fw]) else rounds[fw], bw_med))
    md = render(rows, args, machine, cmd, bws, loads, loadavg(), time.perf_counter() - t_start, tt_opt_note)
    print()
    print(md)
    if not args.no_md:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(md)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"args": vars(args), "command": cmd, "bandwidth": bws, "rows": rows,
                       "raw": rounds}, f, indent=1, default=str)
        print(f"written to {args.out}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
