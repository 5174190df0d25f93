"""The CPU tier's AdamW pass as a small C kernel (adamw_kernel.c), built for this host with its
C compiler and called through ctypes, which releases the GIL for the call; its OpenMP threads
are torch's own intra-op threads where torch's libgomp has the system's name (its CPU builds).

It replaced a torch.compile'd loop (inductor's vectorised C++) with the same arithmetic and
bits: its compute copy is rounded in registers and streamed around the cache, so the pass costs
1.03x torch's bare fused AdamW on the EPYC VM where inductor's cost 1.16x
(bench/results/adamw_pass_epyc.md), and it builds in 0.3 s where inductor took 3-100 s
(docs/concepts.md#the-cpu-update-in-one-pass). The built library is cached under
~/.cache/tiertrain (or $TIERTRAIN_CACHE_DIR), keyed by the source, compiler, flags and CPU.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from ..errors import TiertrainError
from ..io.fileio import atomic_write

SOURCE = Path(__file__).with_name("adamw_kernel.c")
FLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-std=gnu11", "-shared", "-fPIC"]
"""-fno-math-errno lets sqrtf vectorise; -ffp-contract=off keeps each operation rounded as written
(no fused multiply-adds), as torch's separate operations are: every instruction set gives the
same bits. -fopenmp is added where the compiler has it: its libgomp.so.1 is the one torch's CPU
builds have already loaded, so the kernel's threads are torch's intra-op threads."""
OUT_KINDS = {None: 0, torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
HYPERPARAMETERS = ("decay", "1 - beta1", "beta2", "1 - beta2", "1 / sqrt(bias correction 2)", "eps", "step size",
                   "gradient factor")
"""The scalars the kernel reads, in order (host_adamw.hyperparameters computes them)."""
ALIGN = 64
"""Each thread's range starts at a multiple of this many elements (adamw_kernel.c); a range is
at least 16 of them."""


class KernelUnavailable(TiertrainError, RuntimeError):
    """The C kernel could not be built on this machine (no C compiler, or it failed): the
    message says why."""


def _compiler() -> list[str]:
    """The compiler's command: $CC split as a shell splits it (``ccache gcc``, ``gcc -m64``), else
    the first of cc, gcc, clang on PATH."""
    if os.environ.get("CC", "").strip():
        try:
            return shlex.split(os.environ["CC"])
        except ValueError as e:
            raise KernelUnavailable(f"$CC={os.environ['CC']!r} is not a command line ({e})") from None
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise KernelUnavailable("no C compiler (cc, gcc or clang on PATH, or $CC) to build the CPU-tier AdamW kernel")
    return [compiler]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    root = os.environ.get("TIERTRAIN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tiertrain")
    return Path(root) / "kernels"


def build(arch: str = "native") -> ctypes.CDLL:
    """The kernel library for this host (``-march=native``; another ``arch`` builds for that
    instruction set): from the cache, else compiled (and cached where the cache directory is
    writable)."""
    compiler = _compiler()
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"the C compiler {shlex.join(compiler)} does not run: {e}") from e
    failures = []
    for openmp in (["-fopenmp"], []):  # (a compiler without OpenMP: one thread, said in a warning)
        try:
            lib = _build_with(compiler, version, [f"-march={arch}", *FLAGS, *openmp])
        except KernelUnavailable as e:
            failures.append(str(e))
            continue
        if not openmp:
            warnings.warn(f"the CPU-tier AdamW kernel was built without OpenMP ({failures[0]}): it runs on one "
                          f"thread", RuntimeWarning, stacklevel=2)
        return lib
    raise KernelUnavailable(f"{failures[0]}; without -fopenmp: {failures[1]}")


def _build_with(compiler: list[str], version: str, flags: list[str]) -> ctypes.CDLL:
    arguments = " ".join(compiler[1:] + flags)
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), version.encode(), arguments.encode(),
                                     _cpu_flags().encode()])).hexdigest()[:24]
    cached = _cache_dir() / f"adamw_{key}.so"
    if cached.exists():
        return _load(cached)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            built = Path(scratch) / "adamw.so"
            run = subprocess.run([*compiler, *flags, "-o", str(built), str(SOURCE), "-lm"], capture_output=True,
                                 text=True, timeout=300)
            if run.returncode != 0:
                raise KernelUnavailable(f"{shlex.join(compiler)} failed to build {SOURCE.name} (exit "
                                        f"{run.returncode}): {run.stderr.strip()[-2000:]}")
            try:  # (written beside, then renamed: a process loading it never sees half a file)
                cached.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(cached, lambda f: f.write(built.read_bytes()))
            except OSError:  # (a cache directory not writable: this process's own copy)
                return _load(built)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"building {SOURCE.name} with {shlex.join(compiler)} failed: "
                                f"{type(e).__name__}: {e}") from e
    return _load(cached)


def _load(path: Path) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(str(path))  # (a CDLL call releases the GIL while it runs)
    except OSError as e:
        raise KernelUnavailable(f"the built kernel {path} does not load ({e}); delete it to build it again") from e
    fn = lib.tiertrain_adamw
    fn.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    fn.restype = None
    return lib


class Kernel:
    """Calls the C pass over whole tensors, on as many threads as torch's intra-op pool has.

    ``kernel(param, grad, exp_avg, exp_avg_sq, [param_out, exp_avg_out, exp_avg_sq_out,]
    [out,] hyper)``: in place, or into the three outputs (the inputs left as they were: the
    same arithmetic on the same values, so the same bits); ``out`` receives the new values in
    the compute dtype; ``hyper`` is host_adamw.hyperparameters' tensor."""

    def __init__(self, lib: ctypes.CDLL, cast_dtype: torch.dtype | None, into: bool):
        if cast_dtype not in OUT_KINDS:
            raise ValueError(f"the CPU-tier AdamW kernel writes compute copies in bf16, fp16 or fp32, not {cast_dtype}")
        self.fn, self.kind, self.into, self.cast_dtype = lib.tiertrain_adamw, OUT_KINDS[cast_dtype], into, cast_dtype

    def __call__(self, *tensors: torch.Tensor) -> None:
        *tensors, hyper = tensors
        p, g, m, v = tensors[:4]
        outs = tensors[4:7] if self.into else (p, m, v)
        out = tensors[-1] if self.kind else None
        n = p.numel()
        for t in (p, g, m, v, *outs):
            self._check(t, torch.float32, n)
        if out is not None:
            self._check(out, self.cast_dtype, n)
        if hyper.numel() != len(HYPERPARAMETERS):
            raise ValueError(f"the CPU-tier AdamW kernel takes {len(HYPERPARAMETERS)} hyperparameters "
                             f"({', '.join(HYPERPARAMETERS)}); got {hyper.numel()}")
        h = hyper.to(torch.float32).contiguous()
        threads = max(1, min(torch.get_num_threads(), n // (ALIGN * 16)))
        self.fn(*(t.data_ptr() for t in (p, g, m, v, *outs)), out.data_ptr() if out is not None else None,
                self.kind, n, h.data_ptr(), threads)

    @staticmethod
    def _check(t: torch.Tensor, dtype: torch.dtype, n: int) -> None:
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n:
            raise ValueError(f"the CPU-tier AdamW kernel takes contiguous {dtype} tensors of {n} elements in host "
                             f"memory; got {t.dtype} {tuple(t.shape)} on {t.device}"
                             f"{'' if t.is_contiguous() else ', not contiguous'}")
