"""Lazy reads of HF safetensors tensors, a few at a time.

In:  an HF checkpoint dir (an index's shards, else every *.safetensors). Out: `tensor_files`
     (tensor name -> file, from the headers), `tensor_dtypes` (name -> torch dtype) and
     `tensor_nbytes` (name -> bytes), both from the headers (no tensor is read), and `HFReader.read(names)`: those tensors, each
     file opened with safetensors' safe_open for the read and closed after it (a file kept mapped
     would count its touched pages in the process's resident memory).
"""

from __future__ import annotations

import torch


def _headers(hf_dir: str):
    """(file, open safetensors handle) for each file of the checkpoint, one open at a time."""
    from safetensors import safe_open

    from .preflight import safetensors_files

    for path in safetensors_files(hf_dir):
        with safe_open(path, framework="pt") as f:
            yield path, f


def tensor_files(hf_dir: str) -> dict[str, str]:
    return {name: path for path, f in _headers(hf_dir) for name in f.keys()}


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def tensor_dtypes(hf_dir: str) -> dict[str, torch.dtype]:
    return {name: _DTYPES[dt] for _, f in _headers(hf_dir) for name in f.keys()
            if (dt := f.get_slice(name).get_dtype()) in _DTYPES}


def tensor_nbytes(hf_dir: str) -> dict[str, int]:
    out = {}
    for _, f in _headers(hf_dir):
        for name in f.keys():
            piece = f.get_slice(name)
            numel = 1
            for d in piece.get_shape():
                numel *= d
            out[name] = numel * _DTYPES[piece.get_dtype()].itemsize
    return out


class HFReader:
    def __init__(self, hf_dir: str):
        self.files = tensor_files(hf_dir)

    def read(self, names: list[str]) -> list[torch.Tensor]:
        from safetensors import safe_open

        out = {}
        for path in dict.fromkeys(self.files[n] for n in names):
            with safe_open(path, framework="pt", device="cpu") as f:
                out.update({n: f.get_tensor(n) for n in names if self.files[n] == path})
        return [out[n] for n in names]
