"""What the training loop records (tiertrain/trainer/loop.py): the window of steps between
two metrics records (losses, tokens, time by phase less the waits inside it), the
gathering of every data-parallel rank's numbers, the progress bar's postfix and the
end-of-run summary."""
from __future__ import annotations

import contextlib
import math
import os
import resource
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Window", "gather_over_dp", "local_ranks", "finite_or_none", "postfix", "format_summary",
           "peak_rss_bytes"]


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class Window:
    """What happened since the last record: losses, tokens, and time by phase (the waits
    are the engine's cumulative wait clocks, differenced)."""

    PHASES = ("data", "forward", "backward", "optimizer", "schedule")

    def __init__(self, engine):
        self.engine = engine
        self.loss_sum = 0.0
        """Sum over the window's steps of each step's mean micro-batch loss."""
        self.tokens = 0
        self.steps = 0
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.started = time.perf_counter()
        self.waits_at_start = engine.wait_seconds()

    @contextlib.contextmanager
    def timing(self, phase: str):
        """Time a phase, less the waits inside it (counted as waits): the phases and the
        waits add up to the step time."""
        t0, w0 = time.perf_counter(), sum(self.engine.wait_seconds().values())
        try:
            yield
        finally:
            waited = sum(self.engine.wait_seconds().values()) - w0
            self.seconds[phase] += time.perf_counter() - t0 - waited

    @contextlib.contextmanager
    def excluded(self):
        """Leave what runs inside (an evaluation) out of the window: its time and its waits."""
        t0, w0 = time.perf_counter(), self.engine.wait_seconds()
        try:
            yield
        finally:
            self.started += time.perf_counter() - t0
            w1 = self.engine.wait_seconds()
            self.waits_at_start = {k: v + w1[k] - w0[k] for k, v in self.waits_at_start.items()}

    def add_loss(self, mean_loss: float, tokens: int) -> None:
        self.loss_sum += mean_loss
        self.tokens += tokens
        self.steps += 1

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def times(self) -> dict[str, float]:
        """Seconds by phase over the window (only the phases that ran), and the waits."""
        out = {k: v for k, v in self.seconds.items() if v or k != "schedule"}
        if self.engine.topology.size("pp") > 1:
            out = {k: v for k, v in out.items() if k in ("data", "schedule")}
        waits = self.engine.wait_seconds()
        out["io_wait"] = waits["io"] - self.waits_at_start["io"]
        out["comm_wait"] = waits["comm"] - self.waits_at_start["comm"]
        return out


def gather_over_dp(values: list[float], topology, group) -> torch.Tensor:
    """[ranks, len(values)] tensor of every rank of group's values (one collective): the
    data-parallel ranks, or with context parallelism the dp × cp replicas."""
    local = torch.tensor(values, dtype=torch.float64)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return local.unsqueeze(0)
    if topology.device.type != "cpu":
        local = local.to(topology.device)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.stack(parts).cpu()


def local_ranks(world_size: int) -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    except ValueError:
        return world_size


def finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def postfix(record: dict[str, Any], last_eval: dict[str, Any]) -> dict[str, str]:
    from ..estimate.report import human_bytes

    out = {}
    if "loss" in record:
        out["loss"] = f"{record['loss']:.3f}"
    if "eval_loss" in last_eval:
        out["eval"] = f"{last_eval['eval_loss']:.3f}"
        out["ppl"] = f"{last_eval['eval_ppl']:.1f}"
    if "tokens_per_s" in record:
        out["tok_s"] = f"{record['tokens_per_s']:,.0f}"
    if record.get("mfu") is not None:
        out["mfu"] = f"{100 * record['mfu']:.1f}%"
    if "mem_bytes_per_rank" in record:
        out["mem_rank"] = human_bytes(record["mem_bytes_per_rank"])
    return out


def format_summary(s: dict[str, Any]) -> str:
    """The human-readable end-of-run summary."""
    from ..estimate.report import human_bytes

    def loss(x):
        return "n/a" if x is None else f"{x:.3f}"

    lines = [
        "training done",
        f"  steps        {s['steps_run']} run, {s['steps']} total ({s['skipped_steps']} skipped)",
        f"  loss         {loss(s['first_loss'])} -> {loss(s['last_loss'])} (first -> last logged)",
    ]
    if s.get("eval_loss") is not None:
        lines.append(f"  eval loss    {loss(s['eval_loss'])} (perplexity {math.exp(min(s['eval_loss'], 700)):.2f})")
    lines += [
        f"  time         {s['time_s']:.1f} s",
        f"  throughput   {s['tokens_per_s']:,.0f} tokens/s (all ranks)",
        f"  memory/rank  {human_bytes(s['mem_bytes_per_rank'])} model states, "
        f"{human_bytes(s['peak_rss_bytes_per_rank'])} peak RSS"
        + (f", {human_bytes(s['cuda_peak_bytes'])} peak CUDA" if "cuda_peak_bytes" in s else ""),
        f"  zero.stage   {s['zero_stage']} ({s['precision']})",
        f"  world size   {s['world_size']} (dp={s['dp']}" + (f", cp={s['cp']}" if s.get("cp", 1) > 1 else "") + ")",
    ]
    return "\n".join(lines)
