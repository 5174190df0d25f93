#!/usr/bin/env python
"""The GPU check in one command (issue 31): the GPU suite, then tiertrain's tiers side by side with
plain PyTorch, FSDP2 and DeepSpeed on one GPU, written to a report with the machine described.

    python bench/gpu.py --out bench/results/gpu.md [--jsonl bench/results/gpu.jsonl]
    python bench/gpu.py --dry-run --out /tmp/gpu.md     # the same end to end on the CPU, no CUDA call

(a) ``pytest -m gpu tests/test_gpu.py`` in a subprocess (``--dry-run``: on the CPU, with
TIERTRAIN_GPU_TESTS_ON_CPU=1), summarised in the report. (b) Every row of the table in its own
subprocess with its own timeout, so a crash, a hang or an out-of-memory becomes a row naming its
error and never stops the table: the 1.28 B GPT of ../shared/gpu/RESULTS.md, bf16 with fp32
masters, AdamW, clip 1.0, micro-batch 8 × 1024, a few warm-up then timed steps, each phase
(forward, backward, optimizer step) timed between device synchronisations. The report and the
JSON lines are rewritten after every row, so a run cut off still leaves what it measured;
``--budget-s`` bounds the whole run (rows that no longer fit are reported as skipped).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, ROOT)  # (this checkout's tiertrain, whether or not it is installed)
from _common import GiB, machine_lines, sh  # noqa: E402
from gpu_report import issue36_sections  # noqa: E402

ROW_MARK = "GPU_BENCH_ROW "
"""The prefix of the one stdout line a row's subprocess reports its result on."""
PROGRESS_MARK = "GPU_BENCH_PROGRESS "
"""The prefix of the lines it reports its progress on (what a row cut off by its timeout had done)."""
ON_CPU_ENV = "TIERTRAIN_GPU_TESTS_ON_CPU"  # (tests/test_gpu.py's switch)

# The model of ../shared/gpu/RESULTS.md (1,275,793,408 parameters), and the dry run's tiny one.
GPU_MODEL = dict(vocab_size=32000, seq_len=1024, n_layers=24, hidden=2048, n_heads=16, bias=False)
DRY_MODEL = dict(vocab_size=128, seq_len=32, n_layers=2, hidden=64, n_heads=4, bias=False)
GPU_MICRO, DRY_MICRO = 8, 2
ADAMW = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
CLIP = 1.0


@dataclass(frozen=True)
class Row:
    label: str
    framework: str  # torch | fsdp2 | ds | tt
    options: dict = field(default_factory=dict)


