"""``tiertrain probe``: measure this machine (RAM, memory and disk bandwidth, GPU) and save it as JSON."""
from __future__ import annotations

import argparse
import os
from typing import Any


def format_probe(result: Any) -> str:
    """A HardwareProbe as aligned 'field  value' lines (bytes in binary units, GB/s as such)."""
    from ..estimate import human_bytes

    rows = []
    for name, value in result.to_dict().items():
        if name == "notes":
            continue
        if value is None:
            text = "-"
        elif name.endswith("_bytes"):
            text = human_bytes(value)
        elif name.endswith("_gbps"):
            text = f"{value:.2f} GB/s"
        elif name.endswith("_tflops"):
            text = f"{value:.1f} TFLOP/s"
        elif name.endswith("_gflops"):
            text = f"{value:.1f} GFLOP/s"
        else:
            text = str(value)
        rows.append((name, text))
    width = max(len(n) for n, _ in rows)
    lines = [f"{n.ljust(width)}  {t}" for n, t in rows]
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


def cmd_probe(argv: list[str]) -> int:
    from ..estimate import probe as probe_module

    p = argparse.ArgumentParser(prog="tiertrain probe", allow_abbrev=False,
                                description="Measure this machine's memory, bandwidths and GPU (if any) "
                                            "and save the figures as JSON for the planner.")
    p.add_argument("--swap-dir", metavar="DIR", help="directory to probe as the NVMe tier (a temporary file is written)")
    p.add_argument("--quick", action="store_true",
                   help="small sizes: seconds, noisier numbers; skips the process-overhead calibration")
    p.add_argument("--no-overhead", action="store_true",
                   help="skip the process-overhead calibration (two short 2-rank training runs, ~15 s)")
    p.add_argument("--out", metavar="FILE", default="runs/hardware_probe.json",
                   help="where to save the JSON (default runs/hardware_probe.json; '' to skip)")
    a = p.parse_args(argv)
    result = probe_module.probe(swap_dir=a.swap_dir, quick=a.quick, overhead=False if a.no_overhead else None)
    print(format_probe(result))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        result.save(a.out)
        print(f"saved to {a.out}")
    return 0
