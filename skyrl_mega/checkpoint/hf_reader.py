"""Lazy reads of HF safetensors tensors, a few at a time, in either expert layout.

In:  an HF checkpoint dir (an index's shards, else every *.safetensors). Out, all from the
     headers (no tensor is read), keyed by the names the bridges use: fused experts appear as
     their per-expert parts (expert_layout.py), every other tensor under its stored name:
       `tensor_files` (name -> file), `tensor_nbytes` (name -> bytes), `expert_layout` (the
       checkpoint's ExpertLayout), HFReader.dtypes() (name -> torch dtype);
     and `HFReader.read(names)`: those tensors (a part read alone from its fused tensor), each
     file opened with safetensors' safe_open for the read and closed after it (a file kept mapped
     would count its touched pages in the process's resident memory). HFReader also answers
     mbridge's reader calls (load_some_hf_weight / load_one_hf_weight), so the trainer's load
     reads either layout through it (bridges/interface.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .expert_layout import ExpertLayout, read_part

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class Stored:
    file: str
    dtype: str        # safetensors' dtype tag
    shape: tuple


def stored_tensors(hf_dir: str) -> dict[str, Stored]:
    """Every stored tensor's file, dtype and shape, from the headers, one file open at a time."""
    from safetensors import safe_open

    from .preflight import safetensors_files

    out = {}
    for path in safetensors_files(hf_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                out[name] = Stored(path, piece.get_dtype(), tuple(piece.get_shape()))
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class HFReader:
    def __init__(self, hf_dir: str):
        self.stored = stored_tensors(hf_dir)
        self.layout = ExpertLayout({n: s.shape for n, s in self.stored.items()})
        self.files = {n: self.stored[self._source(n)].file for n in self.layout.view(self.stored)}

    def _source(self, name: str) -> str:
        part = self.layout.parts.get(name)
        return part.stored if part else name

    def dtypes(self) -> dict[str, torch.dtype]:
        return {n: _DTYPES[t] for n in self.files if (t := self.stored[self._source(n)].dtype) in _DTYPES}

    def nbytes(self) -> dict[str, int]:
        out = {}
        for n in self.files:
            s = self.stored[self._source(n)]
            whole = _numel(s.shape) * _DTYPES[s.dtype].itemsize
            part = self.layout.parts.get(n)
            out[n] = whole if part is None else whole // len(self.layout.members[part.stored])
        return out

    def read(self, names: list[str]) -> list[torch.Tensor]:
        from safetensors import safe_open

        unknown = [n for n in names if n not in self.files]
        if unknown:
            raise KeyError(f"not in the checkpoint: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        out = {}
        for path in dict.fromkeys(self.files[n] for n in names):
            with safe_open(path, framework="pt", device="cpu") as f:
                for n in names:
                    if self.files[n] != path:
                        continue
                    part = self.layout.parts.get(n)
                    out[n] = f.get_tensor(n) if part is None else read_part(f, part)
        return [out[n] for n in names]

    # mbridge's SafeTensorIO interface (its load_weights calls these)
    def load_some_hf_weight(self, names: list[str]) -> dict[str, torch.Tensor]:
        names = list(dict.fromkeys(names))
        return dict(zip(names, self.read(names)))

    def load_one_hf_weight(self, name: str) -> torch.Tensor:
        return self.read([name])[0]


def tensor_files(hf_dir: str) -> dict[str, str]:
    return HFReader(hf_dir).files


def tensor_nbytes(hf_dir: str) -> dict[str, int]:
    return HFReader(hf_dir).nbytes()


def expert_layout(hf_dir: str) -> ExpertLayout:
    return HFReader(hf_dir).layout