# In the order they run: tiertrain's tiers before the offload baselines, so that a slow disk
# (the NVMe row) costs the comparison rows, not the project's own.
ROWS = {
    "torch-plain": Row("plain torch (autocast bf16, fused AdamW)", "torch"),
    "fsdp2": Row("FSDP2 (bf16 MixedPrecisionPolicy)", "fsdp2"),
    "tt-z0": Row("tiertrain stage 0", "tt", {"stage": 0}),
    "tt-z3": Row("tiertrain stage 3", "tt", {"stage": 3}),
    "tt-z2-optcpu": Row("tiertrain stage 2, optimizer on CPU", "tt", {"stage": 2, "offload_optimizer": "cpu"}),
    "tt-z3-bothcpu": Row("tiertrain stage 3, params+optimizer on CPU", "tt",
                         {"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu"}),
    "tt-z2-optcpu-overlap": Row("tiertrain stage 2, optimizer on CPU, step overlapped with backward", "tt",
                                {"stage": 2, "offload_optimizer": "cpu", "overlap_cpu_step": True}),
    "tt-z3-bothcpu-overlap": Row("tiertrain stage 3, params+optimizer on CPU, step overlapped with backward", "tt",
                                 {"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu",
                                  "overlap_cpu_step": True}),
    # The same two with the loss scaled by 1/32 (AdamW's update does not change, up to eps): the
    # gradient norm, ~5 at this random initialisation, falls below the clip as in steady-state
    # training, so the overlapped step's speculation can hold (each row says whether it did).
    "tt-z2-optcpu-overlap-below-clip": Row("tiertrain stage 2, optimizer on CPU, step overlapped with backward, "
                                           "loss × 1/32 (gradient norm below the clip)", "tt",
                                           {"stage": 2, "offload_optimizer": "cpu", "overlap_cpu_step": True,
                                            "loss_scale": 1 / 32}),
    "tt-z3-bothcpu-overlap-below-clip": Row("tiertrain stage 3, params+optimizer on CPU, step overlapped with "
                                            "backward, loss × 1/32 (gradient norm below the clip)", "tt",
                                            {"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu",
                                             "overlap_cpu_step": True, "loss_scale": 1 / 32}),
    "tt-z3-bothcpu-accum8": Row("tiertrain stage 3, params+optimizer on CPU, 8 micro-batches per step", "tt",
                                {"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu", "accum": 8}),
    "tt-z3-bothcpu-accum8-overlap": Row("tiertrain stage 3, params+optimizer on CPU, 8 micro-batches per step, "
                                        "step overlapped with backward, loss × 1/32 (gradient norm below the clip)",
                                        "tt", {"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu",
                                               "accum": 8, "overlap_cpu_step": True, "loss_scale": 1 / 32}),
    "tt-z2-optcpu-delayed": Row("tiertrain stage 2, optimizer on CPU, delayed update", "tt",
                                {"stage": 2, "offload_optimizer": "cpu", "delayed_update": True,
                                 "delayed_update_warmup": 0}),
    "tt-z3-bothcpu-delayed": Row("tiertrain stage 3, params+optimizer on CPU, delayed update", "tt",
                                 {"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu",
                                  "delayed_update": True, "delayed_update_warmup": 0}),
    "tt-z3-bothnvme": Row("tiertrain stage 3, params+optimizer on NVMe", "tt",
                          {"stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme"}),
    "fsdp2-cpuoffload": Row("FSDP2 CPUOffloadPolicy", "fsdp2", {"offload": True}),
    "ds-z3": Row("DeepSpeed ZeRO-3", "ds", {"stage": 3}),
    "ds-z2-optcpu": Row("DeepSpeed ZeRO-2, optimizer on CPU", "ds", {"stage": 2, "offload_optimizer": "cpu"}),
}
NVME_BYTES_PER_PARAM = {False: 2 + 24, True: 2 + 12}
"""Disk a parameter takes with both tiers on NVMe: its bf16 shard, and the fp32 master and two
moments, twice unless zero.nvme_in_place (the optimizer writes a second generation and commits it)."""


# -- one row, in its own process --------------------------------------------------------------------

class Phases:
    """Wall time of each phase between device synchronisations (nothing to wait for on the CPU)."""

    def __init__(self, sync):
        self.sync = sync
        self.times: dict[str, list[float]] = {}

    def __call__(self, name: str, fn):
        self.sync()
        t = time.perf_counter()
        out = fn()
        self.sync()
        self.times.setdefault(name, []).append(time.perf_counter() - t)
        return out


