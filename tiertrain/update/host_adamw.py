"""AdamW, the clip factor and the copy into the compute dtype in one pass over memory, for an
optimizer whose state is in host memory (the CPU tier of ZeRO-Offload,
docs/concepts.md#the-cpu-update-in-one-pass).

An AdamW step is bound by memory traffic: it reads the master, the gradient and both moments
and writes three of them back (28 bytes per element). torch's fused kernel does that in one
pass, but around it the step used to make three more: the gradients multiplied by the clip
factor (8 bytes), and after the update the masters copied into the bf16/fp16 compute shards
(6 bytes). DeepSpeed's CPU Adam writes the half-precision copy in its update loop for this
reason. Here one loop (update/adamw_kernel.c, built by update/native_adamw.py) reads each
element once, scales its gradient, updates it and stores the master, both moments and the
compute-dtype copy: bench/results/cpu_step.md measures it against the bare fused kernel.

The optimizer stays torch's ``AdamW``: its ``state`` holds the moments and step counts this
module updates, so checkpoints and resharding see the same state either way, and pieces too
small to be worth a call (a norm's gain, a bias) take torch's own fused step.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Callable, Iterator, Protocol

import torch

from ..spans import span
from .native_adamw import Kernel, KernelUnavailable, build
from .protocol import gradients_hidden_where

SMALL_PIECE = 1 << 16
"""Pieces with fewer elements take torch's fused step (one call over all of them), which costs
less than a call per piece of the pass for the many small pieces of a unit (gains, biases)."""


def hyperparameters(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: float,
                    grad_factor: float) -> torch.Tensor:
    """The kernel's scalars for AdamW step number ``step``, computed in double precision as
    torch's AdamW computes them (its bias corrections, step size and decay factor), in the
    order update/adamw_kernel.c reads them. Every factor computed here leaves the loop one
    division per element (the update's own), measured ~8 % faster than torch's formula
    written out (bench/results/cpu_step.md)."""
    return torch.tensor([1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, 1 / math.sqrt(1 - beta2 ** step), eps,
                         lr / (1 - beta1 ** step), grad_factor])


def _group_hyperparameters(group: dict, step: float, grad_factor: float) -> torch.Tensor:
    """:func:`hyperparameters` of an AdamW param group at step number ``step``."""
    beta1, beta2 = group["betas"]
    return hyperparameters(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], step, grad_factor)


@functools.cache
def _library():
    return build()


@functools.cache
def _kernels(cast_dtype: torch.dtype | None, into: bool = False) -> Kernel:
    """The kernel (with a copy into cast_dtype, or without; in place, or into separate
    outputs), built once per process (KernelUnavailable where it cannot be)."""
    return Kernel(_library(), cast_dtype, into)


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
    """Steps a torch AdamW over fp32 pieces in host memory with the one-pass kernel; each piece's
    new values are also written into its compute-dtype destination, when it has one."""

    def __init__(self, optimizer: torch.optim.AdamW,
                 destination_of: Callable[[torch.Tensor], torch.Tensor | None], who: str = "optimizer.impl=compiled",
                 upload: Upload | None = None):
        reason = unsupported_reason(optimizer)
        if reason is not None:
            raise ValueError(f"{who} steps torch's AdamW in host memory with the compiled pass; {reason}")
        self.optimizer = optimizer
        self.destinations = {id(p): destination_of(p) for g in optimizer.param_groups for p in g["params"]}
        self.upload = upload
        self.uploads = {} if upload is None else {
            id(p): target for g in optimizer.param_groups for p in g["params"]
            if (target := upload.target_of(p)) is not None}
        """Per piece, the device shard its new values are sent to through upload (a piece has a
        destination in host memory, or an upload target, or neither)."""
        cast_dtypes = {d.dtype for d in [*self.destinations.values(), *self.uploads.values()] if d is not None}
        if len(cast_dtypes) > 1:
            raise ValueError(f"compute shards of several dtypes ({sorted(map(str, cast_dtypes))}): one expected")
        self.cast_dtype = cast_dtypes.pop() if cast_dtypes else None
        # (built now, not in the first step)
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
            self._finish_upload()

    def step_pieces(self, pieces: list[tuple[dict, torch.Tensor]], clip: torch.Tensor | None = None) -> None:
        """One AdamW update of these (param group, piece) pairs only, each with a gradient,
        scaled by clip; their destinations then hold their values (no other piece is touched)."""
        with span("optimizer_pass"):
            self._update(pieces, 1.0 if clip is None else float(clip), clip)
            self._finish_upload()

    @staticmethod
    def steps_alone(p: torch.Tensor) -> bool:
        """Whether piece p takes the compiled kernel of its own (else torch's step over all small pieces)."""
        return p.numel() >= SMALL_PIECE

    def update_into(self, group: dict, p: torch.Tensor, p_out: torch.Tensor, exp_avg_out: torch.Tensor,
                    exp_avg_sq_out: torch.Tensor) -> None:
        """The next unclipped AdamW update of piece p (one that :meth:`steps_alone`) written into
        p_out and the two moment outputs, and into p's destination; p, its state and its step
        count are left as they were, for the caller to commit (swap the outputs in, count the
        step) or discard (give the destination p's values back). An upload target is not written:
        the device's shard changes only once the caller has committed (then :meth:`send`)."""
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
        pieces a step leaves unchanged, whose destinations the pass does not write. (An upload
        target holds them already: only the pass and publish write it, with the piece's values.)"""
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
            if id(p) in self.uploads:  # (a chunk at a time: each is copied to the device as the next is updated)
                tensors = [t.view(-1) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                for start, end, buffer in self.upload.chunks(self.uploads[id(p)]):
                    _kernels(self.cast_dtype)(*(t[start:end] for t in tensors), buffer, hyper)
            elif out is None:
                _kernels(None)(p, p.grad, state["exp_avg"], state["exp_avg_sq"], hyper)
            else:
                _kernels(self.cast_dtype)(p, p.grad, state["exp_avg"], state["exp_avg_sq"], out, hyper)
        self._step_small(small, clip)
        self.send(small)

    def send(self, pieces: list[torch.Tensor]) -> None:
        """Each piece's values to its upload target, if it has one: pieces updated outside the
        pass (update_into's outputs, committed by the caller)."""
        for p in pieces:
            if id(p) in self.uploads:
                self.upload.send(self.uploads[id(p)], p)
        self._finish_upload()

    def _finish_upload(self) -> None:
        if self.upload is not None:
            self.upload.finish()

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


class Upload(Protocol):
    """Where the pass sends the pieces whose compute-dtype copy lives on an accelerator: the
    pieces' targets and a zero/upload.py ShardUpload."""

    def target_of(self, piece: torch.Tensor) -> torch.Tensor | None:
        """The device tensor that receives the piece's new values (None: the piece has none)."""

    def chunks(self, target: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
        """ShardUpload.chunks."""

    def send(self, target: torch.Tensor, values: torch.Tensor) -> None:
        """ShardUpload.send."""

    def finish(self) -> None:
        """ShardUpload.finish."""


def warn_unavailable(error: KernelUnavailable) -> None:
    """optimizer.impl=auto chose the compiled pass and it is not available: said once."""
    warnings.warn(f"optimizer.impl=auto: the compiled CPU-tier AdamW is not available ({error}); "
                  f"stepping with torch's fused AdamW and a separate cast instead (slower, same update)",
                  RuntimeWarning, stacklevel=3)
