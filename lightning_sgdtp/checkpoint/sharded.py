"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): save, load on any mesh, consolidate.

A sharded checkpoint is a folder: DCP's ``.metadata`` and one ``*.distcp`` file per rank (each rank writes
only its shards; replicated tensors are written once), ``meta.pt`` with the rest of Lightning's checkpoint
(loops, callbacks, hyper-parameters), and ``SGDTP-MANIFEST.json`` (SHA256 of every file, signed with
``signing_key``). The folder is written under a temporary name and renamed by rank 0 once every rank is
done: a crash mid-save leaves the previous checkpoint whole.

Model and optimizer states are keyed by parameter name (``torch.distributed.checkpoint.state_dict``), so a
checkpoint written on one mesh loads on another: DCP reads, for each rank, the part of each tensor that
rank holds (trained ``tp=2``, resumed ``dp=2``, and the reverse). :func:`consolidate` turns the folder into
one ``torch.save`` file that plain PyTorch loads; :func:`consolidate_hf` into a Hugging Face folder
(``*.safetensors`` and their index) that ``from_pretrained`` loads, one tensor in memory at a time.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import warnings
from collections.abc import Callable, Collection, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_sgdtp.trust.durable import fsync_path, write_atomically

META = "meta.pt"
MODEL_KEY = "state_dict"


def is_sharded(path: str | os.PathLike) -> bool:
    """A folder written by :func:`save` (or any DCP checkpoint)."""
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def save(
    path: Path,
    checkpoint: dict[str, Any],
    rank: int,
    token: str,
    barrier: Callable[[], None],
    signing_key: str | None = None,
) -> None:
    """Write Lightning's ``checkpoint`` (``state_dict`` and ``optimizer_states`` keyed by name) as a sharded folder.

    Every rank calls it with the same ``path`` and ``token`` (a name for the temporary folder, from rank 0).
    """
    import torch.distributed.checkpoint as dcp

    from lightning_sgdtp.trust.signatures import sign_with

    rest = dict(checkpoint)
    state = {MODEL_KEY: rest.pop(MODEL_KEY)}
    for i, optimizer_state in enumerate(rest.pop("optimizer_states", [])):
        state[optimizer_key(i)] = optimizer_state
    tmp = path.with_name(f".{path.name}.tmp-{token}")
    dcp.save(state, checkpoint_id=tmp)
    if rank == 0:
        torch.save(rest, tmp / META)
        sign_with(tmp, signing_key)
    barrier()  # every rank's shards are on disk
    if rank == 0:
        publish(tmp, path)
        for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by saves killed mid-write
            shutil.rmtree(stale, ignore_errors=True)
    barrier()


