"""Observing a run: where each metrics record goes (writers) and pictures of a finished run (plot).

    writer = open_writers(config.logging, append=resumed, run_config=asdict(config))
    writer.write({"step": 10, "loss": 3.2, ...}); writer.close()
    tiertrain plot runs/            # loss.png, throughput.png, memory.png, timing.png

TensorBoard, Weights & Biases and matplotlib are optional: each is imported only when it
is used, and a configured writer whose package is missing is a ConfigError naming the field
and the pip command (check_writers runs that check before any process starts).
"""
from .writers import (JsonlWriter, MetricsWriter, MultiWriter, TensorBoardWriter, WandbWriter, check_writers,
                      metric_tag, open_writers)

__all__ = ["JsonlWriter", "MetricsWriter", "MultiWriter", "TensorBoardWriter", "WandbWriter", "check_writers",
           "metric_tag", "open_writers", "plot_run"]



def __getattr__(name: str):
    """plot_run on first use: importing plot here would make `python -m tiertrain.observe.plot` warn."""
    if name == "plot_run":
        from .plot import plot_run

        return plot_run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
