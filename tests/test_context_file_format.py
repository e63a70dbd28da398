"""The disk tier's tensor files (issue #53 items 3 and 4): written by streaming each tensor's own
memory and read back as views (neither holds the GIL for a whole file), they are safetensors files
as the safetensors library writes and reads them, and a hostile header is refused, never served."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load, save

from sglang_kvx.store.context_file import RefusedFile, read_regular, tensor_file, tensors_of, write_tensor_file

KEY = "a" * 40


def sample() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"k.0": torch.randn(7, 3, 4), "v.0": torch.randn(7, 3, 4).to(torch.bfloat16),
            "pos.0": torch.arange(9, dtype=torch.int64), "mask": torch.tensor([True, False, True]),
            "gdn.scalar": torch.tensor(3.5), "gdn.empty": torch.zeros(0, 4), "half": torch.randn(5).half(),
            "strided": torch.randn(4, 6)[:, ::2], "i8": torch.arange(-3, 3, dtype=torch.int8)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_our_files_are_read_by_safetensors_and_its_files_by_us(tmp_path):
    tensors = sample()
    name, digest = write_tensor_file(tmp_path, KEY, tensor_file(tensors))
    data = (tmp_path / name).read_bytes()
    assert name == f"{KEY}.{digest[:16]}.safetensors" and hashlib.sha256(data).hexdigest() == digest
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no temporary left
    assert same(load(data), tensors)  # the library reads what we wrote
    assert same(tensors_of(read_regular(tmp_path / name), name), tensors)
    theirs = tmp_path / "theirs.safetensors"
    theirs.write_bytes(save({k: v.contiguous() for k, v in tensors.items()}))
    assert same(tensors_of(read_regular(theirs), theirs.name), tensors)  # we read what the library wrote


def hostile(header: object, data: bytes = b"\0" * 16, length: int | None = None) -> bytearray:
    raw = json.dumps(header).encode()
    return bytearray((len(raw) if length is None else length).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize("blob", [
    hostile({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, length=1 << 40),  # header past the end
    hostile(["not", "an", "object"]),
    hostile({"x": {"dtype": "F33", "shape": [4], "data_offsets": [0, 16]}}),  # unknown dtype
    hostile({"x": {"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}}),  # shape against offsets
    hostile({"x": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}),
    hostile({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
             "y": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}),  # overlapping
    hostile({"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}),  # a gap at the start
    hostile({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}),  # data left over
    hostile({"x": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}),  # past the end
    hostile({"x": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}}),
    hostile({"x": {"dtype": "F32", "shape": [4]}}),
    bytearray(b"\x01\x00"),
])
def test_a_hostile_header_is_refused(blob):
    with pytest.raises(RefusedFile) as refused:
        tensors_of(blob, "x.safetensors")
    assert refused.value.reason == "bad_tensors" and "/" not in str(refused.value)