def _row_main(args) -> dict:
    """Build, warm up and time one row; returns its result (the caller prints it)."""
    row = ROWS[args.row]
    if row.framework == "ds":
        # Before torch: a missing DeepSpeed is a row of its own, not an error.
        if args.dry_run:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            import deepspeed  # noqa: F401
        except Exception as e:  # noqa: BLE001 (any failure to import is "not importable")
            return {"status": "missing", "error": f"{type(e).__name__}: {e}"}
    import torch

    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run to exercise the script on the CPU")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model_kw = DRY_MODEL if args.dry_run else GPU_MODEL
    micro = DRY_MICRO if args.dry_run else GPU_MICRO
    phases = Phases(sync)
    t0 = time.perf_counter()
    step = {"torch": _torch_row, "fsdp2": _fsdp2_row, "ds": _ds_row, "tt": _tt_row}[row.framework](
        row.options, device, model_kw, micro, phases, args)
    build_s = time.perf_counter() - t0
    print(PROGRESS_MARK + json.dumps({"built_s": round(build_s, 1)}), flush=True)
    g = torch.Generator().manual_seed(1)
    n_steps = args.warmup + args.steps
    batches = []
    for _ in range(n_steps):
        t = torch.randint(0, model_kw["vocab_size"], (micro, model_kw["seq_len"] + 1), generator=g)
        batches.append({"input_ids": t[:, :-1].to(device), "labels": t[:, 1:].to(device)})
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for b in batches:
        sync()
        t = time.perf_counter()
        losses.append(step(b))
        sync()
        times.append(time.perf_counter() - t)
        print(PROGRESS_MARK + json.dumps({"step_s": round(times[-1], 3), "loss": round(losses[-1], 4)}), flush=True)
    trace = _trace_one_step(step, batches[-1], args.trace_file, sync) if args.trace_file else None
    timed = times[args.warmup:]
    step_s = statistics.median(timed)
    from tiertrain.models.gpt import GPT, GPTConfig

    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(GPTConfig(**model_kw)).parameters())
    tokens = micro * model_kw["seq_len"] * row.options.get("accum", 1)
    # Megatron's count: 6N per token for the weights' matmuls, 12·L·h·s for attention's own.
    flops = (6 * n + 12 * model_kw["n_layers"] * model_kw["hidden"] * model_kw["seq_len"]) * tokens
    import resource

    return {"status": "ok", "device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)",
            "params": n, "build_s": round(build_s, 1), "step_s": round(step_s, 4),
            "steps_s": [round(x, 4) for x in times], "warmup": args.warmup, "timed": args.steps,
            "tokens_per_s": round(tokens / step_s, 1), "tflops": round(flops / step_s / 1e12, 2),
            "mfu": round(flops / step_s / 1e12 / args.peak_tflops, 4),
            "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / GiB, 2) if cuda else None,
            "host_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB, 2),
            "phases_s": {k: round(statistics.median(v[-args.steps:]), 4) for k, v in phases.times.items()},
            "losses": [round(x, 4) for x in losses], **({"trace": trace} if trace else {}), **_engine_facts(step)}


def _engine_facts(step) -> dict:
    """A tiertrain row's last gradient norm, build split and compile times and, stepping
    overlapped with backward, how many steps kept their speculative update
    (tiertrain.update.overlapped_host)."""
    engine = getattr(step, "engine", None)
    if engine is None:
        return {}
    facts = {"grad_norm": round(float(engine.last_grad_norm), 4), **step.build,
             "compiles_s": [round(x, 1) for x in step.compiles]}
    speculation = getattr(engine.update, "speculation", None)
    if speculation is not None:
        facts["speculation"] = dict(speculation)
        facts["last_overlapped_step"] = getattr(engine.update, "last_overlapped_step", None)
    return facts


