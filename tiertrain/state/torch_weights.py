"""Weights written by ``torch.save`` read as load_pretrained reads safetensors
(tiertrain/state/pretrained.py): a Hugging Face ``pytorch_model.bin`` (sharded: with
``pytorch_model.bin.index.json``), or a training script's ``torch.save(model.state_dict(),
"ckpt.pt")``, also nested one level (``{"state_dict": ...}``, ``{"model": ...}``).

A file in torch's zip format is memory-mapped (only the bytes a rank reads are touched, as
with safetensors); one in the legacy format cannot be, and is read whole once. Either is
unpickled with torch's weights-only unpickler: no code in the file runs.

Names a wrapper added when the state dict was taken are taken off (:class:`UnwrappedNames`):
``module.`` in front (DistributedDataParallel, DeepSpeed), and ``_orig_mod.`` (torch.compile),
``_fsdp_wrapped_module.`` (FSDP1), ``_checkpoint_wrapped_module.`` (torch's checkpoint
wrapper) wherever they stand, each only where the model's own names hold no such part.
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch

TORCH_SINGLE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_SUFFIXES = (".bin", ".pt", ".pth")
NESTED = ("state_dict", "model_state_dict", "model", "module")
"""Where a saved dict holding more than the model's tensors keeps them (Lightning, many scripts)."""


