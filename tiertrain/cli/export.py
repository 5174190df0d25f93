"""``tiertrain export``: a saved checkpoint written as a Hugging Face checkpoint, offline, one
tensor in memory at a time."""
from __future__ import annotations

import argparse
import sys

from .common import print_error


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return str(nbytes)


def _peak_rss() -> int:
    """This process's peak resident memory in bytes (VmHWM on Linux: reset at exec, unlike
    ru_maxrss, which keeps a forking parent's)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def cmd_export(argv: list[str]) -> int:
    from ..state.checkpoint import CheckpointError
    from ..state.consolidate import FORMATS, export_checkpoint

    p = argparse.ArgumentParser(
        prog="tiertrain export", allow_abbrev=False,
        description="Write a checkpoint saved by Engine.save_checkpoint (the newest committed step, or --step) as "
                    "a Hugging Face checkpoint: safetensors files, model.safetensors.index.json and, when the "
                    "run's model had a Hugging Face config, config.json. One process, no model code, no "
                    "torch.distributed; one tensor is assembled in memory at a time.")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="the directory given to save_checkpoint")
    p.add_argument("out", metavar="OUT_DIR", help="where to write the Hugging Face checkpoint")
    p.add_argument("--step", type=int, default=None, help="the committed step to export (default: the newest)")
    p.add_argument("--dtype", default="fp32", help="bf16, fp16 or fp32 (default: fp32, the masters' values)")
    p.add_argument("--max-shard-bytes", type=int, default=None, help="tensor bytes per file at most (default 5e9)")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="hf: a from_pretrained directory (config.json included; needs a Hugging Face model); "
                        "safetensors: the tensor files and index only (default: hf when the run's model had a "
                        "Hugging Face config)")
    args = p.parse_args(argv)
    kwargs = {} if args.max_shard_bytes is None else {"max_shard_bytes": args.max_shard_bytes}
    try:
        report = export_checkpoint(args.checkpoint, args.out, step=args.step, dtype=args.dtype,
                                   format=args.format, **kwargs)
    except CheckpointError as e:
        return print_error(str(e), code=1)
    except OSError as e:
        return print_error(f"export failed: {e}", code=1)
    peak_rss = _peak_rss()
    print(f"exported step {report.step} of {args.checkpoint} to {report.directory} "
          f"({str(report.dtype).removeprefix('torch.')})")
    for name in report.files + report.config_files:
        print(f"  {name}")
    if len(report.files) > 1:
        print("  model.safetensors.index.json")
    print(f"tensors: {report.tensors}, bytes: {report.bytes_written} ({_size(report.bytes_written)}), "
          f"largest tensor: {_size(report.largest_tensor)}, peak assembled: {_size(report.peak_assembled)}, "
          f"process peak RSS: {_size(peak_rss)}")
    for note in report.notes:
        print(f"note: {note}")
    return 0
