"""``tiertrain plot``: draw a run's metrics as PNGs (tiertrain.observe.plot)."""
from __future__ import annotations


def cmd_plot(argv: list[str]) -> int:
    from ..observe.plot import main as plot_main

    return plot_main(argv)