class WeightReads:
    """What a reader of a checkpoint's tensors counts (LoadReport: bytes, largest, reads) and
    how it reads a range of a tensor: only the rows of its first dimension that hold it."""

    def __init__(self, report):
        self.report = report
        self._file: dict[str, str] = {}  # tensor name -> the file holding it

    def _place(self, key: str, path: str) -> None:
        """Tensor key is in file path (once in the checkpoint: a second file holding it is refused)."""
        if key in self._file:
            raise ValueError(f"load_pretrained: tensor {key!r} is in both {self._file[key]!r} and {path!r}")
        self._file[key] = path

    def _count(self, t: torch.Tensor, key: str) -> torch.Tensor:
        """t, read of tensor key: counted, and its inf and NaN values (fp16 and wider) noted."""
        nbytes = t.numel() * t.element_size()
        self.report.bytes_read += nbytes
        self.report.largest_read = max(self.report.largest_read, nbytes)
        self.report.reads += 1
        # (a sum holds an inf or NaN of its terms, at memory speed; an element-wise check, 20-50×
        # slower, only where it is not finite: an fp16 sum may overflow on finite terms)
        if t.is_floating_point() and t.element_size() > 1 and not torch.isfinite(t.sum()):
            bad = t.numel() - int(torch.isfinite(t).sum())
            if bad:
                self.report.nonfinite[key] = self.report.nonfinite.get(key, 0) + bad
        return t

    def _rows(self, key: str, r0: int, r1: int) -> torch.Tensor:
        raise NotImplementedError

    def read(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def read_flat(self, key: str, shape: tuple[int, ...], start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the row-major flattened tensor, reading only the rows of
        the first dimension that hold them (rows start//row .. (end-1)//row)."""
        if len(shape) == 0:
            return self.read(key).reshape(-1)[start:end]
        row = math.prod(shape[1:])
        r0, r1 = start // row, (end - 1) // row + 1
        rows = self._count(self._rows(key, r0, r1), key)
        return rows.reshape(-1)[start - r0 * row:end - r0 * row]


def _state_dict_in(saved: Any, path: str) -> dict[str, torch.Tensor]:
    """The tensors by name in what a file holds: all of it, or its one entry under NESTED that is."""
    def tensors_only(d: Any) -> bool:
        return isinstance(d, dict) and bool(d) and all(isinstance(v, torch.Tensor) for v in d.values())

    if tensors_only(saved):
        return saved
    found = [k for k in NESTED if isinstance(saved, dict) and tensors_only(saved.get(k))]
    if len(found) == 1:
        return saved[found[0]]
    what = f"a dict with keys {sorted(map(str, saved))[:10]}" if isinstance(saved, dict) else type(saved).__name__
    raise ValueError(f"load_pretrained: {path!r} holds {what}, not a state dict (tensor names -> tensors)"
                     + (f" nor one under exactly one of {list(NESTED)}" if isinstance(saved, dict) else "")
                     + ": save the model's state dict alone (torch.save(model.state_dict(), path)) or give a "
                       "safetensors checkpoint")


class TorchWeights(WeightReads):
    """The tensors of torch.save files, memory-mapped where the format allows (see the module
    docstring), under the same interface as the safetensors reader."""

    def __init__(self, files: list[str], report):
        super().__init__(report)
        self._tensors: dict[str, torch.Tensor] = {}
        for path in files:
            with open(path, "rb") as f:
                zipped = f.read(4) == b"PK\x03\x04"
            try:
                saved = torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
            except Exception as e:  # (pickle's and torch's errors alike: not a file read here)
                raise ValueError(f"load_pretrained: {path!r} cannot be read with torch.load(weights_only=True), "
                                 f"which runs no code of the file ({type(e).__name__}: {str(e)[:300]}); save the "
                                 f"model's state dict alone (torch.save(model.state_dict(), path))") from None
            for key, value in _state_dict_in(saved, path).items():
                self._place(key, path)
                self._tensors[key] = value

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def stored_dtype(self, key: str) -> torch.dtype:
        return self._tensors[key].dtype

    def read(self, key: str) -> torch.Tensor:
        return self._count(self._tensors[key].clone(), key)

    def _rows(self, key: str, r0: int, r1: int) -> torch.Tensor:
        return self._tensors[key][r0:r1].clone()


_ANYWHERE = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
_IN_FRONT = "module"


class UnwrappedNames:
    """A checkpoint reader under names with the wrappers' parts taken off (see the module
    docstring); ``removed``: the parts taken off."""

    def __init__(self, raw, renamed: dict[str, str], removed: list[str]):
        self.raw = raw
        self._raw_key = renamed
        self.removed = removed

    def keys(self) -> list[str]:
        return list(self._raw_key)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.raw.shape(self._raw_key[key])

    def read(self, key: str) -> torch.Tensor:
        return self.raw.read(self._raw_key[key])

    def read_flat(self, key: str, shape: tuple[int, ...], start: int, end: int) -> torch.Tensor:
        return self.raw.read_flat(self._raw_key[key], shape, start, end)


def unwrapped(raw, model_names: set[str]):
    """raw, or an :class:`UnwrappedNames` view of it where its names hold wrappers' parts that
    the model's names do not."""
    parts = lambda name: name.split(".")  # noqa: E731
    own = {p for name in model_names for p in parts(name)}
    anywhere = [w for w in _ANYWHERE if w not in own]
    in_front = _IN_FRONT not in {parts(name)[0] for name in model_names}
    renamed: dict[str, str] = {}
    removed: set[str] = set()
    for key in raw.keys():
        kept = [p for p in parts(key) if p not in anywhere]
        removed.update(p for p in parts(key) if p in anywhere)
        while in_front and len(kept) > 1 and kept[0] == _IN_FRONT:
            kept = kept[1:]
            removed.add(_IN_FRONT + ". in front")
        name = ".".join(kept)
        if name in renamed:
            raise ValueError(f"load_pretrained: checkpoint tensors {renamed[name]!r} and {key!r} are both "
                             f"{name!r} once the wrappers' parts of their names are taken off")
        renamed[name] = key
    if not removed:
        return raw
    return UnwrappedNames(raw, renamed, sorted(removed))


def is_torch_file(path: str) -> bool:
    return os.path.splitext(path)[1] in TORCH_SUFFIXES


__all__ = ["NESTED", "TORCH_INDEX", "TORCH_SINGLE", "TORCH_SUFFIXES", "TorchWeights", "UnwrappedNames",
           "WeightReads", "is_torch_file", "unwrapped"]
