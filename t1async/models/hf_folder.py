"""Hugging Face model folders in and out: config, sharded safetensors weights, tokenizer files.

A model folder is what ``transformers``' ``save_pretrained`` writes and what the Hub serves:

- ``config.json`` (``model_type``, the architecture's sizes);
- weights as one ``model.safetensors``, or shards ``model-00001-of-0000N.safetensors`` listed in
  ``model.safetensors.index.json`` (``{"metadata": {"total_size": BYTES}, "weight_map": {name: shard}}``,
  transformers' ``SAFE_WEIGHTS_INDEX_NAME`` layout), as every real MoE checkpoint ships;
- tokenizer files (``tokenizer.json``, ``tokenizer_config.json`` with the chat template in it or in a
  ``chat_template.jinja`` beside it) and ``generation_config.json`` (the end-of-turn ids).

Loading streams: tensors are read one at a time from the memory-mapped shards (``safetensors.safe_open``)
and copied into the model's already allocated parameters, so the peak is about one copy of the weights
plus the largest tensor, not two copies. Every check that can be made from the shards' headers (missing,
extra and mis-shaped weights, truncated shards) runs before any tensor is read, and each refusal is a
:class:`ModelFolderError`: one line naming the folder, what is wrong and what to do.

Saving writes the same layout (shards of at most ``max_shard_bytes``, the index, the config) and copies
the source folder's tokenizer files; :func:`source_layout` gives the weights back under the source's own
names, prefixes, expert layout and dtypes, with the tensors the model does not build (an MTP layer, a vision
tower) carried through unchanged, so the class the source's config.json names, ``sglang.launch_server
--model-path`` and vLLM read a checkpoint as they read the model it came from.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from t1async.config import ConfigError

__all__ = ["ModelFolderError", "CONFIG", "WEIGHTS", "WEIGHTS_INDEX", "TOKENIZER_FILES", "read_config",
           "weight_specs", "check_weights", "check_model_weights", "load_weights", "save_folder", "available_memory_bytes",
           "check_memory", "copy_tokenizer_files", "left_out", "source_layout"]

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
                   "merges.txt")
"""Files copied from the source folder into a checkpoint (those present)."""

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class ModelFolderError(ConfigError):
    """A model folder cannot be used: the one-line message names the folder, the fault and the fix."""


def read_config(folder: str | Path) -> dict:
    """``folder/config.json`` as a dict.

    Raises:
        ModelFolderError: the folder or its config.json is missing, or the config is not a JSON object.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFolderError(f"model folder {folder} does not exist; give a Hugging Face model folder "
                               "(config.json, *.safetensors, tokenizer files)")
    path = folder / CONFIG
    if not path.is_file():
        raise ModelFolderError(f"model folder {folder} has no {CONFIG}; a Hugging Face model folder holds config.json, "
                               "the safetensors weights and the tokenizer files (t1async model init writes one)")
    try:
        d = json.loads(path.read_text("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFolderError(f"{path} is not JSON ({e}); restore it from the model's source") from None
    if not isinstance(d, dict):
        raise ModelFolderError(f"{path} holds a JSON {type(d).__name__}, not an object; restore it from the model's source")
    return d


def _shards(folder: Path) -> dict[str, list[str] | None]:
    """Shard file -> the names the index assigns to it (None: a single unindexed file: all its names)."""
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        try:
            wmap = json.loads(index.read_text("utf-8"))["weight_map"]
            if not isinstance(wmap, dict):
                raise TypeError("weight_map is not an object")
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise ModelFolderError(f"{index} is not a safetensors index ({e!s}); it needs a 'weight_map' of "
                                   "tensor name -> shard file") from None
        shards: dict[str, list[str] | None] = {}
        for name, shard in wmap.items():
            shards.setdefault(str(shard), []).append(name)  # type: ignore[union-attr]
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            raise ModelFolderError(f"model folder {folder}: {len(missing)} shard(s) listed in {WEIGHTS_INDEX} are "
                                   f"missing: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; "
                                   "copy every shard of the checkpoint")
        return shards
    if (folder / WEIGHTS).is_file():
        return {WEIGHTS: None}
    loose = sorted(p.name for p in folder.glob("*.safetensors"))
    hint = (f" (it has {', '.join(loose[:3])} but no {WEIGHTS_INDEX} saying which tensor is where)" if loose else "")
    raise ModelFolderError(f"model folder {folder} has no weights{hint}; it needs {WEIGHTS} or shards listed in "
                           f"{WEIGHTS_INDEX}")


def weight_specs(folder: str | Path) -> dict[str, tuple[tuple[int, ...], torch.dtype, str]]:
    """Every tensor's (shape, dtype, shard file name) from the shards' headers, no tensor read.

    Raises:
        ModelFolderError: no weights, a shard missing, unreadable or truncated (its header promises more
            bytes than the file holds), a tensor the index puts in one shard found in another, or a name
            in two shards.
    """
    folder = Path(folder)
    specs: dict[str, tuple[tuple[int, ...], torch.dtype, str]] = {}
    for shard, listed in _shards(folder).items():
        path = folder / shard
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
                header_end, data = _data_bytes(path)
                for name in names:
                    sl = f.get_slice(name)
                    shape = tuple(int(s) for s in sl.get_shape())
                    dtype = _DTYPES.get(sl.get_dtype())
                    if dtype is None:
                        raise ModelFolderError(f"{path}: tensor {name} has dtype {sl.get_dtype()}, which t1async "
                                               f"does not load (one of {sorted(_DTYPES)})")
                    if name in specs:
                        raise ModelFolderError(f"model folder {folder}: tensor {name} is in both {specs[name][2]} and "
                                               f"{shard}; the checkpoint is inconsistent")
                    specs[name] = (shape, dtype, shard)
        except SafetensorError as e:
            raise ModelFolderError(f"{path} is not a readable safetensors file ({e}); it is truncated or corrupt: "
                                   "copy it again from the model's source") from None
        if data is not None and os.path.getsize(path) < header_end + data:
            raise ModelFolderError(f"{path} is truncated: {os.path.getsize(path)} bytes, its header needs "
                                   f"{header_end + data}; copy it again from the model's source")
        if listed is not None:
            strays = sorted(set(listed) - set(names))
            if strays:
                raise ModelFolderError(f"{WEIGHTS_INDEX} of {folder} puts {strays[0]} (and {len(strays) - 1} more) in "
                                       f"{shard}, which does not hold it; the index and the shards disagree")
    return specs


def _data_bytes(path: Path) -> tuple[int, int | None]:
    """(bytes before the data, bytes of data the header's offsets need) of a safetensors file."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return 8 + n, None
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    return 8 + n, max(ends, default=0)


def check_weights(folder: str | Path, expected: dict[str, tuple[int, ...]],
                  specs: dict[str, tuple[tuple[int, ...], torch.dtype, str]]) -> None:
    """Refuse weights that do not match the architecture ``config.json`` describes.

    Args:
        folder: the model folder (for the message).
        expected: name -> shape the model needs (after any layout conversion).
        specs: name -> (shape, dtype, shard) the folder holds, converted to the same names and shapes.

    Raises:
        ModelFolderError: missing, extra or mis-shaped weights, each kind listing the first names.
    """
    missing = [k for k in expected if k not in specs]
    extra = [k for k in specs if k not in expected]
    shaped = [f"{k} {list(specs[k][0])} (config.json says {list(expected[k])})" for k in expected
              if k in specs and tuple(specs[k][0]) != tuple(expected[k])]
    parts = []
    for what, names in (("missing", missing), ("unexpected", extra), ("mis-shaped", shaped)):
        if names:
            parts.append(f"{len(names)} {what}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}")
    if parts:
        raise ModelFolderError(f"model folder {folder}: weights do not match its config.json ({'; '.join(parts)}); "
                               "the weights and the config must come from the same checkpoint")


Convert = Callable[[str, torch.Tensor], Iterable[tuple]]
"""A layout conversion: one checkpoint tensor -> the model's ``(name, tensor)`` pairs (e.g. fused experts split),
or ``(name, tensor, index)`` triples that fill ``parameter[index]`` (e.g. one expert of a fused parameter; the
parameter counts as present once its parts cover it)."""


def _identity(name: str, t: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
    return ((name, t),)


_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def fuse_expert(name: str, t: torch.Tensor) -> Iterable[tuple]:
    """A :data:`Convert` from transformers' checkpoint layout (one tensor per expert,
    ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``, what its ``save_pretrained`` and the
    Hub hold) into the fused parameters of its v5 modules: ``gate_up_proj[e]`` rows [0, I) gate, [I, 2I)
    up (``gate_proj`` is [I, H]); ``down_proj[e]`` ([H, I]). Any other tensor, fused ones included,
    passes as it is."""
    m = _EXPERT.fullmatch(name)
    if m is None:
        return ((name, t),)
    prefix, e, which = m.group(1), int(m.group(2)), m.group(3)
    if which == "down_proj":
        return ((f"{prefix}.down_proj", t, e),)
    rows = slice(0, t.shape[0]) if which == "gate_proj" else slice(t.shape[0], 2 * t.shape[0])
    return ((f"{prefix}.gate_up_proj", t, (e, rows)),)


def iter_tensors(folder: str | Path, specs: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the folder, one at a time, shard by shard (each tensor a
    fresh CPU copy out of the memory-mapped shard, freed when the caller drops it).

    Raises:
        ModelFolderError: as :func:`weight_specs`.
    """
    folder = Path(folder)
    specs = specs if specs is not None else weight_specs(folder)
    by_shard: dict[str, list[str]] = {}
    for name, (_, _, shard) in specs.items():
        by_shard.setdefault(shard, []).append(name)
    for shard, names in by_shard.items():
        with safe_open(str(folder / shard), framework="pt") as f:
            for name in names:
                yield name, f.get_tensor(name)


def check_model_weights(model: torch.nn.Module, folder: str | Path, convert: Convert = _identity,
                        skip: Callable[[str], bool] = lambda name: False) -> dict:
    """Check the folder's weights against ``model``'s state_dict from the shards' headers alone (``model``
    may live on the meta device): each checkpoint tensor goes through ``convert`` as a meta tensor, tied
    parameters are expected once, names ``skip`` accepts may be absent.

    Returns:
        the folder's :func:`weight_specs`.

    Raises:
        ModelFolderError: as :func:`weight_specs` and :func:`check_weights`.
    """
    specs = weight_specs(folder)
    expected, seen = {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if skip(name) or id(t) in seen:
            continue
        seen.add(id(t))
        expected[name] = tuple(t.shape)
    targets = dict(model.state_dict(keep_vars=True))
    converted: dict[str, tuple[tuple[int, ...], torch.dtype, str]] = {}
    covered: dict[str, int] = {}
    for name, (shape, dtype, shard) in specs.items():
        for part in convert(name, torch.empty(shape, dtype=dtype, device="meta")):
            new, meta = part[0], part[1]
            if len(part) == 2:
                converted[new] = (tuple(meta.shape), dtype, shard)
                continue
            # a slice of a parameter (per-expert tensors into fused experts): counted until the whole is covered
            if new not in targets or tuple(targets[new][part[2]].shape) != tuple(meta.shape):
                converted[f"{name} (into {new})"] = (tuple(meta.shape), dtype, shard)
                continue
            covered[new] = covered.get(new, 0) + meta.numel()
            if covered[new] == targets[new].numel():
                converted[new] = (tuple(targets[new].shape), dtype, shard)
    check_weights(folder, expected, converted)
    return specs


def load_weights(model: torch.nn.Module, folder: str | Path, convert: Convert = _identity,
                 skip: Callable[[str], bool] = lambda name: False) -> int:
    """Copy the folder's weights into ``model``'s parameters and buffers in place, streamed.

    Names and shapes are checked first from the headers (after ``convert`` on meta tensors), then each
    tensor is read, converted, cast to the parameter's dtype and copied, one at a time: peak memory is the
    model plus the largest tensor. Tied parameters (one tensor under two names) are expected once.

    Args:
        model: the module to fill; its ``state_dict`` names are the expected names.
        folder: the model folder.
        convert: checkpoint tensor -> model (name, tensor) pairs (default: as is).
        skip: names of the model's state_dict that the checkpoint need not hold (e.g. a tied LM head).

    Returns:
        bytes read from the shards.

    Raises:
        ModelFolderError: as :func:`weight_specs` and :func:`check_weights`.
    """
    folder = Path(folder)
    specs = check_model_weights(model, folder, convert, skip)
    targets = dict(model.state_dict(keep_vars=True))
    read = 0
    with torch.no_grad():
        for name, tensor in iter_tensors(folder, specs):
            read += tensor.numel() * tensor.element_size()
            for part in convert(name, tensor):
                target = targets[part[0]]
                (target[part[2]] if len(part) == 3 else target).copy_(part[1])
            del tensor
    return read


def left_out(specs: dict, convert: Convert) -> dict[str, int]:
    """The checkpoint tensors ``convert`` maps to nothing (parts of the checkpoint the model does not build: an
    MTP layer, a vision tower), grouped by name up to their layer index (``model.layers.46.*``), else by their first
    name (``mtp.*``, ``model.visual.*``): group -> tensor count, in the checkpoint's order. From the names alone
    (meta tensors)."""
    groups: dict[str, int] = {}
    for name, (shape, dtype, _) in specs.items():
        if not list(convert(name, torch.empty(shape, dtype=dtype, device="meta"))):
            parts = name.split(".")
            layer = next((i for i in range(1, len(parts)) if parts[i - 1] == "layers" and parts[i].isdigit()), None)
            cut = layer + 1 if layer is not None else 2 if parts[0] == "model" else 1
            key = ".".join(parts[:cut]) + ".*"
            groups[key] = groups.get(key, 0) + 1
    return groups


def source_layout(source: str | Path, state: dict[str, torch.Tensor], convert: Convert,
                  specs: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under the names, shapes, expert layout and dtypes of the folder they were loaded from,
    one tensor at a time, in the source's order: what a checkpoint writes so that whatever read the source (the
    class its config.json names, SGLang, vLLM) reads the checkpoint alike.

    ``convert`` (the family's :data:`Convert`, checkpoint tensor -> model parameters) is inverted element by
    element: each source tensor is converted as a tensor of its own element indices, so every part it yields says
    which source elements fill which parameter (slice); the source tensor is gathered back from the parameters.
    A part that is the whole tensor renamed (the usual case) is taken as it is, no index built. Source tensors
    ``convert`` maps to nothing (:func:`left_out`: an MTP layer, a vision tower) are copied from the source
    unchanged. Each tensor is cast to its source dtype (a bfloat16 folder's checkpoint is bfloat16).

    Args:
        source: the model folder the weights came from (read for its headers and the tensors carried through).
        state: the model's ``state_dict`` (its own names; tied parameters under each name).
        convert: the family's conversion, which must only move elements (rename, slice, split, fuse).
        specs: the source's :func:`weight_specs` (read when None).

    Raises:
        ValueError: a part names a parameter ``state`` lacks, or ``convert`` does more than move elements (a
            source element placed twice or not at all).
        ModelFolderError: as :func:`weight_specs`.
    """
    source = Path(source)
    specs = specs if specs is not None else weight_specs(source)
    by_shard: dict[str, list[str]] = {}
    for name, (_, _, shard) in specs.items():
        by_shard.setdefault(shard, []).append(name)

    def param(part: tuple, name: str) -> torch.Tensor:
        if part[0] not in state:
            raise ValueError(f"checkpoint tensor {name} maps onto {part[0]}, which the model does not have")
        t = state[part[0]].detach()
        return t[part[2]] if len(part) == 3 else t

    for shard, names in by_shard.items():
        with safe_open(str(source / shard), framework="pt") as f:
            for name in names:
                shape, dtype, _ = specs[name]
                meta = torch.empty(shape, dtype=dtype, device="meta")
                parts = list(convert(name, meta))
                if not parts:
                    yield name, f.get_tensor(name)  # not built here: carried through unchanged
                    continue
                if len(parts) == 1 and parts[0][1] is meta:  # the whole tensor, renamed (or a whole slice)
                    t = param(parts[0], name)
                    if tuple(t.shape) != tuple(shape):
                        raise ValueError(f"{parts[0][0]} has shape {list(t.shape)}, checkpoint tensor {name} "
                                         f"{list(shape)}")
                    yield name, t.to(dtype)
                    continue
                n = meta.numel()
                index = torch.arange(n, dtype=torch.int64).view(shape)
                out = torch.empty(n, dtype=dtype)
                placed = torch.zeros(n, dtype=torch.int32)
                for part in convert(name, index):
                    where = part[1].reshape(-1)
                    out[where] = param(part, name).reshape(-1).to(dtype)
                    placed.index_add_(0, where, torch.ones_like(where, dtype=torch.int32))
                if not bool((placed == 1).all()):
                    raise ValueError(f"the conversion of checkpoint tensor {name} does more than move its elements; "
                                     "its checkpoint layout cannot be written back")
                yield name, out.view(shape)


def save_folder(out: str | Path, tensors: Iterable[tuple[str, torch.Tensor]], config: dict, *,
                max_shard_bytes: int = 5 * 2**30, source: str | Path | None = None) -> list[str]:
    """Write a model folder: shards of at most ``max_shard_bytes`` (a single ``model.safetensors`` when one
    suffices, else ``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``), ``config.json``
    and, from ``source``, the tokenizer files (:data:`TOKENIZER_FILES`).

    Tensors are written in the order given, each shard as soon as it is full, so only one shard's tensors
    are held at once (they are the caller's tensors, not copies, unless they share storage: safetensors
    refuses shared storage, so such views are cloned). A tensor larger than ``max_shard_bytes`` gets a
    shard of its own. Stale weight files of an earlier save in ``out`` are removed.

    Args:
        out: folder to write (created).
        tensors: (HF name, tensor) pairs, names unique.
        config: the config.json dict to write (the caller sets its dtype keys).
        max_shard_bytes: most bytes of one shard, >= 1.
        source: the model folder whose tokenizer files to copy, or None.

    Returns:
        the weight file names written.

    Raises:
        ValueError: ``max_shard_bytes`` < 1 or a name given twice.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model-*-of-*.safetensors"), out / WEIGHTS, out / WEIGHTS_INDEX]:
        stale.unlink(missing_ok=True)
    groups: list[list[str]] = [[]]
    sizes = [0]
    tmp: list[Path] = []
    weight_map: dict[str, int] = {}
    total = 0

    def flush(shard: dict[str, torch.Tensor]) -> None:
        path = out / f".shard-{len(tmp):05d}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        tmp.append(path)

    shard: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        if name in weight_map or name in shard:
            raise ValueError(f"tensor {name} given twice")
        t = t.detach().contiguous()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # a view into a larger storage (a packed policy): safetensors needs its own
        n = t.numel() * t.element_size()
        if shard and sizes[-1] + n > max_shard_bytes:
            flush(shard)
            shard, groups, sizes = {}, groups + [[]], sizes + [0]
        shard[name] = t
        groups[-1].append(name)
        sizes[-1] += n
        weight_map[name] = len(groups) - 1
        total += n
    flush(shard)
    if len(tmp) == 1:
        names = [WEIGHTS]
        tmp[0].replace(out / WEIGHTS)
    else:
        names = [f"model-{i + 1:05d}-of-{len(tmp):05d}.safetensors" for i in range(len(tmp))]
        for p, n in zip(tmp, names):
            p.replace(out / n)
        index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in weight_map.items()}}
        (out / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    if source is not None:
        copy_tokenizer_files(source, out)
    return names


def copy_tokenizer_files(source: str | Path, out: str | Path) -> list[str]:
    """Copy the tokenizer files of :data:`TOKENIZER_FILES` that ``source`` holds into ``out``; returns their names."""
    source, out = Path(source), Path(out)
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file() and (source / name).resolve() != (out / name).resolve():
            shutil.copyfile(source / name, out / name)
            copied.append(name)
    return copied


def available_memory_bytes() -> int:
    """Memory the kernel says a new allocation can get without swapping (``MemAvailable`` of
    /proc/meminfo, Linux >= 3.14), in bytes; a large number where it cannot be read (not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 2**62


def check_memory(folder: str | Path, parameters: int, *, copies: float = 1.0, train_copies: float = 8.0,
                 available: int | None = None) -> None:
    """Refuse, before allocating anything, a model that will not fit in memory.

    The estimate is ``parameters x 4 bytes`` (float32, the learner's and the embedded engine's dtype on CPU)
    x ``copies`` to load; the message also gives the training footprint (``train_copies``: the policy, its
    gradient and two AdamW moments, and as much for the critic), so a user can size the machine.

    Args:
        folder: the model folder (for the message).
        parameters: the model's parameter count (from its config, before building it).
        copies: float32 copies this process holds at once.
        train_copies: float32 copies a learner with a critic holds.
        available: bytes available (default :func:`available_memory_bytes`).

    Raises:
        ModelFolderError: the load estimate exceeds the available memory.
    """
    need = int(parameters * 4 * copies)
    have = available_memory_bytes() if available is None else int(available)
    if need > have:
        gib = 2**30
        raise ModelFolderError(
            f"model folder {folder}: its {parameters / 1e6:,.1f} M parameters need {need / gib:.1f} GiB in float32 to "
            f"load ({parameters * 4 * train_copies / gib:.1f} GiB to train with a critic and AdamW) and this machine "
            f"has {have / gib:.1f} GiB available; use a smaller model (t1async model init) or a machine with more memory")
