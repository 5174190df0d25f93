"""A torch.distributed.checkpoint (DCP) directory, read without running code of its files: what
FSDP2 runs save (``dcp.save(get_state_dict(model, optimizer))``, torchtitan's checkpointer,
Accelerate's and transformers' Trainer's ``pytorch_model_fsdp_0/`` and ``optimizer_0/``).

The format (torch's ``FileSystemWriter``): ``.metadata`` pickles a ``Metadata`` record listing
every item of the flattened state dict (its key, its path in the nested dict, its global shape
and dtype, and the chunks the saving ranks held: offsets and sizes of each block) and where each
chunk lies (file, offset, length) in the ``__R_N.distcp`` files, each chunk a ``torch.save``'d
tensor; a non-tensor item is ``torch.save``'d bytes. Here ``.metadata`` is read by an unpickler
that builds inert records for DCP's record classes and refuses any other class (DCP's own reader
runs ``pickle.load`` on it), and the chunks with ``torch.load(weights_only=True)``. A flat range
of an item reads only the chunks it overlaps when the chunks are row blocks (FSDP2's dim-0
shards); other blocks (a tensor-parallel column split) are joined whole first.
tiertrain/state/dcp_checkpoint.py loads what is read here into an engine (docs/migrate-fsdp2.md).
"""
from __future__ import annotations

import io
import math
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from .checkpoint import CheckpointError
from ..errors import said

METADATA = ".metadata"

_RECORDS = {"torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                                       "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                                       "StorageMeta", "_MEM_FORMAT_ENCODING"},
            "torch.distributed.checkpoint.filesystem": {"_StorageInfo"}}
"""DCP's record classes (module -> names) that ``.metadata`` may name; read as inert records."""


class _Record:
    """One of DCP's records, inert: its constructor arguments (.args) and pickled state."""

    def __init__(self, *args: Any):
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (a dataclass with __slots__: (dict, slots))
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


def _path(*parts: Any) -> str:
    return os.path.join(*[str(p) for p in parts])


_CONTAINERS = {("builtins", "tuple"): tuple, ("builtins", "list"): list, ("builtins", "dict"): dict,
               ("builtins", "set"): set, ("collections", "OrderedDict"): dict}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's records, torch dtypes, sizes and paths; any other class is refused by name."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _RECORDS.get(module, ()):
            return type(name, (_Record,), {})
        if module == "torch" and name == "Size":
            return tuple
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return str  # (a layout by name: "torch.strided"; unused here)
        if module == "pathlib" and name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
            return _path
        if (module, name) in _CONTAINERS:
            return _CONTAINERS[module, name]
        raise pickle.UnpicklingError(f"{module}.{name} is not one of the DCP metadata records this version reads")


