"""bench/gpu.py's report sections for issue 36 (the CPU tier at GPU speed): each tiertrain row's
build split, gradient norm and what its overlapped step kept; the issue's GPU targets read off
the rows of one run, met or not; the traces recorded with --trace."""
from __future__ import annotations

# Issue 36's GPU targets, read off the rows of one run (the report's "Targets" section).
BEAT_FSDP2_OFFLOAD = ("tt-z2-optcpu", "tt-z2-optcpu-overlap", "tt-z2-optcpu-overlap-below-clip", "tt-z3-bothcpu",
                      "tt-z3-bothcpu-overlap", "tt-z3-bothcpu-overlap-below-clip")
"""Rows whose step must be at most 0.75 x FSDP2 CPUOffloadPolicy's ("fsdp2-cpuoffload")."""
FSDP2_OFFLOAD_BOUND = 0.75
ACCUMULATION_MFU = ("tt-z3-bothcpu-accum8", "tt-z3-bothcpu-accum8-overlap")
"""Rows (8 micro-batches per step) whose MFU must be at least ACCUMULATION_MFU_BOUND."""
ACCUMULATION_MFU_BOUND = 0.30
DELAYED_AND_SYNCHRONOUS = {"tt-z2-optcpu-delayed": "tt-z2-optcpu", "tt-z3-bothcpu-delayed": "tt-z3-bothcpu"}
"""Delayed-update row -> the same configuration's synchronous row, whose step phase is the CPU
step: the delayed row's step must be at most DELAYED_BOUND x max(forward + backward, CPU step)."""
DELAYED_BOUND = 1.1


def issue36_sections(rows: list[dict]) -> list[str]:
    """The report's lines after the side-by-side table."""
    out: list[str] = []
    facts = [r for r in rows if r.get("status") == "ok" and "grad_norm" in r]
    if facts:
        out += ["", "tiertrain rows' build (the model's init, then wrap: partitioning, pinning, compiling), their "
                "last gradient norm (before the clip of 1.0)" + (", and the steps whose overlapped update was kept "
                "(speculation committed) or redone after the clip" if any("speculation" in r for r in facts) else "")
                + ":", ""]
        out += [f"- {r['label']}: model {r['model_s']:.1f} s, wrap {r['wrap_s']:.1f} s (compiling "
                f"{r['compile_in_wrap_s']:.1f} s of it; compiles in all: {r['compiles_s']} s); gradient norm "
                f"{r['grad_norm']:.3g}" + (_speculation(r) if "speculation" in r else "") for r in facts]
    out += _targets(rows)
    traced = [r for r in rows if r.get("trace")]
    if traced:
        out += ["", "## Traces", "", "One more step of each row below, after its timed steps, recorded with torch's "
                "profiler (device kernels and the engine's spans; the profiler slows the step). Draw one with "
                "`tiertrain plot`, or open it in Perfetto.", ""]
        for r in traced:
            t = r["trace"]
            out.append(f"- {r['label']}: " + (f"`{t['file']}`, {t['spans']} spans, the traced step "
                                              f"{t['traced_step_s']:.3f} s" if "file" in t else f"failed: {t['error']}"))
    return out


def _speculation(r: dict) -> str:
    """What the overlapped step did over a row's steps (warm-up, timed and traced)."""
    committed, discarded = r["speculation"]["committed"], r["speculation"]["discarded"]
    steps = len(r["steps_s"]) + (1 if "file" in r.get("trace", {}) else 0)
    last = r.get("last_overlapped_step") or {}
    return (f"; speculation committed at {committed} of {steps} steps, discarded at {discarded}"
            + (f" (last step: {last['units_updated']} of {last['units']} units updated during backward)"
               if last else ""))


def _targets(rows: list[dict]) -> list[str]:
    """Issue 36's GPU targets against the rows of this run that measured them, met or not."""
    by_name = {r["name"]: r for r in rows if r.get("status") == "ok"}
    lines = []
    fsdp2 = by_name.get("fsdp2-cpuoffload")
    for name in BEAT_FSDP2_OFFLOAD:
        if fsdp2 and name in by_name:
            ratio = by_name[name]["step_s"] / fsdp2["step_s"]
            lines.append((by_name[name]["label"], f"step ≤ {FSDP2_OFFLOAD_BOUND} × FSDP2 CPUOffloadPolicy's "
                          f"({fsdp2['step_s']:.3f} s)", f"{by_name[name]['step_s']:.3f} s = {ratio:.2f} ×",
                          ratio <= FSDP2_OFFLOAD_BOUND))
    for name in ACCUMULATION_MFU:
        if name in by_name:
            mfu = by_name[name]["mfu"]
            lines.append((by_name[name]["label"], f"MFU ≥ {100 * ACCUMULATION_MFU_BOUND:.0f} %",
                          f"{100 * mfu:.1f} %", mfu >= ACCUMULATION_MFU_BOUND))
    for name, synchronous in DELAYED_AND_SYNCHRONOUS.items():
        if name in by_name and synchronous in by_name:
            p = by_name[name]["phases_s"]
            compute, cpu_step = p["fwd"] + p["bwd"], by_name[synchronous]["phases_s"]["step"]
            ratio = by_name[name]["step_s"] / max(compute, cpu_step)
            lines.append((by_name[name]["label"], f"step ≤ {DELAYED_BOUND} × max(forward + backward "
                          f"{compute:.3f} s, the synchronous row's CPU step {cpu_step:.3f} s)",
                          f"{by_name[name]['step_s']:.3f} s = {ratio:.2f} ×", ratio <= DELAYED_BOUND))
    if not lines:
        return []
    return ["", "## Targets (issue 36)", "", "| row | target | measured | met |", "|---|---|---|---|",
            *(f"| {label} | {target} | {measured} | {'yes' if met else 'no'} |"
              for label, target, measured, met in lines)]
