"""Hugging Face ``*.safetensors`` checkpoints, by shard: read into a split model, written back from one.

**Read** (``pretrained=``): the folder ``save_pretrained`` writes (``model.safetensors``, or
``model-0000N-of-0000M.safetensors`` with ``model.safetensors.index.json``). Every file's header is read first
(names, shapes, dtypes; :func:`read_index`), the checkpoint's names are matched to the module's state dict
(:func:`match`: the module may hold the Hugging Face model under a prefix, e.g. a LightningModule's ``self.model``),
and every missing, unexpected or misshaped tensor is named in one error before anything is read. Then DCP loads
(``torch.distributed.checkpoint.load``, its ``HuggingFaceStorageReader``): each rank plans the pieces of the tensors
it holds (a DTensor's local shard, a pipeline rank's stages) and reads only those bytes, converted to the tensor's
dtype. :class:`ShardReader` replaces the reader's ``safe_open`` (a memory map) by plain reads of the byte ranges: a
mapped page counts in the process's resident memory, and a slice along a tensor's second dimension (a row-parallel
weight) touches every page of the tensor; plain reads hold one slice at a time.

**Write** (:func:`save_pretrained`): DCP's ``HuggingFaceStorageWriter`` writes each rank's shards, then
``consolidate_safetensors_files_on_every_rank`` joins them into whole-tensor files, each output file by one rank
(byte ranges copied, no rank holding the model), with ``model.safetensors.index.json``; the Hugging Face
``config.json`` beside them. ``from_pretrained`` loads the folder.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

SUFFIX = ".safetensors"
INDEX = "model.safetensors.index.json"
#: A slice along a later dimension is read this many bytes of whole rows at a time.
READ_CHUNK_BYTES = 64 * 2**20
#: Output files of an export (at most): each is written by one rank.
EXPORT_FILE_BYTES = 2 * 2**30

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


class PretrainedError(ValueError):
    """A pretrained checkpoint that does not fit the model (names, shapes), or no checkpoint at all."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a ``*.safetensors`` file, from its header: where its bytes lie, its shape and dtype."""

    file: Path
    start: int  # absolute byte offset in the file
    shape: tuple[int, ...]
    dtype: torch.dtype