def _trace_one_step(step, batch, path: str, sync) -> dict:
    """One more step (after the timed ones: the profiler slows it) recorded as a Chrome trace
    with the engine's spans and the device's kernels (tiertrain.observe.trace), gzipped to path."""
    import gzip

    from tiertrain.observe.trace import StepTrace, load_spans

    plain = path[:-len(".gz")] if path.endswith(".gz") else path
    try:
        trace = StepTrace(plain, steps=1)
        trace.before_step(1)
        t = time.perf_counter()
        step(batch)
        sync()
        traced_s = time.perf_counter() - t
        trace.after_step(1)
        spans = len(load_spans(plain))
        if plain != path:
            with open(plain, "rb") as src, gzip.open(path, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(plain)
        return {"file": os.path.basename(path), "spans": spans, "traced_step_s": round(traced_s, 4)}
    except Exception as e:  # noqa: BLE001 (a trace that fails is said so; the row's timings stand)
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def _build_gpt(model_kw, device):
    import torch
    from tiertrain.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    with torch.device(device):
        return GPT(GPTConfig(**model_kw))


def _init_group(device) -> None:
    """A process group of one (NCCL on the GPU, gloo on the CPU), torchrun-style environment."""
    import torch
    import torch.distributed as dist

    from _common import free_port

    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def _adamw(params, fused: bool):
    import torch

    return torch.optim.AdamW(params, **ADAMW, **({"fused": True} if fused else {}))


def _torch_row(options, device, model_kw, micro, phases, args):
    import torch

    model = _build_gpt(model_kw, device)
    opt = _adamw(model.parameters(), fused=device.type == "cuda")

    def forward(b):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return model(**b)
    return _plain_step(model, opt, forward, phases)


def _plain_step(model, opt, forward, phases):
    """One step of a plain torch loop (forward, backward, clip, AdamW), each phase timed."""
    import torch

    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step(b):
        loss = phases("fwd", lambda: forward(b))
        phases("bwd", loss.backward)
        phases("step", update)
        return float(loss)
    return step


def _fsdp2_row(options, device, model_kw, micro, phases, args):
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    _init_group(device)
    model = _build_gpt(model_kw, device)
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if options.get("offload"):
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    # (With the CPU offload the parameters and the step live on the CPU: torch's fused CPU AdamW
    # there, as a user of CPUOffloadPolicy would choose; the first GPU run's script did too.)
    opt = _adamw(model.parameters(), fused=True)
    return _plain_step(model, opt, lambda b: model(**b), phases)


def _ds_row(options, device, model_kw, micro, phases, args):
    import deepspeed

    _init_group(device)
    zero = {"stage": options["stage"], "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e8, "stage3_param_persistence_threshold": 1e6}
    pin = device.type == "cuda"
    if options.get("offload_optimizer"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    ds_cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "zero_optimization": zero, "gradient_clipping": CLIP, "zero_allow_untested_optimizer": True,
              # a client torch AdamW: no DeepSpeed op is compiled (none can be without a network)
              "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if options["stage"] == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds_cfg):
            model = _build_gpt(model_kw, "cpu")
    else:
        model = _build_gpt(model_kw, device)
    opt = _adamw(model.parameters(), fused=device.type == "cuda" and not options.get("offload_optimizer"))
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg)

    def step(b):
        loss = phases("fwd", lambda: engine(**b))
        phases("bwd", lambda: engine.backward(loss))
        phases("step", engine.step)
        return float(loss)
    return step


def _tt_row(options, device, model_kw, micro, phases, args):
    import tiertrain

    _init_group(device)
    cfg = tiertrain.Config()
    accum, loss_scale = options.get("accum", 1), options.get("loss_scale", 1.0)
    for key, value in options.items():
        if key not in ("accum", "loss_scale"):  # (the loop's, not the engine's)
            setattr(cfg.zero, key, value)
    cfg.batch.grad_accum_steps = accum
    if "nvme" in options.values():
        cfg.zero.nvme_path = args.nvme_dir
        cfg.zero.nvme_in_place = args.nvme_in_place
    cfg.precision.dtype = "bf16"
    cfg.batch.micro_batch_size = micro
    for key, value in ADAMW.items():
        setattr(cfg.optimizer, key, value)
    cfg.optimizer.weight_decay_on = "all"  # (as torch's AdamW over model.parameters() does)
    cfg.optimizer.grad_clip = CLIP
    cfg.validate()
    # Stage 3 builds the model in host memory and partitions it at wrap (the path the first GPU
    # run crashed on with the NVMe tiers); stages 0-2 build it on the device.
    compiles = _time_compiles()
    t = time.perf_counter()
    model = _build_gpt(model_kw, device if options.get("stage", 0) < 3 else "cpu")
    model_s = time.perf_counter() - t
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel, device=device))
    # (the build's parts: the model's own init, and wrap, of which compiling the CPU-tier pass)
    build = {"model_s": round(model_s, 1), "wrap_s": round(time.perf_counter() - t - model_s, 1),
             "compile_in_wrap_s": round(sum(compiles), 1)}
    print(PROGRESS_MARK + json.dumps({"plan": engine.plan.describe(), **build}), flush=True)

    def step(b):
        for _ in range(accum):  # (the same micro-batch each time: a step's timing, not its learning)
            loss = phases("fwd", lambda: engine(b))
            phases("bwd", lambda: engine.backward(loss * loss_scale if loss_scale != 1.0 else loss))
        phases("step", engine.step)
        return float(loss)
    step.engine, step.build, step.compiles = engine, build, compiles  # (for the row's facts)
    return step


