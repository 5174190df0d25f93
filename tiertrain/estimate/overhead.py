"""Process memory a training rank holds besides its tensors, added to the estimate of its
peak (:mod:`tiertrain.estimate.peak`, :mod:`tiertrain.estimate.build_peak`): the framework's
constant bytes per process and the share of the transient bytes the host allocator keeps
resident (:class:`HostOverhead`), with the defaults calibrated on the reference machine and
what ``tiertrain probe`` measures instead.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HostOverhead", "DEFAULT_OVERHEAD_BYTES", "DEFAULT_RETENTION"]

DEFAULT_OVERHEAD_BYTES = 18 * 2**20
"""Process memory a training rank holds besides tensors (allocator metadata, gloo and
oneDNN/BLAS buffers, the autograd engine, Python objects), when nothing better is known. It
does not grow with the model, so it is calibrated on the smallest run that trains (a 1-block,
32-wide GPT on 2 gloo ranks: peak-RSS increase less its tensors); the default is that
calibration on the reference CPU machine, recorded in bench/results/estimate_accuracy.md
("Process overhead", "Calibration runs"). ``tiertrain probe`` measures it on the machine at
hand (``framework_overhead_bytes``, tiertrain.estimate.measure.calibrate_overhead)."""

DEFAULT_RETENTION = 0.5
"""Share of a rank's transient bytes (activations, buckets, gathered units) that glibc's
heap keeps resident on top of them, when nothing better is known. Freed holes in the heap stay
resident (with ``zero.retain_host_memory`` on, the default: mmap threshold 32 MiB, trim
threshold 256 MiB from wrap() on), and where they fall varies from run to run, so a single round
figure near the calibration is used: a 6 × 512 GPT at stage 2, micro-batch 4, on the reference
CPU machine; bench/results/estimate_accuracy.md records that calibration, its spread over runs
and the share each of its runs implies ("What the retention is, measured").
``tiertrain probe`` measures it (``allocator_retention``)."""


@dataclass(frozen=True)
class HostOverhead:
    """Process memory besides tensors, added to the estimate of a rank's peak.

    ``framework_bytes`` is a constant per process (gloo, BLAS/oneDNN workspaces, the
    autograd engine, allocator metadata, Python objects). ``retention`` is the fraction of
    the transient bytes at the peak that the host allocator keeps resident on top of them:
    activations, buckets and gathered units of up to 32 MiB come from glibc's heap (with
    ``zero.retain_host_memory``, the default, from wrap() on; otherwise once the dynamic mmap
    threshold has risen), whose freed holes stay resident and fragment: it is there from
    the first step, grows over the next ones, and varies from run to run (the spread is
    measured in bench/results/estimate_accuracy.md). 0 on CUDA devices,
    whose caching allocator is not modelled here."""

    framework_bytes: int = DEFAULT_OVERHEAD_BYTES
    """Constant bytes per rank process."""
    retention: float = DEFAULT_RETENTION
    """Fraction of the peak's transient bytes (activations and engine buffers) the host
    allocator holds on top of them."""
    source: str = "defaults measured on the reference machine (bench/results/estimate_accuracy.md)"
    """Where the figures come from."""

    @classmethod
    def none(cls) -> "HostOverhead":
        """No overhead: tensor bytes only."""
        return cls(0, 0.0, "none (tensor bytes only)")

    @classmethod
    def for_device(cls, device: str) -> "HostOverhead":
        """The defaults for a compute device: "cpu" (host allocator retention applies to the
        transient bytes) or "cuda" (they live in the caching allocator: not modelled, 0)."""
        return cls() if device == "cpu" else cls(DEFAULT_OVERHEAD_BYTES, 0.0, "default framework bytes; CUDA "
                                                 "caching allocator not modelled")
