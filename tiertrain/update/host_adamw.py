"""AdamW, the clip factor and the copy into the compute dtype in one pass over memory, for an
optimizer whose state is in host memory (the CPU tier of ZeRO-Offload,
docs/concepts.md#the-cpu-update-in-one-pass).

An AdamW step is bound by memory traffic: it reads the master, the gradient and both moments
and writes three of them back (28 bytes per element). torch's fused kernel does that in one
pass, but around it the step used to make three more: the gradients multiplied by the clip
factor (8 bytes), and after the update the masters copied into the bf16/fp16 compute shards
(6 bytes). DeepSpeed's CPU Adam writes the half-precision copy in its update loop for this
reason. Here one compiled loop (torch.compile, inductor's vectorised C++ on the CPU) reads each
element once, scales its gradient, updates it and stores the master, both moments and the
compute-dtype copy: bench/results/cpu_step.md measures it against the bare fused kernel.

The optimizer stays torch's ``AdamW``: its ``state`` holds the moments and step counts this
module updates, so checkpoints and resharding see the same state either way, and pieces too
small to be worth a call (a norm's gain, a bias) take torch's own fused step.
"""
from __future__ import annotations

import functools
import math
import shutil
import warnings
from typing import Callable

import torch

from ..errors import TiertrainError
from ..spans import span
from .protocol import gradients_hidden_where

SMALL_PIECE = 1 << 16
"""Pieces with fewer elements take torch's fused step (one call over all of them): a compiled
call costs ~40 µs, the bare update of 64 Ki elements about as much."""

KERNEL_OPTIONS = {"cpp_wrapper": True}
"""inductor options of the kernel: its C++ wrapper, which releases the GIL while the loop runs."""

WARM_ELEMENTS = 1 << 20
"""The compile runs once on scratch tensors of this size: inductor chooses a parallel loop
from the size it first sees (and caches that choice), so it must see a large one."""

def _adamw(param, grad, exp_avg, exp_avg_sq, hyper):
    """torch AdamW's update of one piece (torch.optim.adamw, decoupled decay), with the
    gradient multiplied by grad_factor (the clip coefficient) on the way in. Every scalar
    factor comes in computed (:func:`hyperparameters`): the loop is left one division per
    element (the update's own), which measured ~8 % faster than torch's formula written out
    (bench/results/cpu_step.md)."""
    decay, one_minus_beta1, beta2, one_minus_beta2, inverse_bias_correction2_sqrt, eps, step_size, grad_factor = \
        hyper.unbind()
    g = grad * grad_factor
    param.mul_(decay)
    exp_avg.lerp_(g, one_minus_beta1)
    exp_avg_sq.mul_(beta2).add_(one_minus_beta2 * g * g)
    denom = exp_avg_sq.sqrt() * inverse_bias_correction2_sqrt + eps
    param.sub_(step_size * exp_avg / denom)


def hyperparameters(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: float,
                    grad_factor: float) -> torch.Tensor:
    """The kernel's scalars for AdamW step number ``step``, computed in double precision as
    torch's AdamW computes them (its bias corrections, step size and decay factor)."""
    return torch.tensor([1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, 1 / math.sqrt(1 - beta2 ** step), eps,
                         lr / (1 - beta1 ** step), grad_factor])


def _group_hyperparameters(group: dict, step: float, grad_factor: float) -> torch.Tensor:
    """:func:`hyperparameters` of an AdamW param group at step number ``step``."""
    beta1, beta2 = group["betas"]
    return hyperparameters(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], step, grad_factor)


def _adamw_cast(param, grad, exp_avg, exp_avg_sq, out, hyper):
    """_adamw, then the new values stored in ``out`` (the compute-dtype shard) in the same loop."""
    _adamw(param, grad, exp_avg, exp_avg_sq, hyper)
    out.copy_(param)


def _adamw_into(param, grad, exp_avg, exp_avg_sq, param_out, exp_avg_out, exp_avg_sq_out, hyper):
    """_adamw with the new values written into the *_out tensors, the inputs left as they were
    (an update that can still be discarded: update/overlapped_host.py). The same operations on
    the same values as the in-place kernel, so the same bits."""
    param_out.copy_(param)
    exp_avg_out.copy_(exp_avg)
    exp_avg_sq_out.copy_(exp_avg_sq)
    _adamw(param_out, grad, exp_avg_out, exp_avg_sq_out, hyper)


