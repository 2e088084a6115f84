"""An HF checkpoint's weights written by several ranks, one safetensors file at a time.

In:  each rank's groups of HF tensors (a group is one file). Out: `write_group` writes
     `<dir>/part-<rank>-<k>.safetensors` and returns its entry (file, names, bytes);
     `publish_index` (collective) renames every rank's files, in rank then group order, to
     `model-0000i-of-0000N.safetensors` and writes model.safetensors.index.json (rank 0).
"""

from __future__ import annotations

import json
import os

import torch

INDEX = "model.safetensors.index.json"


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor with storage of its own (safetensors refuses tensors sharing memory)."""
    t = t.detach().contiguous()
    return t.clone() if t.untyped_storage().nbytes() != t.nbytes else t


def write_group(out_dir: str, rank: int, k: int, tensors: dict[str, torch.Tensor]) -> dict:
    from safetensors.torch import save_file

    name = f"part-{rank:05d}-{k:05d}.safetensors"
    tensors = {n: _own(t) for n, t in tensors.items()}
    save_file(tensors, os.path.join(out_dir, name), metadata={"format": "pt"})
    return {"file": name, "names": sorted(tensors), "bytes": sum(t.nbytes for t in tensors.values())}


def publish_index(out_dir: str, mine: list[dict]) -> None:
    """Collective."""
    import torch.distributed as dist

    from ..weight_sync.collectives import all_gather_json

    everyone = all_gather_json(mine) if dist.get_world_size() > 1 else [mine]
    if dist.get_rank() != 0:
        return
    entries = [e for part in everyone for e in part]
    weight_map, total = {}, 0
    for i, e in enumerate(entries):
        final = f"model-{i + 1:05d}-of-{len(entries):05d}.safetensors"
        os.rename(os.path.join(out_dir, e["file"]), os.path.join(out_dir, final))
        weight_map.update({n: final for n in e["names"]})
        total += e["bytes"]
    with open(os.path.join(out_dir, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