def _time_compiles() -> list[float]:
    """Seconds of each compile of the CPU-tier AdamW kernels from now on in this process (a
    diagnostic: tiertrain.update.host_adamw's kernel cache, timed where it misses)."""
    from tiertrain.update import host_adamw

    compiles, kernels = [], host_adamw._kernels

    def timed(*args, **kwargs):
        misses = kernels.cache_info().misses
        t = time.perf_counter()
        kernel = kernels(*args, **kwargs)
        if kernels.cache_info().misses > misses:
            compiles.append(time.perf_counter() - t)
        return kernel
    host_adamw._kernels = timed
    return compiles


# -- the driver -----------------------------------------------------------------------------------

def _run(cmd: list[str], timeout_s: float, env: dict | None, log) -> tuple[object, str]:
    """(returncode or "timeout", combined output) of cmd; on timeout its whole process group is
    killed (a row's own children too). The output also goes to log."""
    log.write(f"\n===== {shlex.join(cmd)} (timeout {timeout_s:.0f} s)\n")
    log.flush()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(timeout_s, 1))
        rc: object = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = "timeout"
    log.write(out or "")
    log.write(f"\n===== rc={rc}\n")
    log.flush()
    return rc, out or ""


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith((ROW_MARK, PROGRESS_MARK))]
    return lines[-1][:300] if lines else "(no output)"


def _pytest(args, log) -> dict:
    env = dict(os.environ)
    if args.dry_run:
        env[ON_CPU_ENV] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py", "-p", "no:cacheprovider",
           "--durations=5"]
    t = time.monotonic()
    rc, out = _run(cmd, args.pytest_timeout, env, log)
    lines = out.splitlines()
    summary = next((ln.strip("= ") for ln in reversed(lines)
                    if any(w in ln for w in (" passed", " failed", " error", " skipped", "no tests ran"))), None)
    if rc == "timeout":
        summary = f"timed out after {args.pytest_timeout:.0f} s" + (f" (last: {summary})" if summary else "")
    notes = [ln for ln in lines if ln.startswith(("FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS"))]
    return {"command": ("TIERTRAIN_GPU_TESTS_ON_CPU=1 " if args.dry_run else "") + shlex.join(cmd[2:]),
            "rc": rc, "summary": summary or f"no summary line (rc {rc}): {_last_line(out)}",
            "notes": notes, "tail": lines[-60:], "wall_s": round(time.monotonic() - t, 1)}


def _row_in_subprocess(name: str, args, swap_dir: str, timeout_s: float, log, in_place: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--row", name, "--warmup", str(args.warmup),
           "--steps", str(args.steps), "--peak-tflops", str(args.peak_tflops), "--nvme-dir", swap_dir]
    if args.dry_run:
        cmd.append("--dry-run")
    if in_place:
        cmd.append("--nvme-in-place")
    if name in args.trace:
        cmd += ["--trace-file", os.path.join(os.path.dirname(os.path.abspath(args.out)), f"trace-{name}.json.gz")]
    t = time.monotonic()
    rc, out = _run(cmd, timeout_s, None, log)
    lines = out.splitlines()
    line = next((ln for ln in reversed(lines) if ln.startswith(ROW_MARK)), None)
    if line is not None:
        result = json.loads(line[len(ROW_MARK):])
    else:
        progress = [json.loads(ln[len(PROGRESS_MARK):]) for ln in lines if ln.startswith(PROGRESS_MARK)]
        built = next((p["built_s"] for p in progress if "built_s" in p), None)
        steps = [p["step_s"] for p in progress if "step_s" in p]
        done = ("not built" if built is None else f"built in {built} s, {len(steps)} steps done"
                + (f" ({', '.join(f'{x:.2f}' for x in steps)} s)" if steps else ""))
        if rc == "timeout":
            result = {"status": "timeout", "error": f"killed after {timeout_s:.0f} s, {done}; last output: "
                                                    f"{_last_line(out)}", "progress": progress}
        else:
            result = {"status": "error", "error": f"rc {rc}, {done}: {_last_line(out)}", "progress": progress}
    return {"name": name, "label": ROWS[name].label, **result, "wall_s": round(time.monotonic() - t, 1)}


