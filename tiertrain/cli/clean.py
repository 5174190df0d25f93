"""``tiertrain clean``: remove what killed runs left behind (launch directories, swap files,
unfinished checkpoint saves)."""
from __future__ import annotations

import argparse

from .common import print_error


def cmd_clean(argv: list[str]) -> int:
    from ..state.checkpoint import CheckpointError
    from ..cleanup import clean_directory, remove_abandoned_launches

    p = argparse.ArgumentParser(
        prog="tiertrain clean", allow_abbrev=False,
        description="Remove what killed runs left behind, naming each thing removed: launch directories "
                    "($TMPDIR/tiertrain-launch-*) whose launcher is gone, with the swap files and unfinished "
                    "checkpoint saves their ranks registered; in each DIR given, a checkpoint directory's "
                    "unfinished steps and temporary files (refused while a live job holds the directory) or a "
                    "swap directory's rank directories that no live process locks. Every new launch does the "
                    "first part by itself.")
    p.add_argument("dirs", metavar="DIR", nargs="*", help="a checkpoint directory or a swap directory (zero.nvme_path)")
    args = p.parse_args(argv)
    lines = remove_abandoned_launches()
    for directory in args.dirs:
        try:
            lines += clean_directory(directory)
        except (CheckpointError, OSError) as e:
            return print_error(str(e), code=1)
    for line in lines:
        print(f"removed {line}")
    if not lines:
        print("nothing to remove")
    return 0
