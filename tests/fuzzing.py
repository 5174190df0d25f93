"""What the fuzzers (tests/fuzz_checkpoints.py, tests/fuzz_configs.py) share: their command line.
A run's findings have ``cases``, ``seconds`` and ``failures()``."""
from __future__ import annotations

import argparse
from typing import Callable


def main(description: str, fuzz: Callable, summary: Callable[[object], str], argv=None) -> int:
    """Run ``fuzz(cases, seed, budget_s)`` from the command line, print ``summary(findings)``
    and the first failures; exit status 1 on any failure or when the budget ran out first."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--cases", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=600.0)
    args = p.parse_args(argv)
    f = fuzz(args.cases, args.seed, args.budget_s)
    print(f"{f.cases} cases in {f.seconds:.0f} s: {summary(f)}")
    for line in f.failures()[:50]:
        print("  " + line)
    if f.cases < args.cases:
        print(f"only {f.cases} of {args.cases} cases within --budget-s {args.budget_s:g}")
        return 1
    return 1 if f.failures() else 0
