"""Lazy reads of HF safetensors tensors, a few at a time.

In:  an HF checkpoint dir (an index's shards, else every *.safetensors). Out: `tensor_files`
     (tensor name -> file, from the headers), and `HFReader.read(names)`: those tensors, each
     file opened with safetensors' safe_open for the read and closed after it (a file kept mapped
     would count its touched pages in the process's resident memory).
"""

from __future__ import annotations

import torch


def tensor_files(hf_dir: str) -> dict[str, str]:
    from safetensors import safe_open

    from .preflight import safetensors_files

    out = {}
    for path in safetensors_files(hf_dir):
        with safe_open(path, framework="pt") as f:
            out.update({name: path for name in f.keys()})
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
