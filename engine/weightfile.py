"""Weight files (`.ptd`): safetensors on disk, memory-mapped for streaming.

`materialize` writes random weights for a spec tensor by tensor, header first,
so a 38 GB model never sits in host memory at once. `WeightFile` maps a file
read-only, checks it against the spec before anything runs, and hands out host
tensors that view the mapping: the page cache is the host copy, there is no
second one. A real checkpoint in safetensors format opens the same way.

Format (https://huggingface.co/docs/safetensors): 8 bytes little-endian header
length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}},
then the data; offsets count from the end of the header.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import signal
import struct
import threading
import warnings
from collections import deque
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Mapping, Protocol

import torch
from tqdm import tqdm

from engine.errors import WeightFileError
from engine.models.spec import DTYPE_BYTES, ModelSpec, WeightSpec

# spec dtype -> (safetensors dtype, torch dtype)
DTYPES: dict[str, tuple[str, torch.dtype]] = {
    "fp32": ("F32", torch.float32),
    "bf16": ("BF16", torch.bfloat16),
    "fp16": ("F16", torch.float16),
    "fp8_e4m3": ("F8_E4M3", torch.float8_e4m3fn),
    "fp8_e5m2": ("F8_E5M2", torch.float8_e5m2),
}
_HEADER_ALIGN = 8  # safetensors pads the header so the data starts 8-byte aligned
_CHUNK_ELEMENTS = 1 << 22  # CPU generation: 4M elements per chunk (16 MB of fp32 scratch)


class WeightTable(Protocol):
    """What a weight file is checked against: a model name and its weights by
    checkpoint name (a ModelSpec is one; engine/modules builds one from a module)."""

    @property
    def name(self) -> str: ...

    @property
    def weights(self) -> Mapping[str, WeightSpec]: ...


def torch_dtype(dtype: str) -> torch.dtype:
    return DTYPES[dtype][1]


def file_order(spec: ModelSpec) -> list[str]:
    """Weights in first-use order, the rest after: streaming then reads the file
    mostly front to back."""
    first_use = dict.fromkeys(w for k in spec.kernels for w in k.weights)
    return list(first_use) + [w for w in spec.weights if w not in first_use]


def _header_bytes(spec: WeightTable, names: list[str], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name in names:
        w = spec.weights[name]
        header[name] = {"dtype": DTYPES[w.dtype][0], "shape": list(w.shape),
                        "data_offsets": [offset, offset + w.nbytes]}
        offset += w.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % _HEADER_ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def init_std(w: WeightSpec) -> tuple[float, float]:
    """(mean, std) of a random weight, at the scales of engine.models.seeded.random_weights,
    so a deep random model stays finite: small biases, norm gains near 1,
    scale_shift tables ~ 1/sqrt(width), other weights ~ 1/sqrt(fan_in)."""
    if w.name.endswith(".bias"):
        return 0.0, 0.02
    if len(w.shape) == 1:
        return 1.0, 0.1
    if "scale_shift_table" in w.name:
        return 0.0, 1.0 / math.sqrt(w.shape[-1])
    return 0.0, 1.0 / math.sqrt(math.prod(w.shape[1:]))


def _generate_cuda(w: WeightSpec, seed: int, index: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)
    mean, std = init_std(w)
    t = torch.randn(w.numel, generator=g, device=device, dtype=torch.float32).mul_(std).add_(mean)
    return t.to(torch_dtype(w.dtype)).cpu()


def _generate_chunk(w: WeightSpec, seed: int, index: int, chunk: int, count: int) -> bytes:
    g = torch.Generator().manual_seed((seed * 1_000_003 + index) * 1_000_033 + chunk)
    mean, std = init_std(w)
    t = torch.randn(count, generator=g, dtype=torch.float32).mul_(std).add_(mean)
    return t.to(torch_dtype(w.dtype)).view(torch.uint8).numpy().tobytes()


def _cpu_chunks(spec: WeightTable, names: list[str], seed: int, pool: ThreadPoolExecutor,
                window: int) -> Iterator[bytes]:
    """Every tensor's bytes in file order, generated in parallel chunks; at most
    `window` chunks are in flight, so memory stays bounded."""
    def jobs() -> Iterator[tuple[WeightSpec, int, int, int]]:
        for index, name in enumerate(names):
            w = spec.weights[name]
            for chunk, start in enumerate(range(0, w.numel, _CHUNK_ELEMENTS)):
                yield w, index, chunk, min(_CHUNK_ELEMENTS, w.numel - start)

    pending: deque[Future] = deque()
    for w, index, chunk, count in jobs():
        pending.append(pool.submit(_generate_chunk, w, seed, index, chunk, count))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def materialize(spec: WeightTable, path: str | Path, seed: int = 0,
                device: str | torch.device | None = None, order: list[str] | None = None) -> Path:
    """Write random weights for `spec` to a safetensors file at `path`.

    Streams tensor by tensor (header first, then the data in `order`, by default
    a spec's first-use order, see file_order) with a
    progress bar. `device` "cuda" generates on the GPU; None picks the GPU when
    there is one, else the CPU in parallel chunks. Values depend on the seed
    and on the generating device. The file appears at `path` only when complete.
    """
    path = Path(path)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    names = file_order(spec) if order is None else list(order)
    total = sum(spec.weights[n].nbytes for n in names)
    metadata = {"format": "pt", "generator": f"offload-engine materialize ({device.type})",
                "model": spec.name, "seed": str(seed)}
    partial = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        f = open(partial, "xb")  # exclusive: a second writer of the same file is refused
    except FileExistsError:
        raise WeightFileError(f"{partial} exists: another materialize is writing {path} (or one was killed); "
                              "wait for it, or delete the .partial file") from None
    try:
        with f, _terminate_raises(), tqdm(total=total, unit="B", unit_scale=True,
                                          desc=f"materialize {spec.name}") as bar:
            f.write(_header_bytes(spec, names, metadata))
            if device.type == "cuda":
                for index, name in enumerate(names):
                    data = _generate_cuda(spec.weights[name], seed, index, device)
                    f.write(data.view(torch.uint8).numpy().data)
                    bar.update(data.numel() * data.element_size())
            else:
                workers = os.cpu_count() or 1
                with ThreadPoolExecutor(workers) as pool:
                    for data in _cpu_chunks(spec, names, seed, pool, window=2 * workers):
                        f.write(data)
                        bar.update(len(data))
        try:
            os.link(partial, path)  # published whole, and never over an existing file
        except FileExistsError:
            raise WeightFileError(f"{path} appeared while materializing (another writer); "
                                  "this run's weights were not published") from None
    finally:
        partial.unlink(missing_ok=True)
    return path


@contextmanager
def _terminate_raises() -> Iterator[None]:
    """SIGTERM ends the block with SystemExit (as SIGINT does with KeyboardInterrupt),
    so the caller's cleanup runs; a no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class WeightFile:
    """A weight file mapped read-only and checked against a spec at open.

    `tensor(name)` views the mapping (no copy). The views are read-only: writing
    to one faults. Close (or use as a context manager) once no view is used.
    """

    def __init__(self, path: str | Path, spec: WeightTable):
        self.path = Path(path)
        self.spec = spec
        if not self.path.exists():
            raise WeightFileError(
                f"weight file {self.path} does not exist; write one with "
                f"mode=materialize out={self.path} or point weights.file at a checkpoint")
        if not self.path.is_file():
            raise WeightFileError(f"{self.path} is not a regular file (a directory or a device?); "
                                  "point weights.file at a safetensors file")
        try:
            with open(self.path, "rb") as f:
                self.file_bytes = os.fstat(f.fileno()).st_size
                self.header, self.data_start = _read_header(f, self.path, self.file_bytes)
                self._entries = _check_entries(self.header, spec, self.path, self.file_bytes - self.data_start)
                # Mapped from the same open file that was checked, so a file replaced
                # in between cannot slip past the checks.
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as err:
            raise WeightFileError(f"cannot read weight file {self.path} ({err.strerror or err}); "
                                  "check it is readable and on a local file system") from None
        self._views: dict[str, torch.Tensor] = {}

    @property
    def closed(self) -> bool:
        return self._map is None

    def check_intact(self) -> None:
        """Raise WeightFileError if the file shrank since it was opened: reading the
        mapping past the new end would kill the process (SIGBUS)."""
        try:
            now = self.path.stat().st_size
        except OSError as err:
            raise WeightFileError(f"weight file {self.path} went away while in use ({err.strerror or err}); "
                                  "put it back or write it again with mode=materialize") from None
        if now < self.file_bytes:
            raise WeightFileError(f"weight file {self.path} was truncated while in use ({now:,} of "
                                  f"{self.file_bytes:,} bytes); write it again with mode=materialize")

    def base_address(self) -> int:
        """Address of the mapping's first byte (page-aligned: mmap maps whole pages)."""
        return self._frombuffer(0, 1, torch.uint8).data_ptr()

    def _frombuffer(self, begin: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        if self._map is None:
            raise WeightFileError(f"weight file {self.path} is closed")
        # Each view holds its own memoryview of the mapping: while any view lives,
        # the mapping cannot be closed under it (close() raises instead).
        with warnings.catch_warnings():
            # The mapping is read-only by design; torch warns about any non-writable buffer.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(memoryview(self._map)[begin:end], dtype=dtype)

    def tensor(self, name: str) -> torch.Tensor:
        """The host tensor of weight `name`, a view of the mapping."""
        view = self._views.get(name)
        if view is None:
            if name not in self._entries:
                raise WeightFileError(f"{name} is not a weight of model {self.spec.name}")
            begin, end = self._entries[name]
            w = self.spec.weights[name]
            view = self._frombuffer(self.data_start + begin, self.data_start + end,
                                    torch_dtype(w.dtype)).view(w.shape)
            self._views[name] = view
        return view

    def offset(self, name: str) -> int:
        """Where weight `name` begins, in bytes from the start of the file (and of the mapping)."""
        if name not in self._entries:
            raise WeightFileError(f"{name} is not a weight of model {self.spec.name}")
        return self.data_start + self._entries[name][0]

    def file_view(self) -> torch.Tensor:
        """The whole file as bytes (uint8), a view of the mapping."""
        return self._frombuffer(0, self.file_bytes, torch.uint8)

    def data_view(self) -> torch.Tensor:
        """The whole data section as bytes (uint8), a view of the mapping."""
        return self._frombuffer(self.data_start, self.file_bytes, torch.uint8)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every spec weight, as views of the mapping."""
        return {name: self.tensor(name) for name in self.spec.weights}

    def close(self) -> None:
        if self._map is None:
            return
        self._views.clear()
        try:
            self._map.close()
        except BufferError as err:
            raise WeightFileError(
                f"cannot close {self.path}: tensors viewing its mapping are still referenced; "
                "drop them (and close the executor using them) first") from err
        self._map = None

    def __enter__(self) -> WeightFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# safetensors' own reader refuses headers over 100 MB; the largest real ones
# (thousands of tensors) are a few MB. Without the cap a file that is not
# safetensors could make us read gigabytes as a "header".
MAX_HEADER_BYTES = 100_000_000


def _read_header(f, path: Path, file_bytes: int) -> tuple[dict, int]:
    if file_bytes < 8:
        raise WeightFileError(f"{path} is {file_bytes} bytes, too short for a safetensors header; "
                              "the file is truncated: write it again")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > MAX_HEADER_BYTES:
        raise WeightFileError(f"{path}: the header claims {n} bytes, over safetensors' limit of "
                              f"{MAX_HEADER_BYTES}; this is not a safetensors file: point weights.file at one")
    if n > file_bytes - 8:
        raise WeightFileError(f"{path}: the header claims {n} bytes but the file has {file_bytes - 8} "
                              "after the length; the file is truncated or not safetensors: write it again")
    raw = f.read(n)
    if not raw.startswith(b"{"):
        raise WeightFileError(f"{path}: the header does not start with '{{'; the file is damaged or not "
                              "safetensors: write it again or point weights.file at a safetensors file")
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightFileError(f"{path}: the header is not valid JSON ({err}); "
                              "the file is damaged or not safetensors: write it again") from None
    except RecursionError:
        raise WeightFileError(f"{path}: the header nests too deeply for a safetensors header; "
                              "the file is damaged or not safetensors: write it again") from None
    if not isinstance(header.get("__metadata__", {}), dict):
        raise WeightFileError(f"{path}: the header's __metadata__ is not an object; the file is damaged: "
                              "write it again")
    return header, 8 + n


def _unique_keys(path: Path):
    """A json object hook that refuses a key given twice (JSON would keep the last
    one silently, and the first entry's bytes would go unchecked)."""
    def pairs_to_dict(pairs: list[tuple[str, object]]) -> dict:
        out: dict = {}
        for key, value in pairs:
            if key in out:
                raise WeightFileError(f"{path}: the header names {key} twice; the file is damaged: "
                                      "write it again")
            out[key] = value
        return out
    return pairs_to_dict


def _naturals(value: object) -> bool:
    """A JSON list of non-negative integers (bools are ints in Python, not here)."""
    return isinstance(value, list) and all(type(x) is int and x >= 0 for x in value)


def _parse_entry(name: str, entry: object, path: Path) -> tuple[int, int, str, tuple[int, ...]]:
    """(begin, end, safetensors dtype, shape) of one header entry, strictly typed."""
    if not isinstance(entry, dict):
        raise WeightFileError(f"{path}: header entry {name} is not an object; the file is damaged: "
                              "write it again")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(dtype, str) and _naturals(shape) and _naturals(offsets) and len(offsets) == 2):
        got = json.dumps({"dtype": dtype, "shape": shape, "data_offsets": offsets})
        raise WeightFileError(f"{path}: header entry {name} needs a dtype string, a shape of non-negative "
                              f"integers and two integer data_offsets, not {got[:120]}; the file is "
                              "damaged: write it again")
    return offsets[0], offsets[1], dtype, tuple(shape)


def _check_entries(header: dict, spec: WeightTable, path: Path, data_bytes: int) -> dict[str, tuple[int, int]]:
    """(begin, end) per spec weight, after every check the spec and the header allow."""
    missing = [name for name in spec.weights if name not in header]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightFileError(
            f"weight {missing[0]} of model {spec.name} is missing from {path}{more}; "
            f"this file is for another model: materialize one for {spec.name} or fix weights.file")
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end, st_dtype, shape = _parse_entry(name, entry, path)
        if begin > end:
            raise WeightFileError(f"{path}: {name} ends (byte {end}) before it begins (byte {begin}); "
                                  "the header is wrong: write the file again")
        if end > data_bytes:
            raise WeightFileError(
                f"{path}: {name} lies at bytes [{begin}, {end}) but the data section has {data_bytes} "
                "bytes; the file is truncated or its header is wrong: write it again")
        spans.append((begin, end, name))
        w = spec.weights.get(name)
        if w is not None:
            _check_weight(w, st_dtype, shape, end - begin, path, spec.name)
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise WeightFileError(f"{path}: {n0} [{b0}, {e0}) and {n1} [{b1}, {e1}) overlap; "
                                  "the header is wrong: write the file again")
    return {name: (b, e) for b, e, name in spans if name in spec.weights}


def _check_weight(w: WeightSpec, st_dtype: str, shape: tuple[int, ...], nbytes: int, path: Path,
                  model: str) -> None:
    expected = DTYPES[w.dtype][0]
    if st_dtype != expected or shape != w.shape:
        raise WeightFileError(
            f"{path}: {w.name} is {st_dtype}{list(shape)} in the file but the model expects "
            f"{expected}{list(w.shape)}; the file is for another model or dtype: materialize one for "
            f"{model} or convert the checkpoint to {expected}")
    if nbytes != w.numel * DTYPE_BYTES[w.dtype]:
        raise WeightFileError(f"{path}: {w.name} spans {nbytes} bytes but {expected}{list(w.shape)} "
                              f"needs {w.nbytes}; the header is wrong: write the file again")