def publish(tmp: Path, path: Path) -> None:
    """Put the finished folder ``tmp`` at ``path``. With a previous one there, both names are swapped in one
    atomic ``renameat2(RENAME_EXCHANGE)`` (Linux), so ``path`` is never missing; elsewhere, two renames."""
    if path.exists() and _exchange(tmp, path):
        old = tmp  # now holds the previous checkpoint
    else:
        old = path.with_name(f"{tmp.name}.old")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    fsync_path(path.parent)
    if old.is_dir():
        shutil.rmtree(old)
    elif old.exists():
        old.unlink()


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2`` with ``RENAME_EXCHANGE``). False where unavailable."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def load(
    path: Path,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    weights_only: bool | None = None,
    partial_optimizer: bool = False,
) -> dict[str, Any]:
    """Load a sharded folder into ``model`` and ``optimizers`` as they are laid out now; return the rest.

    ``partial_optimizer``: an optimizer may hold state for some parameters only (a pipeline rank steps its
    stages' parameters): load what it holds, do not require the rest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {MODEL_KEY: get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    with warnings.catch_warnings():
        if partial_optimizer:  # a pipeline rank after fit: the other stages' parameters are released (meta) here
            warnings.filterwarnings("ignore", message=".*to a meta parameter in the current model, which is a no-op")
        set_model_state_dict(model, state[MODEL_KEY])
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    for i, optimizer in enumerate(optimizers):
        optim_state = {optimizer_key(i): get_optimizer_state_dict(model, optimizer)}
        # A parameter that had no optimizer state when the checkpoint was written (never got a gradient: AdamW keeps
        # nothing for it) has none after loading either; torch's state-dict helpers made one up for every parameter.
        per_param = optim_state[optimizer_key(i)].get("state", {})
        stateless = [n for n in per_param if not any(k.startswith(f"{optimizer_key(i)}.state.{n}.") for k in saved)]
        for name in stateless:
            del per_param[name]
        dcp.load(optim_state, checkpoint_id=path)
        options = StateDictOptions(strict=not (partial_optimizer or stateless))
        set_optimizer_state_dict(model, optimizer, optim_state[optimizer_key(i)], options=options)
    return torch.load(path / META, map_location="cpu", weights_only=weights_only)


def load_full(checkpoint: dict[str, Any], model: nn.Module, optimizers: Sequence[Optimizer]) -> dict[str, Any]:
    """Load a one-file checkpoint (full tensors) into a model and optimizers that may be split across ranks."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    rest = dict(checkpoint)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, rest.pop(MODEL_KEY), options=options)
    states = rest.pop("optimizer_states", [])
    for optimizer, optim_state in zip(optimizers, states):
        set_optimizer_state_dict(model, optimizer, by_name(optim_state, model, optimizer), options=options)
    return rest