def _nvme_room(args) -> tuple[str | None, str | None]:
    """(why the NVMe row cannot run on this disk, or None; a note when it runs with
    zero.nvme_in_place because only that fits, else None)."""
    model_kw = DRY_MODEL if args.dry_run else GPU_MODEL
    h, layers, v, s = model_kw["hidden"], model_kw["n_layers"], model_kw["vocab_size"], model_kw["seq_len"]
    params = v * h + s * h + layers * (12 * h * h + 2 * h) + h  # (the GPT's count: tied head, no biases)
    need = {in_place: params * per_param * 1.1 for in_place, per_param in NVME_BYTES_PER_PARAM.items()}
    try:
        free = shutil.disk_usage(args.nvme_dir).free
    except OSError as e:
        return f"not run: cannot tell the free space of {args.nvme_dir}: {e}", None
    if free >= need[False]:
        return None, None
    if free >= need[True]:
        return None, (f"zero.nvme_in_place: {free / GiB:.0f} GiB free, the default needs "
                      f"{need[False] / GiB:.0f} GiB")
    return (f"not run: {args.nvme_dir} has {free / GiB:.1f} GiB free, the NVMe tiers need about "
            f"{need[True] / GiB:.1f} GiB even in place (pass --nvme-dir on a larger disk)"), None


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _table_line(r: dict) -> str:
    if r.get("status") != "ok":
        what = {"missing": "not importable", "timeout": "timeout", "skipped": "skipped",
                "pending": "pending"}.get(r.get("status"), "error")
        reason = str(r.get("error", "")).replace("|", "\\|")
        return f"| {r['label']} | {what}: {reason} | | | | | | | | | {_fmt(r.get('wall_s'), '.0f')} |"
    p = r["phases_s"]
    phases = " / ".join(f"{p[k]:.3f}" if k in p else "?" for k in ("fwd", "bwd", "step"))
    loss = f"{r['losses'][0]:.3f} → {r['losses'][-1]:.3f}"
    return (f"| {r['label']} | ok | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f} % | "
            f"{r['tflops']:.1f} | {_fmt(r['peak_gpu_gib'], '.1f') or 'n/a'} | {r['host_rss_gib']:.1f} | {phases} | "
            f"{loss} | {r['wall_s']:.0f} |")