def _adamw_into_cast(param, grad, exp_avg, exp_avg_sq, param_out, exp_avg_out, exp_avg_sq_out, out, hyper):
    """_adamw_into, then the new values stored in ``out`` (the compute-dtype shard) in the same loop."""
    _adamw_into(param, grad, exp_avg, exp_avg_sq, param_out, exp_avg_out, exp_avg_sq_out, hyper)
    out.copy_(param_out)


class CompileUnavailable(TiertrainError, RuntimeError):
    """torch.compile could not build the kernel on this machine (no C++ compiler, or inductor
    failed): the message says why."""


@functools.cache
def _kernels(cast_dtype: torch.dtype | None, into: bool = False):
    """The compiled kernel (with a cast into cast_dtype, or without; in place, or into separate
    outputs), built and warmed once per process."""
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise CompileUnavailable("no C++ compiler (c++, g++ or clang++) on PATH: torch.compile needs one to "
                                 "build CPU kernels")
    fn = {(False, False): _adamw, (False, True): _adamw_cast, (True, False): _adamw_into,
          (True, True): _adamw_into_cast}[into, cast_dtype is not None]
    scratch = [torch.zeros(WARM_ELEMENTS) for _ in range(7 if into else 4)]
    if cast_dtype is not None:
        scratch.append(torch.zeros(WARM_ELEMENTS, dtype=cast_dtype))
    hyper = hyperparameters(lr=0.0, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1, grad_factor=1.0)
    # inductor's C++ wrapper (cpp_wrapper) calls the loop with the GIL released; its default
    # Python wrapper holds the GIL for the whole loop, which stalls every Python hook of a
    # backward running beside an overlapped step (docs/concepts.md#the-cpu-step-overlapped-with-backward).
    # inductor's on-disk graph cache does not key on ATEN_CPU_CAPABILITY: C++ written for
    # AVX-512 and cached fails to compile under `default`. Then once more, without that cache;
    # last, without the C++ wrapper (the same loop, holding the GIL), said in a warning.
    failures = []
    for options in (KERNEL_OPTIONS, {**KERNEL_OPTIONS, "fx_graph_cache": False}, {"fx_graph_cache": False}):
        kernel = torch.compile(fn, dynamic=True, fullgraph=True, options=options)
        try:
            kernel(*scratch, hyper)
        except Exception as e:  # (inductor's errors have no common public base)
            failures.append(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
            continue
        if "cpp_wrapper" not in options:
            warnings.warn(f"the compiled CPU-tier AdamW could not be built with inductor's C++ wrapper ({failures[1]}); "
                          f"it runs with the GIL held instead, so an overlapped step (zero.overlap_cpu_step) stops "
                          f"backward's Python hooks while it updates a unit", RuntimeWarning, stacklevel=2)
        return kernel
    raise CompileUnavailable(f"torch.compile failed to build the AdamW kernel, with and without inductor's "
                             f"graph cache and C++ wrapper: {failures[0]}; then {failures[1]}; then {failures[2]}")


def unsupported_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why this optimizer's step cannot run as the compiled pass (None: it can)."""
    if type(optimizer) is not torch.optim.AdamW:
        return f"it is a {type(optimizer).__name__}, not torch.optim.AdamW"
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(flag):
                return f"param group {i} sets {flag}=True"
        if isinstance(group["lr"], torch.Tensor):
            return f"param group {i} has a tensor learning rate"
        for p in group["params"]:
            if p.device.type != "cpu" or p.dtype != torch.float32:
                return f"param group {i} holds a {p.dtype} tensor on {p.device}, not fp32 in host memory"
    return None


class HostAdamW:
    """Steps a torch AdamW over fp32 pieces in host memory with the compiled pass; each piece's
    new values are also written into its compute-dtype destination, when it has one."""

    def __init__(self, optimizer: torch.optim.AdamW,
                 destination_of: Callable[[torch.Tensor], torch.Tensor | None], who: str = "optimizer.impl=compiled"):
        reason = unsupported_reason(optimizer)
        if reason is not None:
            raise ValueError(f"{who} steps torch's AdamW in host memory with the compiled pass; {reason}")
        self.optimizer = optimizer
        self.destinations = {id(p): destination_of(p) for g in optimizer.param_groups for p in g["params"]}
        cast_dtypes = {d.dtype for d in self.destinations.values() if d is not None}
        if len(cast_dtypes) > 1:
            raise ValueError(f"compute shards of several dtypes ({sorted(map(str, cast_dtypes))}): one expected")
        self.cast_dtype = cast_dtypes.pop() if cast_dtypes else None
        # (compiled now, not in the first step: only the kernels some piece uses, each a compile)
        if any(d is None for d in self.destinations.values()):
            _kernels(None)
        if self.cast_dtype is not None:
            _kernels(self.cast_dtype)

    def step(self, clip: torch.Tensor | None, skip: Callable[[torch.Tensor], bool] = lambda p: False) -> None:
        """One AdamW update of every piece with a gradient (skip(p): leave it, state included,
        as torch does a parameter whose .grad is None), its gradient scaled by clip; then every
        piece's destination holds its values."""
        with span("optimizer_pass"):
            self._step(1.0 if clip is None else float(clip), clip, skip)

    def step_pieces(self, pieces: list[tuple[dict, torch.Tensor]], clip: torch.Tensor | None = None) -> None:
        """One AdamW update of these (param group, piece) pairs only, each with a gradient,
        scaled by clip; their destinations then hold their values (no other piece is touched)."""
        with span("optimizer_pass"):
            self._update(pieces, 1.0 if clip is None else float(clip), clip)

    @staticmethod
    def steps_alone(p: torch.Tensor) -> bool:
        """Whether piece p takes the compiled kernel of its own (else torch's step over all small pieces)."""
        return p.numel() >= SMALL_PIECE

    def update_into(self, group: dict, p: torch.Tensor, p_out: torch.Tensor, exp_avg_out: torch.Tensor,
                    exp_avg_sq_out: torch.Tensor) -> None:
        """The next unclipped AdamW update of piece p (one that :meth:`steps_alone`) written into
        p_out and the two moment outputs, and into p's destination; p, its state and its step
        count are left as they were, for the caller to commit (swap the outputs in, count the
        step) or discard (give the destination p's values back)."""
        state = self.state_of(p)
        hyper = _group_hyperparameters(group, float(state["step"]) + 1, 1.0)
        out = self.destinations[id(p)]
        tensors = (p, p.grad, state["exp_avg"], state["exp_avg_sq"], p_out, exp_avg_out, exp_avg_sq_out)
        if out is None:
            _kernels(None, into=True)(*tensors, hyper)
        else:
            _kernels(self.cast_dtype, into=True)(*tensors, out, hyper)

    def _step(self, factor: float, clip: torch.Tensor | None, skip: Callable[[torch.Tensor], bool]) -> None:
        chosen, left = [], []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None or skip(p):
                    left.append(p)
                else:
                    chosen.append((group, p))
        self.copy_out(left)
        self._update(chosen, factor, clip)

    def copy_out(self, pieces: list[torch.Tensor]) -> None:
        """Each piece's destination (its compute-dtype copy) given the piece's values: for
        pieces a step leaves unchanged, whose destinations the pass does not write."""
        for p in pieces:
            out = self.destinations[id(p)]
            if out is not None:
                out.copy_(p)

    def _update(self, chosen: list[tuple[dict, torch.Tensor]], factor: float, clip: torch.Tensor | None) -> None:
        small = []
        for group, p in chosen:
            if not self.steps_alone(p):
                small.append(p)
                continue
            state = self.state_of(p)
            state["step"] += 1
            hyper = _group_hyperparameters(group, float(state["step"]), factor)
            out = self.destinations[id(p)]
            if out is None:
                _kernels(None)(p, p.grad, state["exp_avg"], state["exp_avg_sq"], hyper)
            else:
                _kernels(self.cast_dtype)(p, p.grad, state["exp_avg"], state["exp_avg_sq"], out, hyper)
        self._step_small(small, clip)

    def state_of(self, p: torch.Tensor) -> dict:
        """Piece p's AdamW state (step, exp_avg, exp_avg_sq), created as torch's fused AdamW creates it."""
        state = self.optimizer.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _step_small(self, small: list[torch.Tensor], clip: torch.Tensor | None) -> None:
        """torch's own step over the small pieces (every other piece's gradient hidden)."""
        if not small:
            return
        chosen = {id(p) for p in small}
        with gradients_hidden_where(self.optimizer, lambda p: id(p) not in chosen):
            if clip is not None:
                for p in small:
                    p.grad.mul_(clip)
            self.optimizer.step()
        self.copy_out(small)


def warn_unavailable(error: CompileUnavailable) -> None:
    """optimizer.impl=auto chose the compiled pass and it is not available: said once."""
    warnings.warn(f"optimizer.impl=auto: the compiled CPU-tier AdamW is not available ({error}); "
                  f"stepping with torch's fused AdamW and a separate cast instead (slower, same update)",
                  RuntimeWarning, stacklevel=3)
