#!/usr/bin/env python
"""The largest model this machine trains, at the disk's speed: tiertrain and DeepSpeed
ZeRO-Infinity side by side at growing sizes (issue 20; docs/concepts.md#zero-infinity).

For each size the same GPT (hidden 2560, 20 heads, vocabulary 256, sequence 64, no biases,
layers chosen for the size) is trained by each framework on 2 gloo ranks, fp32, micro-batch
``--micro-batch`` × 64 tokens per rank, the same tokens every step (so the loss curve shows the
optimizer working), AdamW without clipping, ZeRO-3 with parameters and optimizer state on NVMe:

* ``tt``: tiertrain, ``zero.offload_params=nvme``, ``zero.offload_optimizer=nvme``,
  ``zero.nvme_in_place`` (one generation of optimizer state on disk, as DeepSpeed keeps), the
  model built partitioned (``tiertrain.partitioned_init``). With ``--plan`` the largest size
  runs from the config ``tiertrain plan`` writes for it (the command is in the results).
* ``ds``: DeepSpeed ZeRO-3, ``offload_param`` and ``offload_optimizer`` on NVMe (its async_io
  op over libaio, DeepSpeedCPUAdam), the model built under ``deepspeed.zero.Init`` so that no
  rank ever holds it whole; the rest of its configuration is bench/zero3_nvme.py's.

Measured per step and rank: wall time, process CPU time, bytes read from and written to the
block device (``/proc/self/io``), peak RSS (``ru_maxrss``); for tiertrain also the engine's own
counters: forward / backward / step time, the training thread's waits on swap IO and on
collectives (``engine.wait_seconds()``), the NVMe optimizer's pass (``last_stats``), and the
CPU time of checksums and pool copies (``AsyncIO.cpu_seconds``, ``TensorSwapper.cpu_seconds``).
The IO lower bound of a step is Σ read / read bandwidth + Σ written / write bandwidth, both
bandwidths measured with dd (O_DIRECT, 8 MiB) in the swap directory in the same run.

    python bench/scale.py --sizes 0.5 1 2 --plan 2.5           # the committed run (hours)
    python bench/scale.py --sizes 0.1 --steps 2 --no-md         # a quick check
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
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

from _common import free_port, gather_results, init_gloo, loadavg, machine_lines, meminfo, spawn_ranks  # noqa: E402
from larger_than_ram import vm_hwm as _vm_hwm  # noqa: E402  (VmHWM: the peak since start or the last reset)
from zero3_nvme import dd_bandwidth, proc_io  # noqa: E402

from tiertrain.config import ZeroConfig  # noqa: E402

GiB = 1 << 30
HIDDEN, HEADS, VOCAB, SEQ = 2560, 20, 256, 64
RESULTS = os.path.join(HERE, "results", "scale")


def gpt_config(layers: int, seq: int = SEQ):
    from tiertrain.models.gpt import GPTConfig

    # Untied head: DeepSpeed 0.19.8's NVMe parameter swapper fails on a parameter used twice in one
    # forward once it is large enough to be swapped ("param 0 already assigned swap buffer id").
    return GPTConfig(vocab_size=VOCAB, seq_len=seq, n_layers=layers, hidden=HIDDEN, n_heads=HEADS, bias=False,
                     dropout=0.0, tie_embeddings=False)


def layers_for(params: float) -> int:
    """Fewest layers whose GPT has at least `params` parameters."""
    layers = 1
    while gpt_config(layers).num_parameters() < params:
        layers += 1
    return layers


# ----------------------------------------------------------------------------- worker


def _tt_engine(spec, swap_dir):
    import yaml

    import tiertrain
    from tiertrain.config import Config, from_dict

    if spec.get("plan_config"):
        with open(spec["plan_config"]) as f:
            planned = yaml.safe_load(f)
        if planned.get("tile_factor", 1) != 1:
            raise SystemExit(f"the plan tiles the blocks (tile_factor {planned['tile_factor']}); this bench builds "
                             f"them untiled")
        cfg_dict = {k: v for k, v in planned.items() if k in ("precision", "batch", "zero", "activations", "parallel")}
    else:
        cfg_dict = {"precision": {"dtype": "fp32"}, "batch": {"micro_batch_size": spec["micro_batch"]},
                    "zero": {"stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme",
                             "nvme_in_place": True}}
    cfg_dict.setdefault("zero", {})["nvme_path"] = swap_dir
    if spec.get("kept_units") is not None:
        cfg_dict["zero"]["nvme_kept_units"] = spec["kept_units"]
    cfg_dict["zero"].update(spec.get("zero_overrides") or {})
    cfg_dict["batch"] = {**cfg_dict.get("batch", {}), "grad_accum_steps": 1}
    cfg_dict["optimizer"] = {"lr": spec["lr"], "grad_clip": 0.0, "weight_decay": 0.0}
    cfg_dict["schedule"] = {"warmup_steps": 0, "min_lr_ratio": 1.0}
    config = from_dict(Config, cfg_dict).validate()
    topology = tiertrain.Topology.build(config.parallel)
    torch.manual_seed(0)
    with tiertrain.partitioned_init(topology):
        from tiertrain.models.gpt import GPT
        model = GPT(gpt_config(spec["layers"]))
    return tiertrain.wrap(model, config, topology), cfg_dict


def _ds_engine(spec, swap_dir):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from tiertrain.models.gpt import GPT
    from zero3_nvme import ds_config

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    ns = argparse.Namespace(ds_persistence=0, ds_param_buffers=16, ds_param_buffer_numel=spec["ds_buffer_numel"],
                            ds_pipeline=False, ds_aio="{}",
                            # Its default (1e9 elements) streams the optimizer state of a whole
                            # rank's shard at once below 2 B parameters: at 0.55 B a rank reached
                            # 12.2 GB RSS and was killed for memory; 1e8 (its documented knob for
                            # NVMe offload with little RAM) bounds it.
                            ds_zero_overrides=json.dumps({"sub_group_size": spec["ds_sub_group"]}))
    cfg = ds_config(ns, swap_dir, "nvme", spec["micro_batch"])
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="nvme", pin_memory=False):
        model = GPT(gpt_config(spec["layers"]))
    opt = DeepSpeedCPUAdam(model.parameters(), lr=spec["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                           adamw_mode=True)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, dist_init_required=False)
    return engine, cfg


def worker(rank, world, port, fw, spec, swap_dir, result_path):
    init_gloo(rank, world, port, threads=1, timeout_s=spec["timeout"], ignore=Warning)
    out: dict = {"rank": rank, "ok": False}
    engine = None
    try:
        g = torch.Generator().manual_seed(1234 + 7919 * rank)
        tokens = torch.randint(0, VOCAB, (spec["micro_batch"], SEQ + 1), generator=g)
        batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        t0 = time.perf_counter()
        engine, cfg = (_tt_engine if fw == "tt" else _ds_engine)(spec, swap_dir)
        out["setup_s"] = time.perf_counter() - t0
        out["config"] = cfg
        out["build_peak_gib"] = _vm_hwm() / GiB
        _reset_vm_hwm()  # from here VmHWM is the training peak
        rec = []
        for step in range(spec["steps"]):
            dist.barrier()
            io0, c0 = proc_io(), time.process_time()
            counters0 = _tt_counters(engine) if fw == "tt" else {}
            t0 = time.perf_counter()
            loss = engine(batch) if fw == "tt" else engine(*batch)
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            engine.step()
            t3 = time.perf_counter()
            io1, c1 = proc_io(), time.process_time()
            r = {"loss": float(loss.detach()), "wall": t3 - t0, "fwd": t1 - t0, "bwd": t2 - t1, "opt": t3 - t2,
                 "cpu": c1 - c0, "read": io1["read_bytes"] - io0["read_bytes"],
                 "written": io1["write_bytes"] - io0["write_bytes"],
                 "rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
            if fw == "tt":
                counters1 = _tt_counters(engine)
                r.update({k: counters1[k] - counters0[k] for k in counters1})
                stats = engine.update.nvme.last_stats
                r.update(opt_pass_s=stats.seconds, opt_io_wait_s=stats.io_wait_seconds,
                         opt_ready_wait_s=stats.ready_wait_seconds, opt_compute_s=stats.compute_seconds,
                         masters_from_ram=stats.masters_from_ram / max(1, stats.chunks))
                r["copy_cpu_s"] += stats.master_copy_cpu_seconds  # (the step's copies of masters kept in RAM)
                overlapped = engine.last_overlapped_step
                r["chunks_in_bwd"] = overlapped["chunks_done"] / overlapped["chunks"] if overlapped else 0.0
            rec.append(r)
            if rank == 0:
                print(f"[{fw} {spec['label']}] step {step}: loss {r['loss']:.4f} {r['wall']:.1f} s "
                      f"(fwd {r['fwd']:.1f} bwd {r['bwd']:.1f} opt {r['opt']:.1f}) cpu {r['cpu']:.1f} s "
                      f"read {r['read'] / 1e9:.2f} GB written {r['written'] / 1e9:.2f} GB rss {r['rss_peak_gib']:.2f} GiB"
                      + (f" kept gathers {r['kept_gathers']:.0f}" if "kept_gathers" in r else "")
                      + (f" masters from RAM {100 * r['masters_from_ram']:.0f}%" if "masters_from_ram" in r else "")
                      + (f" staging allocated {r['staging_allocated']:.0f}" if "staging_allocated" in r else ""),
                      flush=True)
        extra = {}
        if fw == "tt":
            mem = engine.memory_report()
            extra["memory_report_gib"] = {k: getattr(mem, k) / GiB for k in ("params", "grads", "optimizer",
                                                                              "cpu_tier", "nvme_tier")}
        out.update(ok=True, rec=rec, extra=extra, rss_start_mib=rss0, train_peak_gib=_vm_hwm() / GiB,
                   n_params=gpt_config(spec["layers"]).num_parameters(),
                   swap_files_gib=sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(swap_dir)
                                      for f in fs) / GiB)
    except BaseException as e:  # noqa: BLE001
        out.update(error=f"{type(e).__name__}: {e}", tb=traceback.format_exc())
    gather_results(out, result_path)
    dist.barrier()
    dist.destroy_process_group()


def _reset_vm_hwm() -> None:
    """Restart VmHWM from the current RSS (Linux: 5 > /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _tt_counters(engine) -> dict[str, float]:
    """The engine's cumulative counters this bench reads per step."""
    waits = engine.wait_seconds()
    swapper = engine.swapper
    aio = swapper.aio
    return {"io_wait_s": waits["io"], "comm_wait_s": waits["comm"], "checksum_cpu_s": aio.cpu_seconds["checksum"],
            "copy_cpu_s": swapper.cpu_seconds["copy"] + getattr(engine.flat.shards, "copy_cpu_seconds", 0.0),
            "swap_in_bytes": swapper.stats["bytes_in"],
            "swap_out_bytes": swapper.stats["bytes_out"],
            "grads_wait_s": getattr(engine.update, "grads_wait_seconds", 0.0),
            "kept_gathers": float(getattr(engine.flat.shards, "values_reused", 0)),
            "staging_allocated": float(getattr(engine.flat.shards, "staging_allocated", 0))}


def launch(fw, spec, swap_root) -> list[dict]:
    swap_dir = os.path.join(swap_root, fw)
    shutil.rmtree(swap_dir, ignore_errors=True)
    os.makedirs(swap_dir, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=f"scale_{fw}_", suffix=".json")
    os.close(fd)
    try:
        spawn_ranks(worker, (2, free_port(), fw, spec, swap_dir, path), 2, spec["run_timeout"], fw)
        with open(path) as f:
            return json.load(f)
    except BaseException as e:  # noqa: BLE001
        return [{"rank": -1, "ok": False, "error": f"{type(e).__name__}: {str(e)[:3000]}"}]
    finally:
        os.unlink(path)
        shutil.rmtree(swap_dir, ignore_errors=True)


# ----------------------------------------------------------------------------- report


def summarize(fw: str, label: str, ranks: list[dict], bw: dict[str, float], ram: int) -> dict:
    if not all(r.get("ok") for r in ranks):
        bad = next(r for r in ranks if not r.get("ok"))
        return {"framework": fw, "size": label, "ok": False, "error": bad.get("error", "?"), "tb": bad.get("tb")}
    steps = len(ranks[0]["rec"])
    timed = list(range(1, steps)) if steps > 1 else [0]  # step 0 records stage 3's trace

    def per_step(key, agg):
        return [agg(r["rec"][i].get(key, 0.0) for r in ranks) for i in timed]
    med = statistics.median
    read, written = per_step("read", sum), per_step("written", sum)
    bounds = [a / (bw["read"] * 1e9) + b / (bw["write"] * 1e9) for a, b in zip(read, written)]
    walls = per_step("wall", max)
    n = ranks[0]["n_params"]
    row = {"framework": fw, "size": label, "ok": True, "n_params": n, "model_state_bytes": 16 * n,
           "states_over_ram": 16 * n / ram, "timed_steps": len(timed), "step_s": med(walls), "steps_s": walls,
           "read_gb": med(read) / 1e9, "written_gb": med(written) / 1e9, "io_bound_s": med(bounds),
           "cpu_s": med(per_step("cpu", max)), "peak_rss_gib": [r["rec"][-1]["rss_peak_gib"] for r in ranks],
           "setup_s": max(r["setup_s"] for r in ranks),
           "build_peak_gib": [r.get("build_peak_gib") for r in ranks], "train_peak_gib": [r.get("train_peak_gib") for r in ranks],
           "losses": [x["loss"] for x in ranks[0]["rec"]], "swap_files_gib": ranks[0].get("swap_files_gib", 0.0),
           "extra": ranks[0].get("extra", {})}
    row["step_over_bound"] = row["step_s"] / row["io_bound_s"] if row["io_bound_s"] else float("nan")
    for key in ("fwd", "bwd", "opt", "io_wait_s", "comm_wait_s", "grads_wait_s", "checksum_cpu_s", "copy_cpu_s", "opt_pass_s",
                "opt_io_wait_s", "opt_ready_wait_s", "opt_compute_s", "chunks_in_bwd", "kept_gathers",
                "masters_from_ram"):
        if key in ranks[0]["rec"][0]:
            row[key] = med(per_step(key, max))
    if "checksum_cpu_s" in row:
        cpu_both = med(per_step("cpu", sum))
        row["checksum_cpu_share"] = med(per_step("checksum_cpu_s", sum)) / cpu_both
        row["copy_cpu_share"] = med(per_step("copy_cpu_s", sum)) / cpu_both
    return row


def cpu_per_byte(mib: int = 32, repeat: int = 10) -> dict[str, float]:
    """GB/s of one thread for each checksum the swap layer offers (and crc32c where installed),
    and of the pool → tensor copy (memmove) into fresh and into reused pages."""
    import ctypes
    import zlib

    from tiertrain.io.aio import sum64

    data = torch.randn(mib << 18)
    mv = memoryview(data.numpy()).cast("B")
    funcs = {"sum64": sum64, "zlib.crc32": zlib.crc32}
    try:
        import xxhash
        funcs["xxh3 (default)"] = xxhash.xxh3_64_intdigest
    except ImportError:
        pass
    try:
        import crc32c
        funcs["crc32c"] = crc32c.crc32c
    except ImportError:
        pass
    out = {}
    for name, fn in funcs.items():
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn(mv)
        out[f"checksum {name}"] = repeat * mv.nbytes / (time.perf_counter() - t0) / 1e9
    big = torch.randn(40_000_000)  # 160 MB: a shard of a 2560-wide block at dp=2

    def copy_into(dst):
        ctypes.memmove(dst.data_ptr(), big.data_ptr(), big.numel() * 4)
    t0 = time.perf_counter()
    for _ in range(5):
        copy_into(torch.empty_like(big))
    out["copy into fresh pages"] = 5 * big.numel() * 4 / (time.perf_counter() - t0) / 1e9
    reused = torch.empty_like(big)
    copy_into(reused)
    t0 = time.perf_counter()
    for _ in range(5):
        copy_into(reused)
    out["copy into reused pages"] = 5 * big.numel() * 4 / (time.perf_counter() - t0) / 1e9
    return out


def predicted_step_s(n_params: int, bw: dict[str, float], masters_shared: bool = True,
                     masters_from_gathers: bool = True) -> float:
    """The estimator's IO lower bound of a step at this layout: the bytes its memory model puts on
    NVMe (parameters, fp32 masters and Adam moments, tiertrain/estimate/layout.py), each moved as
    ZeRO-Infinity moves them per step, over the measured bandwidth. ``masters_shared``: the fp32
    parameter shards are the optimizer's masters (from 6bc2922 on; before, a second copy was
    kept and written). ``masters_from_gathers``: the step takes the masters from backward's
    gathers and reads only the moments (after c60e567). The backward gathers served from the
    kept staging tensors (at most 2 units) are not subtracted."""
    from tiertrain.estimate.layout import engine_model_state_bytes

    ms = engine_model_state_bytes(n_params, 2, 3, "fp32", separate_master=not masters_shared)
    master = ms.params if masters_shared else ms.master
    step_reads_master = not (masters_shared and masters_from_gathers)
    reads = 2 * ms.params + master * step_reads_master + ms.optimizer  # parameters in forward and backward, the optimizer state
    writes = master + ms.optimizer + (0 if masters_shared else ms.params)  # the updated state (and parameters)
    return 2 * (reads / (bw["read"] * 1e9) + writes / (bw["write"] * 1e9))  # 2 ranks share the disk


def zero_overrides(pairs: list[str]) -> dict:
    """--zero KEY=VALUE options as a dict, each value read as YAML (6 → int, true → bool)."""
    import yaml

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--zero {pair!r}: expected KEY=VALUE, e.g. --zero nvme_buffers=6")
        out[key] = yaml.safe_load(value)
    return out


def revision() -> str:
    """The library's git revision, with + when tiertrain/ has uncommitted changes."""
    def git(*a):
        return subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain", "--", "tiertrain") else "")


def code(row: dict) -> str:
    """The revision a row was measured at, with tiertrain's zero options when not the defaults
    (--kept-units, --zero)."""
    kept = row.get("kept_units", 2)
    default = row.get("kept_default", 2)  # (the library's default then: 2 until 4 became it)
    overrides = "".join(f", {k}={v}" for k, v in (row.get("zero_overrides") or {}).items())
    return row.get("revision", EARLIER_REVISION) + (f", kept {kept}" if kept != default else "") + overrides


def latest(rows: list[dict]) -> dict:
    """(size, framework) -> the last successful row of it (rows are appended in run order), of
    those run with the library's defaults where there are any (not --kept-units or --zero)."""
    def default(r: dict) -> bool:
        return r.get("kept_units", 2) == r.get("kept_default", 2) and not r.get("zero_overrides")
    ok = [r for r in rows if r["ok"]]
    return {**{(r["size"], r["framework"]): r for r in ok}, **{(r["size"], r["framework"]): r for r in ok if default(r)}}


EARLIER_REVISION = "16b090c"
"""The revision of the rows recorded before rows carried one (2026-11-23/24, before the
optimizer's masters were shared with the parameter shards)."""


def render(data: dict) -> str:
    rows = data["rows"]
    L = ["# Scale: the largest model this machine trains, at the disk's speed (tiertrain vs DeepSpeed ZeRO-Infinity)",
         "", f"Command: `{data['command']}` — finished {data['date']}.", "",
         "## Machine", *[f"- {x}" for x in data["machine"]],
         f"- free disk in the swap directory at the start: {data['free_disk_gib']:.1f} GiB (`df`: `{data['df']}`)",
         f"- disk bandwidth (dd bs=8M O_DIRECT, 1 GiB, on the swap directory before each run — rows from 2026-11-24 "
         "06:30 on: the median of 3 probes, earlier rows: one probe; median over rows): read "
         f"{data['bw']['read']:.2f} GB/s, write {data['bw']['write']:.2f} GB/s", "",
         "## Setup",
         f"- GPT: hidden {HIDDEN}, {HEADS} heads, vocabulary {VOCAB}, sequence {SEQ}, no biases; 2 gloo ranks, 1 torch "
         "thread each, fp32, micro-batch 1 × 64 tokens per rank, the same tokens every step, AdamW (the learning "
         "rate in the table) without clipping or weight decay. Model states = 16 bytes per parameter (fp32 parameters, "
         "fp32 gradients, Adam moments; fp32 parameters are their own master).",
         "- tiertrain: ZeRO-3, parameters and optimizer state on NVMe, `zero.nvme_in_place`, built partitioned; "
         "DeepSpeed 0.19.8: ZeRO-3, `offload_param` and `offload_optimizer` on NVMe (bench/zero3_nvme.py's "
         "configuration), built under `deepspeed.zero.Init`, DeepSpeedCPUAdam.",
         "- step time: median over the steps after the first (the first records stage 3's trace) of the slower "
         "rank; read / written: `/proc/self/io` block-device bytes of both ranks; IO bound = read / read bw + "
         "written / write bw, with the bandwidths probed before that row's run; predicted = the estimator's "
         "NVMe bytes moved per step (tiertrain's layout) over the median bandwidths above (`predicted_step_s`).", "",
         "## Results", "",
         "Rows are in run order within each framework and size; `code` is the library's revision (the ratio table, "
         "the timeline and the plot use the last row of each size and framework).", "",
         "| size | framework | code | parameters | states / RAM | step (s) | predicted (s) | IO bound (s) | step / bound "
         "| read GB | written GB | CPU s (max rank) | peak RSS per rank (GiB) | setup (s) | lr | losses |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["framework"] != "tt", r.get("n_params") or 0, r["size"])):
        if not r["ok"]:
            L.append(f"| {r['size']} | {r['framework']} | {code(r)} | "
                     f"FAILED: {r['error'][:400]} |" + " |" * 12)
            continue
        predicted = (predicted_step_s(r["n_params"], data["bw"], r.get("masters_shared", False),
                                      r.get("masters_from_gathers", False))
                     if r["framework"] == "tt" else float("nan"))
        L.append(f"| {r['size']} | {r['framework']} | {code(r)} | {r['n_params'] / 1e9:.3f} B | {r['states_over_ram']:.2f} | "
                 f"{r['step_s']:.1f} | {predicted:.1f} | {r['io_bound_s']:.1f} | "
                 f"{r['step_over_bound']:.2f} | {r['read_gb']:.1f} | {r['written_gb']:.1f} | {r['cpu_s']:.1f} | "
                 f"{' / '.join(f'{x:.2f}' for x in r['peak_rss_gib'])} | {r['setup_s']:.0f} | {r.get('lr', 1e-5):g} | "
                 f"{' → '.join(f'{x:.3f}' for x in r['losses'])} |")
    measured = [r for r in rows if r["ok"] and any(r.get("train_peak_gib") or [])]
    if measured:
        L += ["", "## Memory per rank: building the model vs training (VmHWM, reset after the build; GiB)", "",
              "| size | framework | build peak | training peak |", "|---|---|---|---|"]
        for r in measured:
            L.append(f"| {r['size']} ({code(r)}) | {r['framework']} | "
                     f"{' / '.join(f'{x:.2f}' for x in r['build_peak_gib'])} | "
                     f"{' / '.join(f'{x:.2f}' for x in r['train_peak_gib'])} |")
    by = latest(rows)
    pairs = [(s, by[(s, "tt")], by[(s, "ds")]) for s in dict.fromkeys(r["size"] for r in rows)
             if (s, "tt") in by and (s, "ds") in by]
    if pairs:
        L += ["", "## tiertrain / DeepSpeed (target ≤ 0.7)", "", "| size | step | read bytes | written bytes | peak RSS |",
              "|---|---|---|---|---|"]
        for s, a, b in pairs:
            L.append(f"| {s} | {a['step_s'] / b['step_s']:.2f} | {a['read_gb'] / b['read_gb']:.2f} | "
                     f"{a['written_gb'] / b['written_gb']:.2f} | {max(a['peak_rss_gib']) / max(b['peak_rss_gib']):.2f} |")
    tt = sorted((r for r in rows if r["ok"] and r["framework"] == "tt"), key=lambda r: r["n_params"])
    if tt:
        L += ["", "## Where tiertrain's step goes (engine counters, median of the slower rank, seconds)", "",
              "fwd / bwd / opt: the engine's forward, backward and step calls; io wait: the training thread blocked "
              "on swap reads and writes; comm wait: on collectives; bwd waits for the optimizer: backward held at "
              "`zero.nvme_grads_in_ram_mb` until the step consumed gradients; optimizer pass: the NVMe optimizer's streaming "
              "(it starts in backward), of which io wait and ready wait (for gradients); chunks in bwd: share of the "
              "optimizer's chunks updated before step(); kept gathers: gathers that took a unit's values from the "
              "staging kept in RAM instead of the disk (zero.nvme_kept_units; '-': not counted then); masters from RAM: "
              "share of the optimizer's chunks whose master was taken from a gather's staging instead of read "
              "(OptimizerMasterShards; '-': before 528a162); checksum / copy CPU: share of both "
              "ranks' CPU time (the copies of masters in RAM counted from 115386b on; at 528a162 and c2a498a in wall "
              "time, which overstates them).", "",
              "| size | fwd | bwd | opt | io wait | comm wait | bwd waits for the optimizer | optimizer pass "
              "| its io wait | its ready wait | chunks in bwd | kept gathers | masters from RAM | checksum CPU | copy CPU |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in tt:
            L.append(f"| {r['size']} ({code(r)}) | {r['fwd']:.1f} | {r['bwd']:.1f} | {r['opt']:.1f} | {r['io_wait_s']:.1f} | "
                     f"{r['comm_wait_s']:.1f} | {r.get('grads_wait_s', 0.0):.1f} | {r['opt_pass_s']:.1f} | {r['opt_io_wait_s']:.1f} | "
                     f"{r['opt_ready_wait_s']:.1f} | {r['chunks_in_bwd']:.2f} | "
                     f"{'-' if 'kept_gathers' not in r else format(r['kept_gathers'], '.0f')} | "
                     f"{'-' if 'masters_from_ram' not in r else format(r['masters_from_ram'], '.0%')} | "
                     f"{100 * r['checksum_cpu_share']:.1f}% | "
                     f"{100 * r['copy_cpu_share']:.1f}% |")
    if data.get("cpu_per_byte"):
        L += ["", "## CPU per byte (one thread, GB/s; `--cpu-per-byte`)", "",
              "Why the swap layer hashes with XXH3 and reuses its staging tensors (tiertrain/io/aio.py, "
              "shard_store.py).", "", "| operation | GB/s |", "|---|---|"]
        L += [f"| {k} | {v:.2f} |" for k, v in data["cpu_per_byte"].items()]
    if data.get("notes"):
        L += ["", "## Notes", "", *[f"- {x}" for x in data["notes"]]]
    if data.get("plan_output"):
        L += ["", "## The plan of the largest size", "", f"`{data['plan_command']}`", "", "```",
              data["plan_output"].rstrip(), "```"]
    return "\n".join(L) + "\n"


def plot(data: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    last = list(latest(data["rows"]).values())
    for fw, style in (("tt", "o-"), ("ds", "s--")):
        rows = sorted((r for r in last if r["framework"] == fw), key=lambda r: r["n_params"])
        if not rows:
            continue
        x = [r["n_params"] / 1e9 for r in rows]
        name = {"tt": "tiertrain", "ds": "DeepSpeed"}[fw]
        axes[0].plot(x, [r["step_s"] for r in rows], style, label=f"{name} step")
        axes[0].plot(x, [r["io_bound_s"] for r in rows], ":", marker=style[0], alpha=0.6, label=f"{name} IO bound")
        axes[1].plot(x, [r["read_gb"] + r["written_gb"] for r in rows], style, label=name)
        axes[2].plot(x, [max(r["peak_rss_gib"]) for r in rows], style, label=name)
        older = [r for r in rows if r.get("revision", EARLIER_REVISION) == EARLIER_REVISION]
        if fw == "tt" and older and len(older) < len(rows):  # (the library changed between the rows)
            for ax, y in zip(axes, ([r["step_s"] for r in older], [r["read_gb"] + r["written_gb"] for r in older],
                                    [max(r["peak_rss_gib"]) for r in older])):
                ax.plot([r["n_params"] / 1e9 for r in older], y, "o", mfc="white", mec="C0", ms=9,
                        label=f"{name} at {EARLIER_REVISION} (a parameter copy of its own)")
    pred = sorted((r for r in last if r["framework"] == "tt"), key=lambda r: r["n_params"])
    if pred:
        axes[0].plot([r["n_params"] / 1e9 for r in pred],
                     [predicted_step_s(r["n_params"], data["bw"], r.get("masters_shared", False),
                                       r.get("masters_from_gathers", False)) for r in pred],
                     "k-.", label="estimator (median bandwidth)")
    axes[2].axhline(data["ram_gib"] / 2, color="grey", lw=0.8, label="RAM / 2 ranks")
    for ax, title, unit in zip(axes, ("step time", "bytes moved per step (both ranks)", "peak RSS per rank (training; hollow: build included)"),
                               ("s", "GB", "GiB")):
        ax.set_title(title)
        ax.set_xlabel("parameters (billions)")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="*", type=float, default=[0.5, 1, 2], help="parameters, in billions")
    p.add_argument("--plan", type=float, default=0.0,
                   help="also the largest size: model states ≥ this × RAM, tiertrain run from `tiertrain plan`'s config")
    p.add_argument("--plan-frameworks", nargs="+", default=["tt", "ds"])
    p.add_argument("--frameworks", nargs="+", default=["tt", "ds"], choices=["tt", "ds"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--plan-steps", type=int, default=5)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--swap-dir", default="/tmp/tiertrain-scale")
    p.add_argument("--timeout", type=float, default=1800, help="process-group timeout (s)")
    p.add_argument("--run-timeout", type=float, default=5400, help="kill one run's ranks after (s)")
    p.add_argument("--out", default=RESULTS, help="results path without extension (.md, .json, .png)")
    p.add_argument("--render", action="store_true", help="only re-render the .md and .png from the .json")
    p.add_argument("--ds-sub-group", type=int, default=100_000_000, help="DeepSpeed zero_optimization.sub_group_size")
    p.add_argument("--append", action="store_true",
                   help="add this run's rows (and command) to the existing .json instead of starting anew")
    p.add_argument("--cpu-per-byte", action="store_true",
                   help="with --render: measure the checksums' and copies' GB/s on one thread into the results")
    p.add_argument("--kept-units", type=int, default=None,
                   help="tiertrain's zero.nvme_kept_units (default: the library's)")
    p.add_argument("--zero", action="append", default=[], metavar="KEY=VALUE",
                   help="override one of tiertrain's zero options (repeatable; the value is read as YAML), "
                        "e.g. --zero nvme_buffers=6")
    p.add_argument("--note", action="append", default=[], help="a line for the Notes section (repeatable)")
    p.add_argument("--no-md", action="store_true")
    args = p.parse_args(argv)
    if args.render:
        with open(args.out + ".json") as f:
            data = json.load(f)
        data["notes"] = data.get("notes", []) + args.note
        if args.cpu_per_byte:
            data["cpu_per_byte"] = cpu_per_byte()
        with open(args.out + ".json", "w") as f:
            json.dump(data, f, indent=1, default=str)
        with open(args.out + ".md", "w") as f:
            f.write(render(data))
        plot(data, args.out + ".png")
        return 0
    os.makedirs(args.swap_dir, exist_ok=True)
    ram = meminfo("MemTotal")
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    df = subprocess.run(["df", "-h", args.swap_dir], capture_output=True, text=True).stdout.splitlines()[-1]
    data = {"command": cmd, "date": datetime.datetime.now().isoformat(timespec="minutes"), "args": vars(args),
            "machine": machine_lines(dirs=[args.swap_dir], packages=["deepspeed", "xxhash"]), "ram_gib": ram / GiB,
            "free_disk_gib": shutil.disk_usage(args.swap_dir).free / GiB, "df": " ".join(df.split()), "rows": [],
            "bandwidths": []}
    if args.append:
        with open(args.out + ".json") as f:
            earlier = json.load(f)
        data["rows"], data["bandwidths"] = earlier["rows"], earlier["bandwidths"]
        data["command"] = earlier["command"] + "` then `" + cmd
        data["machine"], data["free_disk_gib"], data["df"] = earlier["machine"], earlier["free_disk_gib"], earlier["df"]
        for key in ("plan_command", "plan_output", "notes", "cpu_per_byte"):
            if key in earlier:
                data[key] = earlier[key]
        data["wall_s_before"] = earlier.get("wall_s", 0.0)  # (which counts the runs before it)
    runs = [(f"{s:g} B", layers_for(s * 1e9), fw, args.steps, "") for s in args.sizes for fw in args.frameworks]
    if args.plan:
        layers = layers_for(args.plan * ram / 16)
        plan_yaml = os.path.join(args.swap_dir, "plan.yaml")
        plan_cmd = [sys.executable, "-m", "tiertrain.cli", "plan", "--layers", str(layers), "--hidden", str(HIDDEN),
                    "--heads", str(HEADS), "--vocab", str(VOCAB), "--seq", str(SEQ), "--no-bias", "--micro-batch",
                    str(args.micro_batch), "--precision", "fp32", "--nproc", "2", "--swap-dir", args.swap_dir,
                    "--out", plan_yaml]
        proc = subprocess.run(plan_cmd, capture_output=True, text=True)
        data["plan_command"] = "tiertrain " + " ".join(shlex.quote(a) for a in plan_cmd[3:])
        data["plan_output"] = proc.stdout + proc.stderr
        print(data["plan_output"], flush=True)
        label = f"{args.plan:g} × RAM"
        runs += [(label, layers, fw, args.plan_steps, plan_yaml if fw == "tt" else "") for fw in args.plan_frameworks]
    t_start = time.perf_counter()
    for label, layers, fw, steps, plan_config in runs:
        # The median of three probes: after an idle spell the first probe here ran at burst
        # speed (read 2.60, write 2.56 GB/s; the next two 2.28 / 0.88 and 1.34 / 0.96).
        probes = [dd_bandwidth(args.swap_dir, 1024) for _ in range(3)]
        bw = {k: statistics.median(p[k] for p in probes) for k in ("read", "write")}
        bw["probes"] = probes
        data["bandwidths"].append(bw)
        spec = {"label": label, "layers": layers, "steps": steps, "micro_batch": args.micro_batch, "lr": args.lr,
                "timeout": args.timeout, "run_timeout": args.run_timeout, "plan_config": plan_config,
                "ds_sub_group": args.ds_sub_group, "kept_units": args.kept_units,
                "zero_overrides": zero_overrides(args.zero), "ds_buffer_numel": -(-gpt_config(layers).hidden ** 2 * 4 // 2 // 2**20) * 2**20}
        print(f"== {label} ({layers} layers) {fw}: dd read {bw['read']:.2f} GB/s write {bw['write']:.2f} GB/s, "
              f"load {loadavg()}", flush=True)
        ranks = launch(fw, spec, args.swap_dir)
        row = summarize(fw, label, ranks, bw, ram)
        row["bw"] = bw
        row["lr"] = args.lr
        row["revision"] = revision()
        if row["ok"]:
            if fw == "tt":
                row["masters_shared"] = row["masters_from_gathers"] = True
                row["kept_default"] = ZeroConfig().nvme_kept_units
                row["kept_units"] = row["kept_default"] if args.kept_units is None else args.kept_units
                if spec["zero_overrides"]:
                    row["zero_overrides"] = spec["zero_overrides"]
                row["predicted_s"] = predicted_step_s(row["n_params"], bw)
            print(f"   step {row['step_s']:.1f} s, IO bound {row['io_bound_s']:.1f} s ({row['step_over_bound']:.2f}x), "
                  f"peak RSS {row['peak_rss_gib']}", flush=True)
        else:
            print(f"   FAILED: {row['error'][:2000]}\n{(row.get('tb') or '')[-3000:]}", flush=True)
        data["rows"].append(row)
        data["wall_s"] = time.perf_counter() - t_start + data.get("wall_s_before", 0.0)
        data["bw"] = {k: statistics.median(b[k] for b in data["bandwidths"]) for k in ("read", "write")}
        if not args.no_md:
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
            with open(args.out + ".json", "w") as f:
                json.dump(data, f, indent=1, default=str)
            with open(args.out + ".md", "w") as f:
                f.write(render(data))
    if not args.no_md:
        plot(data, args.out + ".png")
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
