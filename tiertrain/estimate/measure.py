"""Measure what a training rank really holds, to check the estimator against it, and the
process overhead the estimator adds on top of tensors (``tiertrain probe`` calibration).

:func:`measure` trains tiertrain's GPT with the engine for a few steps on N local gloo
ranks, started exactly as ``tiertrain train`` starts them (``tiertrain.launch``, fork, one
torch thread per core share), in a *fresh* Python process (so that no allocator state of
the caller is inherited), and reports per rank:

* ``baseline``: resident set (VmRSS) after torch, the process group and the batches exist,
  just before the model is built;
* ``build_peak``: the high-water mark (VmHWM) while the model is built and wrapped, less
  the baseline;
* ``peak``: VmHWM during training (reset with ``/proc/self/clear_refs`` after building),
  less the baseline — the figure the estimate of peak per-rank memory is checked against;
* ``report``: ``engine.memory_report()`` after the last step (params, grads, optimizer
  (fp32 master + Adam moments), cpu_tier);
* ``live_peak`` (``live=True`` only): the most tensor bytes alive at once, from
  torch.profiler's allocator events (slow; the profiler's own memory makes ``peak``
  meaningless in that mode).

Linux only (/proc). :func:`calibrate_overhead` derives the two overhead figures of
:class:`~tiertrain.estimate.overhead.HostOverhead` from two such runs.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["RunSpec", "measure", "calibrate_overhead", "predict", "status_bytes", "CALIBRATION_SPECS"]


@dataclass
class RunSpec:
    """One measured training run."""

    model: dict[str, Any]
    """GPTConfig fields (or {"preset": name, ...overrides})."""
    overrides: list[str] = field(default_factory=list)
    """Config overrides, as on the command line (``--zero.stage=3``)."""
    micro_batch: int = 2
    """batch.micro_batch_size."""
    steps: int = 4
    """Optimizer steps (the first creates Adam state; the peak settles from the second)."""
    ranks: int = 2
    """Local gloo ranks."""
    live: bool = False
    """Also record the live-tensor peak with torch.profiler (slow)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the measuring process (e.g. MALLOC_MMAP_THRESHOLD_)."""
    partitioned: bool = False
    """Build the model the way ``tiertrain train`` does at zero.stage=3 (untiled): directly in
    partitioned form (``tiertrain.zero.partitioned_init``); False builds it whole on every
    rank, as ``tiertrain train`` does at stages 0-2."""
    hf_config: dict[str, Any] | None = None
    """A Hugging Face config (``config.to_dict()``, with ``model_type``): train that model
    (its LM-head class, loss from ``labels``) instead of tiertrain's GPT; ``model`` then
    gives only ``seq_len`` and ``vocab_size``."""

    def hf(self):
        """The transformers config of an ``hf_config`` run."""
        from tiertrain.estimate.modules import load_hf_config
        from transformers import AutoConfig

        return load_hf_config(AutoConfig.for_model(**self.hf_config))

    def gpt_config(self):
        from tiertrain.models.gpt import GPTConfig

        if self.hf_config is not None:  # only seq_len and vocab_size are read
            return GPTConfig(vocab_size=self.hf_config["vocab_size"], seq_len=self.model["seq_len"])

        fields = dict(self.model)
        preset = fields.pop("preset", None)
        return GPTConfig.preset(preset, **fields) if preset else GPTConfig(**fields).validate()

    def config(self):
        from tiertrain.config import Config, load

        return load(Config, None, [f"--batch.micro_batch_size={self.micro_batch}", *self.overrides])


def status_bytes(key: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rank(spec_json: str) -> dict[str, Any]:
    """One rank of a measured run (inside the process group)."""
    import torch
    import torch.distributed as dist

    from tiertrain.wrapping import wrap
    from tiertrain.models.gpt import GPT
    from tiertrain.topology import Topology

    spec = RunSpec(**json.loads(spec_json))
    cfg = spec.config()
    g = spec.gpt_config()
    topo = Topology.build(cfg.parallel)
    gen = torch.Generator().manual_seed(topo.coord("dp"))  # (the ranks of a cp group share their samples)
    mb = spec.micro_batch
    batches = [{"input_ids": torch.randint(0, g.vocab_size, (mb, g.seq_len), generator=gen),
                "labels": torch.randint(0, g.vocab_size, (mb, g.seq_len), generator=gen)}
               for _ in range(spec.steps * cfg.batch.grad_accum_steps)]
    hf_class = None
    if spec.hf_config is not None:  # import the modeling code before the baseline, as GPT's is
        import transformers

        from tiertrain.estimate.modules import _kind

        hf = spec.hf()
        auto = {"decoder": transformers.AutoModelForCausalLM, "encoder": transformers.AutoModelForMaskedLM,
                "encoder-decoder": transformers.AutoModelForSeq2SeqLM}[_kind(hf)]
        hf_class = auto._model_mapping[type(hf)]
    gc.collect()
    dist.barrier()
    baseline = status_bytes("VmRSS")
    _reset_peak()
    prof = None
    if spec.live:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        prof.__enter__()
    torch.manual_seed(0)
    if hf_class is not None:
        model = hf_class._from_config(hf)
    elif spec.partitioned and cfg.zero.stage == 3:
        from tiertrain.zero.construct import partitioned_init

        with partitioned_init(topo):
            model = GPT(g)
    else:
        model = GPT(g)
    if cfg.parallel.cp > 1:
        from tiertrain.parallel.cp_plan import apply_context_parallel

        apply_context_parallel(model, topo, cfg.parallel.cp_algorithm, cfg.activations.loss_tile_tokens)
    construct_peak = status_bytes("VmHWM") - baseline
    handle = None
    if cfg.activations.checkpoint_every:
        from tiertrain.offload.activations import apply_activation_checkpointing

        handle = apply_activation_checkpointing(model, cfg.activations, device=topo.device)
    engine = wrap(model, cfg, topo)
    build_peak = status_bytes("VmHWM") - baseline
    after_build = status_bytes("VmRSS") - baseline
    _reset_peak()
    it = iter(batches)
    times = []
    for _ in range(spec.steps):
        t0 = time.perf_counter()
        engine.train_batch(it)
        times.append(time.perf_counter() - t0)
    peak = status_bytes("VmHWM") - baseline
    live_peak = None
    if prof is not None:
        prof.__exit__(None, None, None)
        events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                        if e.name() == "[memory]")
        live = live_peak = 0
        for _, nbytes in events:
            live += nbytes
            live_peak = max(live_peak, live)
    r = engine.memory_report()
    out = {"rank": topo.rank, "baseline": baseline, "construct_peak": construct_peak, "build_peak": build_peak,
           "after_build": after_build, "peak": peak,
           "after": status_bytes("VmRSS") - baseline, "live_peak": live_peak, "step_s": times,
           "report": {"params": r.params, "gathered_params": r.gathered_params, "grads": r.grads,
                      "optimizer": r.optimizer, "cpu_tier": r.cpu_tier, "total": r.total}}
    if handle is not None:
        out["checkpoint_peak_bytes"] = handle.memory().peak_bytes
    return out


def _main(spec_json: str) -> None:
    from tiertrain.launch import launch_local

    spec = RunSpec(**json.loads(spec_json))
    results = launch_local(_rank, spec.ranks, spec_json, timeout=600, deadline=1200)
    print("TIERTRAIN-MEASURE " + json.dumps(results), flush=True)


def measure(spec: RunSpec, timeout: float = 1500) -> list[dict[str, Any]]:
    """Run ``spec`` in a fresh Python process; the ranks' measurements in rank order."""
    env = dict(os.environ, **spec.env)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-m", "tiertrain.estimate.measure", json.dumps(asdict(spec))],
                          capture_output=True, text=True, env=env, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("TIERTRAIN-MEASURE "):
            return json.loads(line[len("TIERTRAIN-MEASURE "):])
    raise RuntimeError(f"measurement failed (exit {proc.returncode}): {proc.stderr[-3000:]}")


