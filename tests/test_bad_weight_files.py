"""Bad weight files at the API: each is refused at open by a WeightFileError whose
one line names the path, the tensor or the problem, and the fix.

Every case is a valid tiny-model file with one thing broken (or a file that is
not safetensors at all). Nothing may slip through to a crash later (a view past
the end of the mapping, an unchecked duplicate entry) and no file descriptor
may be left open by a refused file.
"""
from __future__ import annotations

import copy
import json
import os
import re
import struct
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pytest

from engine.errors import WeightFileError
from engine.models import load_spec
from engine.weightfile import MAX_HEADER_BYTES, WeightFile, file_order, materialize

WORKLOAD = SimpleNamespace(kind="infer", batch=1, video_tokens=16, audio_tokens=4, text_tokens=4,
                           context_tokens=0, lora_rank=0)
# Every message ends with what to do about it.
FIX = re.compile(r"write (it|the file) again|materialize one|point weights\.file|convert the checkpoint")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    spec = load_spec("tiny", WORKLOAD)
    path = materialize(spec, tmp_path_factory.mktemp("w") / "tiny.ptd", seed=0, device="cpu")
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return SimpleNamespace(spec=spec, raw=raw, header=json.loads(raw[8:8 + n]), data=raw[8 + n:],
                           names=file_order(spec))


def _file(header: dict | None, data: bytes, raw_header: bytes | None = None) -> bytes:
    raw = raw_header if raw_header is not None else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def _edit(edit: Callable[[dict, list[str]], None]) -> Callable[[SimpleNamespace, Path], None]:
    """A case that rewrites the valid header with `edit` and keeps the data."""
    def build(t: SimpleNamespace, path: Path) -> None:
        header = copy.deepcopy(t.header)
        edit(header, t.names)
        path.write_bytes(_file(header, t.data))
    return build


def _bytes(make: Callable[[SimpleNamespace], bytes]) -> Callable[[SimpleNamespace, Path], None]:
    def build(t: SimpleNamespace, path: Path) -> None:
        path.write_bytes(make(t))
    return build


def _set(name_index: int, key: str, value) -> Callable[[dict, list[str]], None]:
    def edit(h: dict, names: list[str]) -> None:
        h[names[name_index]][key] = value
    return edit


def _shift(name_index: int, begin: int, end: int) -> Callable[[dict, list[str]], None]:
    def edit(h: dict, names: list[str]) -> None:
        b, e = h[names[name_index]]["data_offsets"]
        h[names[name_index]]["data_offsets"] = [b + begin, e + end]
    return edit


def _retype(dtype: str, itemsize: int) -> Callable[[SimpleNamespace], bytes]:
    """proj_in.weight (the first tensor) stored as `dtype`, with a data section of the right size."""
    def make(t: SimpleNamespace) -> bytes:
        h = copy.deepcopy(t.header)
        first = h[t.names[0]]
        old = first["data_offsets"][1] - first["data_offsets"][0]
        new = old // 2 * itemsize  # the spec is bf16 (2 bytes an element)
        first["dtype"] = dtype
        first["data_offsets"] = [0, new]
        for name in t.names[1:]:
            b, e = h[name]["data_offsets"]
            h[name]["data_offsets"] = [b - old + new, e - old + new]
        return _file(h, bytes(new) + t.data[old:])
    return make


def _drop(count: int) -> Callable[[dict, list[str]], None]:
    def edit(h: dict, names: list[str]) -> None:
        for name in names[:count]:
            del h[name]
    return edit


def _duplicate(t: SimpleNamespace) -> bytes:
    # JSON would keep the second entry silently; the first one's bytes would go unchecked.
    raw = json.dumps(t.header).encode()
    name = t.names[3]
    raw = raw[:-1] + b', "' + name.encode() + b'": ' + json.dumps(t.header[name]).encode() + b"}"
    return _file(None, t.data, raw)