@dataclass(frozen=True)
class _Chunk:
    """One saved block of a tensor item: where it sits in the tensor and in the files."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int
    length: int


@dataclass(frozen=True)
class DcpItem:
    """One tensor item of the checkpoint: its key, path in the saved nested dict, global shape
    and dtype, and its saved chunks."""

    key: str
    path: tuple
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[_Chunk, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def rows(self) -> bool:
        """Every chunk is a block of whole rows (a dim-0 shard), so a flat range of the tensor
        reads only the chunks it overlaps."""
        return all(tuple(c.offsets[1:]) == (0,) * (len(self.shape) - 1) and tuple(c.sizes[1:]) == self.shape[1:]
                   for c in self.chunks)


def _checked(item: DcpItem) -> DcpItem:
    """The item, its chunks checked to lie inside its shape and, when they are row blocks, to
    cover its rows once (other blocks are checked as they are joined: DcpCheckpoint.whole)."""
    for c in item.chunks:
        if not (len(c.offsets) == len(c.sizes) == len(item.shape) and c.start >= 0 and c.length >= 0
                and all(o >= 0 and n >= 0 and o + n <= s for o, n, s in zip(c.offsets, c.sizes, item.shape))):
            raise ValueError(f"a chunk of {item.key!r} (at {c.offsets}, {c.sizes}, bytes {c.start}+{c.length}) lies "
                             f"outside its shape {item.shape}")
    if item.shape and item.rows():
        rows = sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in item.chunks if c.sizes[0])
        if [a for a, _ in rows] != [0] + [b for _, b in rows[:-1]] or (rows[-1][1] if rows else 0) != item.shape[0]:
            raise ValueError(f"the chunks of {item.key!r} do not cover its {item.shape[0]} rows once: {rows}")
    return item


class DcpCheckpoint:
    """A DCP directory's items: ``tensors`` (key -> DcpItem) and ``objects`` (key -> path in the
    saved dict, for the non-tensor items), read by range or whole."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        path = os.path.join(self.directory, METADATA)
        if not os.path.isfile(path):  # (a FIFO or a device in its place would block a read)
            raise CheckpointError(f"{self.directory!r} holds no {METADATA!r} file"
                                  f"{' (only something that is not a regular file)' if os.path.lexists(path) else ''}"
                                  f": not a torch.distributed.checkpoint directory")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            self._index(metadata)
        except Exception as e:  # (any error of reading these bytes: only inert records are built)
            raise CheckpointError(f"{path!r} is not DCP metadata this version reads ({said(e)})") from e

    def _index(self, metadata: Any) -> None:
        storage = {(i.fqn, tuple(getattr(i, "offset", None) or ())): s for i, s in metadata.storage_data.items()}
        planner = getattr(metadata, "planner_data", None) or {}
        self.tensors: dict[str, DcpItem] = {}
        self.objects: dict[str, tuple] = {}
        for key, item in metadata.state_dict_metadata.items():
            path = tuple(planner.get(key, (key,)))
            if type(item).__name__ == "BytesStorageMetadata":
                self.objects[key] = path
                continue
            chunks = []
            for c in item.chunks:
                info = storage[(key, tuple(c.offsets))]
                if getattr(info, "transform_descriptors", None):
                    raise ValueError(f"item {key!r} is stored with transforms {info.transform_descriptors} "
                                     f"(compression or other extensions), which this version does not read")
                chunks.append(_Chunk(tuple(map(int, c.offsets)), tuple(map(int, c.sizes)), str(info.relative_path),
                                     int(info.offset), int(info.length)))
            dtype = item.properties.dtype if hasattr(item.properties, "dtype") else item.properties.state[0]
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"item {key!r} has dtype {dtype!r}")
            self.tensors[key] = _checked(DcpItem(key, path, tuple(map(int, item.size)), dtype, tuple(chunks)))
        self._storage = storage

    def _load(self, file: str, start: int, length: int) -> Any:
        path = os.path.join(self.directory, file)
        if os.path.dirname(os.path.normpath(file)) or not os.path.isfile(path):
            raise CheckpointError(f"{self.directory!r}: the metadata names the data file {file!r}, which "
                                  f"{'is not in the directory' if os.path.dirname(file) else 'does not exist'}")
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(length)
        if len(data) != length:
            raise CheckpointError(f"{path!r} ends before the {length} bytes at offset {start} its metadata names "
                                  f"(a truncated checkpoint)")
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # (pickle's, zip's and torch's errors alike: the bytes are no saved item)
            raise CheckpointError(f"{path!r}: the {length} bytes at offset {start} its metadata names are not a "
                                  f"saved item ({said(e)})") from e

    def _chunk(self, item: DcpItem, chunk: _Chunk) -> torch.Tensor:
        value = self._load(chunk.file, chunk.start, chunk.length)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != chunk.sizes:
            raise CheckpointError(f"{self.directory!r}: a chunk of {item.key!r} holds "
                                  f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}"
                                  f", its metadata says a tensor of {chunk.sizes}")
        return value

    def whole(self, key: str) -> torch.Tensor:
        """The tensor item whole, its chunks joined (in its saved dtype)."""
        item = self.tensors[key]
        out = torch.empty(item.shape, dtype=item.dtype)
        covered = torch.zeros(item.shape, dtype=torch.bool)
        for chunk in item.chunks:
            block, mask = out, covered
            for d, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes)):
                block, mask = block.narrow(d, o, n), mask.narrow(d, o, n)
            if mask.any():
                raise CheckpointError(f"{self.directory!r}: the chunks of {item.key!r} overlap (at {chunk.offsets})")
            block.copy_(self._chunk(item, chunk))
            mask.fill_(True)
        if not covered.all():
            raise CheckpointError(f"{self.directory!r}: the chunks of {item.key!r} cover {int(covered.sum())} of its "
                                  f"{item.numel} elements")
        return out

    def read(self, key: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of the tensor item, flattened (in its saved dtype); of row-block chunks
        only those overlapping the range are read."""
        item = self.tensors[key]
        if not item.rows() or not item.shape:
            return self.whole(key).reshape(-1)[a:b]
        row = math.prod(item.shape[1:])
        out = torch.empty(b - a, dtype=item.dtype)
        filled = 0
        for chunk in item.chunks:
            lo, hi = chunk.offsets[0] * row, (chunk.offsets[0] + chunk.sizes[0]) * row
            x, y = max(a, lo), min(b, hi)
            if x < y:
                out[x - a:y - a] = self._chunk(item, chunk).reshape(-1)[x - lo:y - lo]
                filled += y - x
        if filled != b - a:
            raise CheckpointError(f"{self.directory!r}: the chunks of {item.key!r} cover {filled} of its elements "
                                  f"[{a}, {b})")
        return out

    def object(self, key: str) -> Any:
        """A non-tensor item (torch.save'd bytes), read with the weights-only unpickler."""
        info = self._storage[(key, ())]
        return self._load(info.relative_path, int(info.offset), int(info.length))


class NestedState:
    """A nested state dict already in memory, read as a DcpCheckpoint reads a directory: each
    tensor an item at its path of keys (``tensors``), every other leaf an object."""

    def __init__(self, directory: str, state: dict):
        self.directory = directory
        self.tensors: dict[str, DcpItem] = {}
        self.objects: dict[str, tuple] = {}
        self._values: dict[str, Any] = {}
        self._add((), state)

    def _add(self, path: tuple, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                self._add(path + (k,), v)
            return
        key = ".".join(str(p) for p in path)
        self._values[key] = value
        if isinstance(value, torch.Tensor):
            self.tensors[key] = DcpItem(key, path, tuple(value.shape), value.dtype, ())
        else:
            self.objects[key] = path

    def whole(self, key: str) -> torch.Tensor:
        return self._values[key]

    def read(self, key: str, a: int, b: int) -> torch.Tensor:
        return self._values[key].reshape(-1)[a:b]

    def object(self, key: str) -> Any:
        return self._values[key]


__all__ = ["DcpCheckpoint", "DcpItem", "METADATA", "NestedState"]