def _report(args, machine: list[str], suite: dict | None, rows: list[dict], started: float, done: bool) -> str:
    model_kw = DRY_MODEL if args.dry_run else GPU_MODEL
    micro = DRY_MICRO if args.dry_run else GPU_MICRO
    title = "GPU check" + (" — DRY RUN on the CPU (no CUDA call; numbers mean nothing)" if args.dry_run else "")
    out = [f"# {title}", "",
           f"Started {datetime.datetime.fromtimestamp(started, datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
           f"{'finished' if done else 'still running (partial report)'} after {time.time() - started:.0f} s "
           f"(budget {args.budget_s:.0f} s). Written by `bench/gpu.py` (issue 31).", "",
           f"Command: `{args.command}`", "", "## Machine", "", "```", *machine, "```", ""]
    if suite is None:
        out += ["## GPU suite: not run" + (" (--skip-pytest)" if args.skip_pytest else " yet"), ""]
    else:
        out += [f"## `{suite['command']}`: {suite['summary']}", "",
                f"rc {suite['rc']}, {suite['wall_s']:.0f} s."]
        out += [f"- {n}" for n in suite["notes"]]
        if suite["rc"] != 0:
            out += ["", "<details><summary>last lines of its output</summary>", "", "```", *suite["tail"], "```",
                    "", "</details>"]
        out.append("")
    n_tokens = micro * model_kw["seq_len"]
    out += ["## Side by side", "",
            f"GPT {model_kw} (tiertrain.models.gpt); micro-batch {micro} × {model_kw['seq_len']} = {n_tokens:,} "
            f"tokens per step, no accumulation; bf16 compute with fp32 master weights; AdamW lr {ADAMW['lr']:g} betas "
            f"{ADAMW['betas']} weight decay {ADAMW['weight_decay']} on every parameter; clip {CLIP}. One process, one "
            f"device, each row in its own subprocess. Median of {args.steps} timed steps after {args.warmup} warm-up. "
            f"MFU against {args.peak_tflops:g} TFLOP/s, FLOPs per token 6N + 12·L·h·s. Phases: forward, backward, "
            f"optimizer step (tiertrain: engine(batch), engine.backward(loss), engine.step()), each timed between "
            f"device synchronisations (which the step time includes). Peak GPU: torch.cuda.max_memory_allocated "
            f"over the steps; host RSS: the process's peak (model build included). Row s: the subprocess's wall "
            f"time, model build included.", "",
            "| config | status | step s | tokens/s | MFU | TFLOP/s | peak GPU GiB | host RSS GiB | "
            "fwd / bwd / step s | loss first → last | row s |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    out += [_table_line(r) for r in rows]
    out += issue36_sections(rows)
    return "\n".join(out) + "\n"


def _machine(args) -> list[str]:
    lines = []
    smi = shutil.which("nvidia-smi")
    if smi:
        lines.append("nvidia-smi: " + sh("nvidia-smi --query-gpu=name,memory.total,driver_version "
                                         "--format=csv,noheader", timeout=30))
    else:
        lines.append("nvidia-smi: not found")
    if not args.dry_run:  # what torch sees (in a subprocess: the driver makes no CUDA call)
        probe = ("import torch; p = torch.cuda.get_device_properties(0); "
                 "print(f'torch {torch.__version__}, CUDA {torch.version.cuda}: {p.name}, "
                 "{p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}')")
        lines.append("torch sees: " + sh(f"{shlex.quote(sys.executable)} -c {shlex.quote(probe)} 2>&1 | tail -1",
                                         timeout=120))
    lines += machine_lines(packages=("transformers", "deepspeed"))
    lines.append(f"tiertrain revision: {args.revision}")
    df = sh(f"df -h {shlex.quote(args.nvme_dir)} | tail -1")
    lines.append(f"NVMe row's swap directory: {args.nvme_dir} (`df -h`: {df})")
    return lines


def _revision() -> str:
    rev = sh(f"git -C {shlex.quote(ROOT)} rev-parse --short HEAD 2>/dev/null")
    if not rev or rev.startswith("("):
        return "unknown (no git here: pass --revision)"
    dirty = sh(f"git -C {shlex.quote(ROOT)} status --porcelain --untracked-files=no 2>/dev/null")
    return rev + (" + uncommitted changes" if dirty else "")


def _driver(args) -> int:
    started = time.time()
    deadline = time.monotonic() + args.budget_s
    names = list(ROWS) if not args.only else args.only
    for n in names:
        if n not in ROWS:
            raise SystemExit(f"--only: unknown row {n!r}; rows: {', '.join(ROWS)}")
    own_nvme = not args.nvme_dir
    if own_nvme:
        args.nvme_dir = tempfile.mkdtemp(prefix="tiertrain-gpu-nvme-")
    else:
        try:
            os.makedirs(args.nvme_dir, exist_ok=True)
        except OSError as e:
            raise SystemExit(f"--nvme-dir {args.nvme_dir!r} is not a usable directory: {e}") from e
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    jsonl = args.jsonl or os.path.splitext(args.out)[0] + ".jsonl"
    log_path = os.path.splitext(args.out)[0] + ".log"
    machine = _machine(args)
    rows = [{"name": n, "label": ROWS[n].label, "status": "pending", "error": "not run yet"} for n in names]
    suite = None

    def write(done=False):
        text = _report(args, machine, suite, rows, started, done)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.out)  # (a reader never sees half a report)

    try:
        with open(log_path, "w") as log, open(jsonl, "w") as records:
            write()
            if not args.skip_pytest:
                suite = _pytest(args, log)
                records.write(json.dumps({"pytest": suite}) + "\n")
                records.flush()
                print(f"pytest: {suite['summary']}", flush=True)
                write()
            for i, name in enumerate(names):
                left = deadline - time.monotonic()
                reason = note = None
                if left < args.min_row_s:
                    reason = f"the budget of {args.budget_s:.0f} s was spent"
                elif "nvme" in ROWS[name].options.values():
                    reason, note = _nvme_room(args)
                if reason is not None:
                    rows[i] = {"name": name, "label": ROWS[name].label, "status": "skipped", "error": reason}
                else:
                    # (each row's swap files in a directory of its own, removed after it: a row
                    # killed by its timeout leaves them behind)
                    swap = tempfile.mkdtemp(prefix=f"{name}-", dir=args.nvme_dir)
                    try:
                        rows[i] = _row_in_subprocess(name, args, swap, min(args.row_timeout, left), log,
                                                     in_place=note is not None)
                    finally:
                        shutil.rmtree(swap, ignore_errors=True)
                    if note is not None:
                        rows[i]["label"] += f" ({note})"
                records.write(json.dumps(rows[i]) + "\n")
                records.flush()
                print(_table_line(rows[i]), flush=True)
                write()
            write(done=True)
    finally:
        if own_nvme:
            shutil.rmtree(args.nvme_dir, ignore_errors=True)
    print(f"report: {args.out}; JSON lines: {jsonl}; subprocess output: {log_path}", flush=True)
    failed = (suite is not None and suite["rc"] != 0) or any(r["status"] in ("error", "timeout") for r in rows)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(HERE, "results", "gpu.md"), help="the markdown report")
    p.add_argument("--jsonl", default=None, help="one JSON line per row (default: beside --out)")
    p.add_argument("--dry-run", action="store_true",
                   help="on the CPU, no CUDA call: a tiny GPT over gloo, the GPU suite with " + ON_CPU_ENV + "=1")
    p.add_argument("--only", default="", help="comma-separated rows: " + ", ".join(ROWS))
    p.add_argument("--skip-pytest", action="store_true", help="the table only")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per row (default 2; dry run 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per row (default 3; dry run 1)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the MFU's peak (H100/H200 SXM dense bf16)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="the whole run's wall-time budget; rows that no longer fit are skipped")
    p.add_argument("--row-timeout", type=float, default=150.0, help="most seconds one row may take")
    p.add_argument("--min-row-s", type=float, default=20.0, help="a row is not started with less budget left")
    p.add_argument("--pytest-timeout", type=float, default=180.0, help="most seconds the GPU suite may take")
    p.add_argument("--nvme-dir", default="", help="the NVMe row's swap directory (default: a new temp dir)")
    p.add_argument("--revision", default=None, help="the project's revision, for machines without its git")
    p.add_argument("--trace", default="", help="comma-separated rows that also record one more step as a Chrome "
                                               "trace, trace-<row>.json.gz beside --out (tiertrain plot draws it)")
    p.add_argument("--trace-file", default=None, help=argparse.SUPPRESS)  # (internal: the row's trace)
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)  # (internal: run one row, print its result)
    p.add_argument("--nvme-in-place", action="store_true", help=argparse.SUPPRESS)  # (internal: the disk is small)
    args = p.parse_args(argv)
    args.warmup = (1 if args.dry_run else 2) if args.warmup is None else args.warmup
    args.steps = (1 if args.dry_run else 3) if args.steps is None else args.steps
    if args.warmup < 0 or args.steps < 1:
        p.error("--warmup must be >= 0 and --steps >= 1")
    if args.peak_tflops <= 0:
        p.error(f"--peak-tflops must be positive, got {args.peak_tflops}")
    if args.row is not None:
        if args.row not in ROWS:
            p.error(f"--row: unknown row {args.row!r}")
        print(ROW_MARK + json.dumps(_row_main(args)), flush=True)
        sys.stderr.flush()
        # Exit without tearing down: the result is out, and a teardown (engine.close() gathers the
        # masters, NCCL's destroy, DeepSpeed's threads) costs budget or may hang at exit. The
        # driver removes the row's swap directory.
        os._exit(0)
    args.only = [n.strip() for n in args.only.split(",") if n.strip()]
    args.trace = [n.strip() for n in args.trace.split(",") if n.strip()]
    for name in args.trace:
        if name not in ROWS or ROWS[name].framework != "tt":
            p.error(f"--trace: {name!r} is not a tiertrain row; tiertrain rows: "
                    + ", ".join(n for n, r in ROWS.items() if r.framework == "tt"))
    args.revision = args.revision or _revision()
    args.command = shlex.join(["python", "bench/gpu.py", *(sys.argv[1:] if argv is None else argv)])
    return _driver(args)


if __name__ == "__main__":
    sys.exit(main())