def _torch_zip(t: SimpleNamespace) -> bytes:  # what torch.save writes: a zip archive
    import io
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    return buf.getvalue()


def _npy(t: SimpleNamespace) -> bytes:
    import io
    buf = io.BytesIO()
    np.save(buf, np.zeros((4, 4), dtype=np.float32))
    return buf.getvalue()


def _gguf(t: SimpleNamespace) -> bytes:  # magic, version 3, tensor and metadata counts
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 0) + bytes(64)


def _sparse_huge_header(t: SimpleNamespace, path: Path) -> None:
    # A header length under the file size but over safetensors' cap: refused
    # before reading it (a sparse file, so the test writes almost nothing).
    n = MAX_HEADER_BYTES + 8
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n) + b"{")
        f.truncate(8 + n + 8)


def _directory(t: SimpleNamespace, path: Path) -> None:
    path.mkdir()


def _absent(t: SimpleNamespace, path: Path) -> None:
    pass


# name -> (build the bad file at path, what the message must say). "{0}" is
# the first tensor in the file (proj_in.weight), "{3}" the fourth.
CASES: dict[str, tuple[Callable[[SimpleNamespace, Path], None], str]] = {
    # truncated
    "truncated by one byte": (_bytes(lambda t: t.raw[:-1]), r"{last} lies at bytes .* truncated"),
    "truncated in the data": (_bytes(lambda t: t.raw[:len(t.raw) // 2]), r"lies at bytes .* truncated"),
    "truncated in the header": (_bytes(lambda t: t.raw[:100]), r"header claims \d+ bytes .* truncated"),
    "truncated in the length": (_bytes(lambda t: t.raw[:5]), r"5 bytes, too short .* truncated"),
    "empty file": (_bytes(lambda t: b""), r"0 bytes, too short"),
    # wrong dtype
    "dtype F32": (_bytes(_retype("F32", 4)), r"{0} is F32\[128, 16\] in the file but the model expects BF16"),
    "dtype F8_E4M3": (_bytes(_retype("F8_E4M3", 1)), r"{0} is F8_E4M3\[128, 16\] .* expects BF16\[128, 16\]"),
    "dtype unknown": (_edit(_set(0, "dtype", "Q4_K")), r"{0} is Q4_K\[128, 16\] in the file"),
    "dtype not a string": (_edit(_set(0, "dtype", ["BF16"])), r"entry {0} needs a dtype string"),
    "dtype absent": (_edit(lambda h, n: h[n[0]].pop("dtype")), r"entry {0} needs a dtype string"),
    # missing tensors
    "one tensor missing": (_edit(_drop(1)), r"weight {0} of model tiny is missing"),
    "every tensor missing": (_edit(lambda h, n: [h.pop(k) for k in n]), r"weight {0} .* missing .* \(and \d+ more\)"),
    # the header lies about offsets
    "offsets past the end": (_edit(_shift(-1, 8, 8)), r"{last} lies at bytes .* data section has"),
    "offsets far past the end": (_edit(_shift(0, 2**40, 2**40)), r"{0} lies at bytes \[1099511627776"),
    "end before begin": (_edit(lambda h, n: h[n[1]].update(data_offsets=h[n[1]]["data_offsets"][::-1])),
                         r"{1} ends \(byte \d+\) before it begins"),
    "overlapping tensors": (_edit(_shift(1, -2, -2)), r"{0} \[.*\) and {1} \[.*\) overlap"),
    "span too short": (_edit(_shift(0, 0, -2)), r"{0} spans 4094 bytes but BF16\[128, 16\] needs 4096"),
    "offsets negative": (_edit(_shift(0, -1, 0)), r"entry {0} needs .* two integer data_offsets"),
    "offsets as strings": (_edit(_set(0, "data_offsets", ["0", "4096"])), r"entry {0} needs .* data_offsets"),
    "offsets as floats": (_edit(_set(0, "data_offsets", [0.0, 4096.0])), r"entry {0} needs .* data_offsets"),
    "offsets as booleans": (_edit(_set(0, "data_offsets", [False, 4096])), r"entry {0} needs .* data_offsets"),
    "one offset": (_edit(_set(0, "data_offsets", [0])), r"entry {0} needs .* two integer data_offsets"),
    "entry not an object": (_edit(lambda h, n: h.update({n[0]: [0, 4096]})), r"entry {0} is not an object"),
    "tensor named twice": (_bytes(_duplicate), r"the header names {3} twice"),
    "metadata not an object": (_edit(lambda h, n: h.update(__metadata__="seed 0")), r"__metadata__ is not an object"),
    # shape mismatch
    "shape transposed": (_edit(_set(0, "shape", [16, 128])), r"{0} is BF16\[16, 128\] in the file but the model "
                                                            r"expects BF16\[128, 16\]"),
    "shape with an extra dim": (_edit(_set(0, "shape", [128, 16, 1])), r"{0} is BF16\[128, 16, 1\]"),
    "shape as a string": (_edit(_set(0, "shape", "12816")), r"entry {0} needs .* a shape of non-negative integers"),
    "shape negative": (_edit(_set(0, "shape", [-128, -16])), r"entry {0} needs .* a shape of non-negative"),
    # not a safetensors file
    "a torch.save zip": (_bytes(_torch_zip), r"header claims \d+ bytes, over safetensors' limit"),
    "a numpy .npy": (_bytes(_npy), r"header claims \d+ bytes, over safetensors' limit"),
    "a GGUF file": (_bytes(_gguf), r"header claims \d+ bytes, over safetensors' limit"),
    "a text file": (_bytes(lambda t: b"model: tiny\nweights: none\n" * 4), r"over safetensors' limit"),
    "header over the cap": (_sparse_huge_header, r"header claims 100000008 bytes, over safetensors' limit"),
    "header longer than the file": (_bytes(lambda t: struct.pack("<Q", 4096) + b"{}"),
                                    r"header claims 4096 bytes but the file has 2"),
    "header a JSON list": (_bytes(lambda t: _file(None, t.data, b"[1, 2]")), r"does not start with '{{'"),
    "header not JSON": (_bytes(lambda t: _file(None, t.data, b"{tensor: 1}")), r"header is not valid JSON"),
    "header not UTF-8": (_bytes(lambda t: _file(None, t.data, b'{"\xff\xfe": 1}')), r"header is not valid JSON"),
    "header nested too deep": (_bytes(lambda t: _file(None, b"", b'{"a":' * 100_000 + b"1" + b"}" * 100_000)),
                               r"nests too deeply"),
    "a directory": (_directory, r"is not a regular file"),
    "no file": (_absent, r"does not exist; write one with mode=materialize"),
}


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("case", CASES)
def test_a_bad_weight_file_is_refused_in_one_line(tiny, tmp_path, case):
    build, expected = CASES[case]
    path = tmp_path / "bad.ptd"
    build(tiny, path)
    expected = expected.format(*(re.escape(n) for n in tiny.names[:4]), last=re.escape(tiny.names[-1]))
    fds = _open_fds()
    with pytest.raises(WeightFileError) as err:
        WeightFile(path, tiny.spec)
    message = str(err.value)
    assert re.search(expected, message), message
    assert "\n" not in message
    assert str(path) in message
    assert FIX.search(message), f"no fix in: {message}"
    assert _open_fds() == fds  # the refused file is not left open (nor mapped)


def test_the_valid_file_opens(tiny, tmp_path):
    # The cases differ from this file in one thing only.
    path = tmp_path / "good.ptd"
    path.write_bytes(_file(tiny.header, tiny.data))
    with WeightFile(path, tiny.spec) as wf:
        assert len(wf.tensors()) == len(tiny.spec.weights)