def by_name(optim_state: dict[str, Any], model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` (keyed by position) re-keyed by parameter name, as DCP's state dicts are."""
    groups = optim_state.get("param_groups", [])
    if all(isinstance(i, str) for g in groups for i in g["params"]):
        return optim_state
    names = {id(p): n for n, p in model.named_parameters()}
    ordered = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    positions = [i for g in groups for i in g["params"]]
    if len(positions) != len(ordered):
        raise ValueError(
            f"the checkpoint's optimizer has {len(positions)} parameters, this one {len(ordered)}: it was written"
            " for another model or optimizer configuration."
        )
    to_name = dict(zip(positions, ordered))
    state = {to_name[k]: v for k, v in optim_state.get("state", {}).items()}
    new_groups = [{**g, "params": [to_name[i] for i in g["params"]]} for g in groups]
    return {"state": state, "param_groups": new_groups}


def consolidate(path: str | os.PathLike, output: str | os.PathLike) -> Path:
    """Merge a sharded checkpoint folder into one file (Lightning's layout; ``torch.load(output)["state_dict"]``
    is the full model state dict, keyed by parameter name). Runs in one process, no process group needed."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, output = Path(path), Path(output)
    if not is_sharded(path):
        raise FileNotFoundError(f"{path} is not a sharded checkpoint folder (no .metadata inside).")
    output.parent.mkdir(parents=True, exist_ok=True)
    staged = output.with_name(f".{output.name}.dcp-{os.getpid()}")  # DCP's own single-file form, read back at once
    try:
        dcp_to_torch_save(path, staged)
        full = torch.load(staged, map_location="cpu", weights_only=False)
    finally:
        staged.unlink(missing_ok=True)
    meta = torch.load(path / META, map_location="cpu", weights_only=False) if (path / META).exists() else {}
    keys = sorted((k for k in full if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    merged = {**meta, MODEL_KEY: full[MODEL_KEY], "optimizer_states": [full[k] for k in keys]}
    write_atomically(output, lambda f: torch.save(merged, f))
    return output


# ------------------------------------------------------------------------------------------- Hugging Face
def consolidate_hf(
    path: str | os.PathLike,
    output: str | os.PathLike,
    prefix: str | None = None,
    config: str | os.PathLike | None = None,
    file_bytes: int = 2 * 2**30,
) -> Path:
    """Write the model of a sharded checkpoint folder as a Hugging Face folder at ``output``:
    ``model-0000N-of-0000M.safetensors`` (at most ``file_bytes`` each, unless one tensor is larger) and
    ``model.safetensors.index.json``. One process, no process group; one tensor in memory at a time (each file's
    header comes from DCP's metadata, then each tensor is read alone and its bytes appended).

    Names are the checkpoint's model keys without the LightningModule's path to the Hugging Face model: ``prefix``
    (``"model."`` for ``self.model``), or the one under which the names fit the model ``config`` describes (a
    folder with ``config.json``: the model is built on the meta device, every name and shape checked against it;
    ``config.json`` and ``generation_config.json`` are copied), or else the leading components all names share.
    Every key is written, a tied tensor under each of its names (``from_pretrained`` ignores the second)."""
    import torch.distributed.checkpoint as dcp

    from lightning_sgdtp.checkpoint.huggingface import INDEX, file_indices

    path, output = Path(path), Path(output)
    if not is_sharded(path):
        raise FileNotFoundError(f"{path} is not a sharded checkpoint folder (no .metadata inside).")
    config = Path(config) if config is not None else None
    tensors = model_tensors(path)
    names = hf_names(tensors, prefix, *(_hf_model_names(config) if config is not None else ()))
    sizes = {name: math.prod(tensors[key][0]) * tensors[key][1].itemsize for key, name in names.items()}
    numbers = file_indices(sizes, file_bytes)
    files = {name: f"model-{i:05d}-of-{max(numbers.values()):05d}.safetensors" for name, i in numbers.items()}
    per_file: dict[str, dict[str, tuple[str, tuple[int, ...], torch.dtype]]] = {}
    for key, name in names.items():
        per_file.setdefault(files[name], {})[name] = (key, *tensors[key])
    output.mkdir(parents=True, exist_ok=True)
    reader = dcp.FileSystemReader(str(path))
    for file, entries in per_file.items():
        write_atomically(output / file, partial(_write_safetensors, entries=entries, reader=reader))
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": files}
    write_atomically(output / INDEX, lambda f: f.write(json.dumps(index, indent=2).encode()))
    # Files of an earlier export there would be read instead (model.safetensors comes before the index) or beside.
    for stale in [output / "model.safetensors", *output.glob("model-*-of-*.safetensors")]:
        if stale.name not in files.values():
            stale.unlink(missing_ok=True)
    for src in [config / "config.json", config / "generation_config.json"] if config is not None else []:
        if src.is_file():
            write_atomically(output / src.name, partial(_copy, src))
    fsync_path(output)
    return output


def model_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The model's tensors in a sharded folder, from DCP's metadata alone: key (without ``state_dict.``) -> (global
    shape, dtype), in the checkpoint's order."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    start = f"{MODEL_KEY}."
    tensors = {
        key[len(start) :]: (tuple(item.size), item.properties.dtype)
        for key, item in metadata.items()
        if key.startswith(start) and isinstance(item, TensorStorageMetadata)
    }
    if not tensors:
        raise ValueError(f"{path} holds no model tensors (no '{start}*' key): it is not a checkpoint of a model.")
    return tensors


def hf_names(
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
    prefix: str | None = None,
    model: dict[str, tuple[int, ...]] | None = None,
    tied: Collection[str] = (),
) -> dict[str, str]:
    """Checkpoint key (``tensors``: key -> shape, dtype) -> Hugging Face name, for the keys under ``prefix``
    (stripped), in the order of ``model`` (the Hugging Face model's state dict: name -> shape) when given, else the
    checkpoint's.

    With ``model``: the prefix is, unless given, the one under which most names fit; a name of ``tied`` (a tied
    tensor's second name) may be absent; any other name missing, left over or misshaped is an error. Without: the
    prefix is, unless given, the leading components every key shares."""
    from lightning_sgdtp.checkpoint.huggingface import match

    if prefix is None and model is not None:
        shapes = {k: torch.empty(shape, device="meta") for k, (shape, _) in tensors.items()}
        prefix = match(shapes, model).prefix
    elif prefix is None:
        prefix = _common_prefix(list(tensors))
    elif prefix and not prefix.endswith("."):
        prefix += "."
    names = {key: key[len(prefix) :] for key in tensors if key.startswith(prefix)}
    if not names:
        tops = sorted({k.split(".")[0] + "." for k in tensors})
        raise ValueError(f"no model tensor under the prefix {prefix!r}: the checkpoint's keys begin with {tops}.")
    if model is None:
        return names
    problems = _does_not_fit({n: tensors[k][0] for k, n in names.items()}, model, set(tied))
    if problems:
        raise ValueError(
            f"the checkpoint's model (names under {prefix!r}) does not fit the Hugging Face model of the config: "
            + "; ".join(problems)
            + ". Give the config the model was trained with, or --prefix (prefix=) the path to the Hugging Face model"
            " inside the LightningModule (self.model: 'model.')."
        )
    keys = {n: k for k, n in names.items()}
    return {keys[n]: n for n in model if n in keys}


def _common_prefix(keys: list[str]) -> str:
    """The leading dotted components every key shares (never a key's last component)."""
    parts = [k.split(".")[:-1] for k in keys]
    common = []
    for components in zip(*parts):
        if len(set(components)) > 1:
            break
        common.append(components[0])
    return "".join(f"{c}." for c in common)


def _does_not_fit(
    found: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]], tied: set[str], limit: int = 8
) -> list[str]:
    """What keeps ``found`` (name -> shape) from being the state dict ``shapes`` describes, one phrase a kind."""

    def listed(items: list[str]) -> str:
        return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")

    absent = [n for n in shapes if n not in found and n not in tied]
    extra = [n for n in found if n not in shapes]
    misshaped = [f"{n} {list(s)} (the model: {list(shapes[n])})" for n, s in found.items() if shapes.get(n, s) != s]
    phrases = ("missing from the checkpoint", "in the checkpoint, not in the model", "different shapes")
    return [f"{what}: {listed(items)}" for what, items in zip(phrases, (absent, extra, misshaped)) if items]


def _hf_model_names(config: Path) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """The state dict (name -> shape) of the Hugging Face model ``config/config.json`` describes, built on the meta
    device (no memory), and the second names of its tied tensors."""
    if not (config / "config.json").is_file():
        raise FileNotFoundError(f"{config}/config.json: no such file. Give the Hugging Face model's folder.")
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"reading {config}/config.json needs transformers: pip install transformers ({e})") from e
    hf_config = transformers.AutoConfig.from_pretrained(str(config))
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(hf_config)
        except ValueError:  # not a causal language model
            model = transformers.AutoModel.from_config(hf_config)
    state = model.state_dict(keep_vars=True)  # parameters themselves: a tied one is one object under two names
    first: dict[int, str] = {}
    tied = {k for k, t in state.items() if first.setdefault(id(t), k) != k}
    return {k: tuple(t.shape) for k, t in state.items()}, tied


def _copy(src: Path, f: Any) -> None:
    f.write(src.read_bytes())


def _write_safetensors(f: Any, entries: dict[str, tuple[str, tuple[int, ...], torch.dtype]], reader: Any) -> None:
    """One ``*.safetensors`` file: the header (from shapes and dtypes), then each tensor (``entries``: name ->
    checkpoint key, shape, dtype) read alone from the checkpoint and its bytes appended."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from lightning_sgdtp.checkpoint.huggingface import _DTYPES

    names = {dtype: name for name, dtype in _DTYPES.items()}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (_, shape, dtype) in entries.items():
        if dtype not in names:
            raise ValueError(f"{name}: dtype {dtype} has no safetensors name (supported: {sorted(map(str, names))})")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # tensors aligned to 8 bytes, as safetensors writes them
    f.write(struct.pack("<Q", len(text)) + text)
    for key, shape, dtype in entries.values():
        target = {f"{MODEL_KEY}.{key}": torch.empty(shape, dtype=dtype)}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(target, storage_reader=reader, no_dist=True)
        f.write(target[f"{MODEL_KEY}.{key}"].reshape(-1).view(torch.uint8).numpy().data)