def files_of(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a folder (or the one file ``path`` names)."""
    path = Path(path)
    if path.is_file() and path.suffix == SUFFIX:
        return [path]
    files = sorted(path.glob(f"*{SUFFIX}")) if path.is_dir() else []
    if not files:
        raise PretrainedError(
            f"pretrained={str(path)!r}: no *{SUFFIX} file there. Give the folder a Hugging Face model's"
            " save_pretrained() wrote (model.safetensors or model-0000N-of-0000M.safetensors), or one .safetensors"
            " file."
        )
    return files


def read_header(file: Path) -> dict[str, StoredTensor]:
    """The tensors of one ``*.safetensors`` file, from its header only (8 bytes of length, then JSON)."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise PretrainedError(f"{file}: tensor {name!r} has dtype {info['dtype']}, which is not supported")
        start = 8 + length + info["data_offsets"][0]
        out[name] = StoredTensor(file, start, tuple(info["shape"]), _DTYPES[info["dtype"]])
    return out


def read_index(path: str | Path) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint at ``path`` (a folder or one file), from the files' headers."""
    index: dict[str, StoredTensor] = {}
    for file in files_of(path):
        index.update(read_header(file))
    return index


# --------------------------------------------------------------------------------------------------- names
@dataclass(frozen=True)
class Match:
    """How a checkpoint's names map to a module's state dict: ``prefix + name``; and what does not fit."""

    prefix: str
    keys: dict[str, str]  # checkpoint name -> state dict key, for every tensor read
    missing: list[str]  # state dict keys (parameters) the checkpoint lacks
    unexpected: list[str]  # checkpoint names the module has no place for
    misshaped: list[tuple[str, tuple[int, ...], tuple[int, ...]]]  # (name, in the checkpoint, in the module)

    def problem(self, path: str | Path, limit: int = 8) -> str | None:
        """The error text naming every tensor that does not fit, with the fix; None when all fit."""
        parts = []

        def listed(names: list[str]) -> str:
            more = f" and {len(names) - limit} more" if len(names) > limit else ""
            return ", ".join(names[:limit]) + more

        if self.missing:
            parts.append(f"missing from the checkpoint: {listed(self.missing)}")
        if self.unexpected:
            parts.append(f"in the checkpoint, not in the model: {listed(self.unexpected)}")
        if self.misshaped:
            shown = [f"{n} {list(a)} in the checkpoint, {list(b)} in the model" for n, a, b in self.misshaped]
            parts.append(f"different shapes: {listed(shown)}")
        if not parts:
            return None
        where = f" (the checkpoint's names read under {self.prefix!r})" if self.prefix else ""
        return (
            f"pretrained={str(path)!r} does not fit the model{where}: " + "; ".join(parts) + ". Build the model from"
            " the same configuration as the checkpoint (config.json beside it), or load a checkpoint of this model."
        )


def match(
    state: dict[str, Tensor], stored: dict[str, tuple[int, ...]], optional: Iterable[str] = (), ignored: str = ""
) -> Match:
    """Map checkpoint names (``stored``: name -> shape) to the module's state dict keys (``state``: key -> tensor,
    global shapes). The prefix is the one under which most checkpoint names are found (a LightningModule holding
    the Hugging Face model as ``self.model``: ``"model."``). A key in ``optional`` may be absent (a buffer the
    model computes; the second name of a tied tensor); a checkpoint name matching the regex ``ignored`` may have no
    place (the model's ``_keys_to_ignore_on_load_unexpected``)."""
    prefixes = {""} | {k[: i + 1] for k in state for i, c in enumerate(k) if c == "."}
    prefix = max(sorted(prefixes, key=len), key=lambda p: sum(p + n in state for n in stored))
    keys = {n: prefix + n for n in stored if prefix + n in state}
    held = set(keys.values())
    optional = set(optional)
    # a tied tensor counts as loaded under any of its names
    loaded_ids = {id(state[k]) for k in held}
    missing = [
        k
        for k in state
        if k.startswith(prefix) and k not in held and k not in optional and id(state[k]) not in loaded_ids
    ]
    unexpected = [n for n in stored if n not in keys and not (ignored and re.search(ignored, n))]
    misshaped = [
        (n, tuple(stored[n]), tuple(state[k].shape))
        for n, k in keys.items()
        if tuple(stored[n]) != tuple(state[k].shape)
    ]
    return Match(prefix, keys, missing, unexpected, misshaped)


def renamed(index: dict[str, StoredTensor], model: Any) -> dict[str, StoredTensor]:
    """The checkpoint's names as ``model`` (a ``transformers`` model) calls its tensors: the renamings
    ``from_pretrained`` applies (GPT-NeoX's ``embed_out`` is ``lm_head``). A checkpoint that needs a conversion of
    the tensors themselves (experts stored one by one, the model holding them stacked) cannot be read by shard: it is
    refused, named."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # another transformers: names as stored
        return index
    transforms = get_model_conversion_mapping(model) or []
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    out, converted = {}, []
    for name, stored in index.items():
        new, pattern = rename_source_key(name, renamings, converters)
        if pattern is not None:
            converted.append(name)
        out[new] = stored
    if converted:
        raise PretrainedError(
            f"{type(model).__name__}'s checkpoint stores {converted[:4]}{' ...' if len(converted) > 4 else ''} in a"
            " layout transformers converts while loading (several tensors into one): that cannot be read by shard."
            " Convert it once, in one process: model = from_pretrained(folder);"
            " model.save_pretrained(new_folder, save_original_format=False) (the model's own layout), then give"
            " new_folder as pretrained."
        )
    return out


# --------------------------------------------------------------------------------------------------- reading
def read_slice(f: Any, stored: StoredTensor, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> Tensor:
    """The block ``offsets``/``lengths`` of ``stored``, read with plain reads from the open file ``f``: one read when
    the block is whole rows, else whole rows a chunk at a time (at most :data:`READ_CHUNK_BYTES` held)."""
    shape, itemsize = stored.shape, torch.empty((), dtype=stored.dtype).element_size()
    if not shape:
        f.seek(stored.start)
        return _from_bytes(f.read(itemsize), stored.dtype, ())
    row = math.prod(shape[1:]) * itemsize  # bytes of one index of dim 0
    first, count = offsets[0], lengths[0]
    whole_rows = all(o == 0 and n == s for o, n, s in zip(offsets[1:], lengths[1:], shape[1:]))
    if whole_rows:
        f.seek(stored.start + first * row)
        return _from_bytes(f.read(count * row), stored.dtype, (count, *shape[1:]))
    out = torch.empty(lengths, dtype=stored.dtype)
    rows_per_read = max(1, READ_CHUNK_BYTES // max(row, 1))
    inner = tuple(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:]))
    for done in range(0, count, rows_per_read):
        n = min(rows_per_read, count - done)
        f.seek(stored.start + (first + done) * row)
        rows = _from_bytes(f.read(n * row), stored.dtype, (n, *shape[1:]))
        out[done : done + n] = rows[(slice(None), *inner)]
    return out


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape) if data else torch.empty(shape, dtype=dtype)


def _reader_class() -> type:
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    class ShardReader(HuggingFaceStorageReader):
        """DCP's Hugging Face reader, reading each planned piece with plain reads (:func:`read_slice`) instead of
        through a memory map."""

        def __init__(self, path: str, index: dict[str, StoredTensor]) -> None:
            super().__init__(path)
            self.index = index

        def read_metadata(self) -> Any:
            """DCP's metadata from the headers already read (``index``: names as the model calls them)."""
            from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
            from torch.distributed.checkpoint.metadata import (
                ChunkStorageMetadata,
                Metadata,
                MetadataIndex,
                StorageMeta,
                TensorProperties,
                TensorStorageMetadata,
            )

            tensors, storage = {}, {}
            for name, stored in self.index.items():
                size, origin = torch.Size(stored.shape), [0] * len(stored.shape)
                chunk = ChunkStorageMetadata(offsets=torch.Size(origin), sizes=size)
                tensors[name] = TensorStorageMetadata(TensorProperties(dtype=stored.dtype), size, [chunk])
                storage[MetadataIndex(fqn=name, offset=origin)] = _HFStorageInfo(str(stored.file), size, stored.dtype)
            return Metadata(state_dict_metadata=tensors, storage_data=storage, storage_meta=StorageMeta())

        def read_data(self, plan: Any, planner: Any) -> Any:
            from torch.futures import Future

            per_file: dict[Path, list[Any]] = {}
            for item in plan.items:
                per_file.setdefault(self.index[item.storage_index.fqn].file, []).append(item)
            for file, items in per_file.items():
                with open(file, "rb", buffering=0) as f:
                    for item in items:
                        piece = read_slice(
                            f, self.index[item.storage_index.fqn], tuple(item.storage_offsets), tuple(item.lengths)
                        )
                        target = planner.resolve_tensor(item).detach()
                        target.copy_(piece)  # the dtype the model asks for
                        planner.commit_tensor(item, target)
            done: Future = Future()
            done.set_result(None)
            return done

    return ShardReader


def load(path: str | Path, targets: dict[str, Tensor], index: dict[str, StoredTensor]) -> None:
    """Read the checkpoint's tensors named in ``targets`` (checkpoint name -> this rank's tensor: plain, or a
    DTensor whose local shard is filled) in place: each rank reads the bytes of what it holds. A collective over
    the default process group when one exists: every rank calls it (with its own ``targets``, maybe none)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    reader = _reader_class()(str(folder), index)
    planner = DefaultLoadPlanner(allow_partial_load=True)  # a rank holds some tensors only (its stages)
    dcp.load(targets, storage_reader=reader, planner=planner, no_dist=not dist.is_initialized())


# --------------------------------------------------------------------------------------------------- writing
def export_names(state: dict[str, Tensor], prefix: str, keep_meta: bool = False) -> dict[str, Tensor]:
    """The tensors a Hugging Face checkpoint holds: the keys under ``prefix`` (stripped), a tied tensor once (under
    its first name, as ``save_pretrained``), a pipeline rank's released parameters (meta) left to their holders
    (``keep_meta``: kept, for the names and sizes every rank must agree on)."""
    out, seen = {}, set()
    for key, tensor in state.items():
        if not key.startswith(prefix) or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if _local(tensor).is_meta and not keep_meta:
            continue
        out[key[len(prefix) :]] = tensor
    return out


def file_indices(sizes: dict[str, int], file_bytes: int = EXPORT_FILE_BYTES) -> dict[str, int]:
    """Each tensor's output file (1-based), in order, a new file when ``file_bytes`` would be exceeded."""
    out, index, used = {}, 1, 0
    for name, size in sizes.items():
        if used and used + size > file_bytes:
            index, used = index + 1, 0
        out[name] = index
        used += size
    return out


def save_pretrained(
    tensors: dict[str, Tensor],
    sizes: dict[str, int],
    path: str | Path,
    rank: int,
    barrier: Callable[[], None],
    config: Any | None = None,
) -> Path:
    """Write ``tensors`` (this rank's: plain or DTensors; ``sizes``: every exported tensor's bytes, the same on every
    rank) as a Hugging Face folder at ``path``: every rank writes its shards, each output file is joined by one rank,
    rank 0 writes the index and ``config`` (a ``transformers`` config: ``config.json``). A collective."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

    path = Path(path)
    pieces = path / ".sharded"
    if rank == 0:
        shutil.rmtree(pieces, ignore_errors=True)
        path.mkdir(parents=True, exist_ok=True)
    barrier()
    mapping = file_indices(sizes)
    writer = HuggingFaceStorageWriter(str(pieces), fqn_to_index_mapping=mapping, save_distributed=True)
    dcp.save(tensors, storage_writer=writer, no_dist=not dist.is_initialized())
    barrier()
    consolidate_safetensors_files_on_every_rank(str(pieces), str(path), mapping)
    barrier()
    if rank == 0:
        shutil.rmtree(pieces, ignore_errors=True)
        # torch writes the index only under a process group; from_pretrained needs it
        if mapping and not dist.is_initialized():
            from torch.distributed.checkpoint._hf_utils import _gen_file_name

            files = {n: _gen_file_name(i, max(mapping.values())) for n, i in mapping.items()}
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": files}
            (path / INDEX).write_text(json.dumps(index, indent=2))
        if config is not None:
            config.save_pretrained(str(path))
    barrier()
    return path


def _local(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def find_hf_model(module: nn.Module) -> tuple[str, Any] | None:
    """The outermost ``transformers`` model inside ``module`` (its name as a prefix, e.g. ``"model."``, and the
    model), or None."""
    for name, sub in module.named_modules():
        if hasattr(sub, "config") and hasattr(sub, "_init_weights") and hasattr(sub.config, "save_pretrained"):
            return (f"{name}." if name else ""), sub
    return None
