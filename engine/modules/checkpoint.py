"""A module's weights from a checkpoint in the ecosystem's format, mapped, never copied whole.

A checkpoint is a single `.safetensors` file, or a diffusers / transformers
directory: shards named by its `*.safetensors.index.json` (its `weight_map`),
or one `.safetensors` file. Each shard is a `WeightFile`: mapped read-only,
checked (names, dtypes, shapes, sizes) against the module's parameters before
any device memory is touched; registered for DMA by the caller (see
engine/executor/sources.py), the page cache is the host copy.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from engine.errors import WeightFileError
from engine.models.spec import DTYPE_BYTES, WeightSpec
from engine.weightfile import DTYPES, WeightFile

_BY_TORCH = {t: name for name, (_, t) in DTYPES.items()}


_PEFT_PREFIX = "base_model.model."
_PEFT_WRAPPED = ".base_layer"


def state_dict_name(name: str) -> str:
    """A parameter's name as the base model's checkpoint holds it: peft's wrapping undone
    (`base_model.model.` before it, `.base_layer` inside it)."""
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX):]
    return name.replace(_PEFT_WRAPPED + ".", ".")


@dataclass(frozen=True)
class ModuleWeights:
    """A WeightTable of a module's parameters (and persistent buffers), by state-dict name."""

    name: str
    weights: Mapping[str, WeightSpec]

    @property
    def model_bytes(self) -> int:
        return sum(w.nbytes for w in self.weights.values())


def module_weights(module: nn.Module, name: str | None = None, buffers: bool = True,
                   frozen_only: bool = False) -> ModuleWeights:
    """The weights a checkpoint of `module` holds, by `state_dict_name`: every parameter
    (`frozen_only`: those that need no grad, the base a training run's adapters sit on),
    and (by default) every persistent floating-point buffer, with its shape and dtype."""
    table: dict[str, WeightSpec] = {}
    tensors = [(n, p) for n, p in module.named_parameters() if not (frozen_only and p.requires_grad)]
    if buffers:
        persistent = set(module.state_dict(keep_vars=True))
        tensors += [(n, b) for n, b in module.named_buffers() if n in persistent and b.is_floating_point()]
    for n, t in tensors:
        dtype = _BY_TORCH.get(t.dtype)
        if dtype is None:
            raise WeightFileError(f"{n} is {t.dtype}; checkpoints of {', '.join(DTYPE_BYTES)} weights only: "
                                  "convert the module (module.to(torch.bfloat16)) first")
        n = state_dict_name(n)
        table[n] = WeightSpec(n, tuple(t.shape), dtype)
    return ModuleWeights(name or type(module).__name__, table)


def _shards(path: Path) -> dict[Path, list[str] | None]:
    """Shard file -> the weights its index maps to it (None: a single file, every weight)."""
    if not path.exists():
        raise WeightFileError(f"checkpoint {path} does not exist; point weights.file at a .safetensors file "
                              "or a diffusers/transformers model directory (or write one with mode=materialize)")
    if path.is_file():
        return {path: None}
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise WeightFileError(f"{path} holds {len(indexes)} safetensors indexes ({indexes[0].name}, ...); "
                              "point weights.file at the one file to load")
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise WeightFileError(f"{indexes[0]}: not a safetensors index with a weight_map ({err}); "
                                  "restore the file from the checkpoint") from None
        if not isinstance(weight_map, dict):
            raise WeightFileError(f"{indexes[0]}: its weight_map is not an object; restore the file")
        shards: dict[Path, list[str]] = {}
        for weight, shard in weight_map.items():
            shards.setdefault(path / str(shard), []).append(weight)
        for shard in shards:
            if not shard.is_file():
                raise WeightFileError(f"shard {shard.name} named by {indexes[0].name} is missing from {path}; "
                                      "download the checkpoint again")
        return dict(shards)
    files = sorted(path.glob("*.safetensors"))
    if len(files) != 1:
        raise WeightFileError(f"{path} holds {len(files)} .safetensors files and no index; point weights.file at "
                              "one file, or at a directory with one file or a *.safetensors.index.json")
    return {files[0]: None}


class Checkpoint:
    """Every shard of a checkpoint mapped and checked against `table` (its weights)."""

    def __init__(self, path: str | Path, table: ModuleWeights):
        self.path = Path(path).expanduser()
        self.table = table
        shards = _shards(self.path)
        covered = {w for names in shards.values() if names is not None for w in names}
        whole = [s for s, names in shards.items() if names is None]
        missing = [w for w in table.weights if w not in covered] if not whole else []
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise WeightFileError(f"weight {missing[0]}{more} of {table.name} is in no shard of {self.path}; "
                                  "this checkpoint is for another model: point weights.file at this model's")
        self.files: list[WeightFile] = []
        self._where: dict[str, WeightFile] = {}
        self._file_views: dict[int, torch.Tensor] = {}
        try:
            for shard, names in shards.items():
                wanted = table.weights if names is None else {w: table.weights[w] for w in names
                                                              if w in table.weights}
                wf = WeightFile(shard, ModuleWeights(table.name, wanted))
                self.files.append(wf)
                self._where.update({w: wf for w in wanted})
        except BaseException:
            self.close()
            raise

    @property
    def file_bytes(self) -> int:
        return sum(wf.file_bytes for wf in self.files)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every weight of the table, as read-only views of the mappings."""
        return {w: self._where[w].tensor(w) for w in self.table.weights}

    def locate(self, weight: str) -> tuple[WeightFile, int, torch.Tensor]:
        """(its file, its byte offset in that file's mapping, the whole mapping as uint8)."""
        wf = self._where[weight]
        view = self._file_views.get(id(wf))
        if view is None:
            view = self._file_views[id(wf)] = wf.file_view()
        return wf, wf.offset(weight), view

    def close(self) -> None:
        self._file_views.clear()
        for wf in self.files:
            wf.close()
        self.files.clear()
        self._where.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_resident(module: nn.Module, path: str | Path, device: torch.device, frozen_only: bool = False) -> nn.Module:
    """`module` (built from its config, parameters on the meta device) as a loader such as
    from_pretrained leaves it: every parameter and persistent buffer read from the
    checkpoint at `path` into its own memory on `device` (tied parameters stay one), every
    other buffer moved there, no hooks. `frozen_only`: the base of a training run (peft's
    names undone, `state_dict_name`), its adapters, which need grad and no checkpoint holds,
    left as they are. The plain module offload's outputs and training steps are compared with."""
    loaded: dict[int, nn.Parameter] = {}
    with Checkpoint(path, module_weights(module, frozen_only=frozen_only)) as ckpt:
        tensors = ckpt.tensors()
        for prefix, m in module.named_modules():
            for name, p in m._parameters.items():
                key = state_dict_name(f"{prefix}.{name}" if prefix else name)
                if p is not None and (id(p) in loaded or key in tensors):
                    if id(p) not in loaded:
                        loaded[id(p)] = nn.Parameter(tensors[key].to(device, copy=True), requires_grad=p.requires_grad)
                    m._parameters[name] = loaded[id(p)]
            for name, b in m._buffers.items():
                key = state_dict_name(f"{prefix}.{name}" if prefix else name)
                if b is not None:
                    m._buffers[name] = tensors[key].to(device, copy=True) if key in tensors else b.to(device)
        del tensors  # views of the mappings: the checkpoint closes only once none is left
    return module