# --------------------------------------------------------------------------- prediction


def _override_dict(overrides: list[str]) -> dict[str, str]:
    out = {}
    for o in overrides:
        key, _, value = o.lstrip("-").partition("=")
        out[key] = value
    return out


def predict(spec: RunSpec, overhead: Any = None):
    """The estimate (:func:`tiertrain.estimate.estimate`, engine accounting) of ``spec``'s run."""
    from tiertrain.estimate.dims import ModelDims
    from tiertrain.estimate.layout import ZeroLayout
    from tiertrain.estimate.memory import estimate

    if spec.hf_config is not None:
        from tiertrain.estimate.modules import dims_of_hf_config

        dims = dims_of_hf_config(spec.hf(), spec.model["seq_len"])
        return estimate(dims, ZeroLayout.from_config(spec.config(), spec.ranks), overhead)
    dims = ModelDims.from_gpt_config(spec.gpt_config())
    return estimate(dims, ZeroLayout.from_config(spec.config(), spec.ranks), overhead)


# --------------------------------------------------------------------------- calibration

CALIBRATION_SPECS = {
    # tensors ≈ 0.5 MiB: the peak-RSS increase is the process overhead
    "framework": RunSpec(model=dict(n_layers=1, hidden=32, n_heads=2, seq_len=32), micro_batch=1,
                         overrides=["--zero.stage=0"], steps=3),
    # activations, buckets and reductions in flight: the allocator's share of transient bytes,
    # on a mid-sized GPT (18.9M parameters; tensors of 0.5–8 MiB, like the models planned here)
    "retention": RunSpec(model=dict(n_layers=6, hidden=512, n_heads=8, seq_len=256), micro_batch=4,
                         overrides=["--zero.stage=2"], steps=4),
}
"""The two runs :func:`calibrate_overhead` measures (2 gloo ranks, like ``tiertrain train``)."""


def calibrate_overhead(ranks: int = 2) -> dict[str, Any]:
    """Measure the process overhead of a training rank on this machine: ``framework_bytes``
    = peak-RSS increase of a run whose tensors are negligible, less them; ``retention`` =
    (peak-RSS increase − predicted tensor bytes − framework_bytes) / transient bytes at the
    peak, on a mid-sized GPT at stage 2 (the largest rank of each run). ~30 s on 2 cores."""
    from tiertrain.estimate.overhead import HostOverhead

    none = HostOverhead.none()
    out: dict[str, Any] = {}
    f_spec = CALIBRATION_SPECS["framework"]
    f_spec = RunSpec(**{**asdict(f_spec), "ranks": ranks})
    f_runs = measure(f_spec)
    f_tensors = predict(f_spec, none).total()
    framework = max(0, max(r["peak"] for r in f_runs) - f_tensors)
    r_spec = RunSpec(**{**asdict(CALIBRATION_SPECS["retention"]), "ranks": ranks})
    r_runs = measure(r_spec)
    est = predict(r_spec, none)
    states = sum(l.bytes for l in est.lines[:4])
    transient = est.total() - states
    measured = max(r["peak"] for r in r_runs)
    retention = max(0.0, (measured - est.total() - framework) / transient) if transient else 0.0
    out.update(framework_bytes=int(framework), retention=round(retention, 3),
               framework_run={"peak": [r["peak"] for r in f_runs], "tensors": f_tensors},
               retention_run={"peak": [r["peak"] for r in r_runs], "tensors": est.total(), "transient": transient})
    return out


if __name__ == "__main__":
    _main(sys.argv[1])
