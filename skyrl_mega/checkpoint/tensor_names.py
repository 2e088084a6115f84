"""Conversion is strict: a checkpoint must hold exactly the tensors the model loads.

In: the tensor names this rank loads, and the names the checkpoint holds (the same on every
rank). Out: None, or one CheckpointError, raised alike on every rank, naming the tensors that
are missing and those that are left over (a short list and a count).

    hf_weight_names(bridge, models)   the HF names load_hf reads for this rank's chunks
    hf_file_tensor_names(hf_dir)      the names in an HF dir's safetensors headers
    requested_keys(sharded_state)     the tensor keys a sharded state dict loads
    dist_ckpt_model_keys(ckpt_dir)    a dist-ckpt's model tensors (no optimizer state)
    check_same_tensors(where, here, present)   collective
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from ..devices import current_device
from .dist_ckpt import CheckpointError

SHOWN = 5


def hf_weight_names(bridge, models) -> set[str]:
    """The HF tensor names that loading HF weights reads for this rank's chunks (mbridge's
    own mcore -> HF name mapping, as its load_weights uses it)."""
    names = set()
    for model in models:
        for _, hf_names in bridge.hf_sources(model).values():
            names.update(hf_names)
    return names


def hf_file_tensor_names(hf_dir: str) -> set[str]:
    from .hf_reader import tensor_files

    return set(tensor_files(hf_dir))


def requested_keys(sharded_state: dict) -> set[str]:
    """Tensor keys (not _extra_state objects) that dist_checkpointing.load would read. A
    ShardedTensorFactory stands for the tensors its build() makes (megatron's Mamba mixer saves
    in_proj / conv1d as their parts, `in_proj.weight.z` ...)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    keys, todo = set(), list(nested_values(sharded_state))
    while todo:
        v = todo.pop()
        if isinstance(v, ShardedTensorFactory):
            built = v.build()
            todo.extend(nested_values(built) if isinstance(built, (dict, list)) else [built])
        elif not v.key.endswith("_extra_state"):
            keys.add(v.key)
    return keys


def dist_ckpt_model_keys(ckpt_dir: str) -> set[str]:
    """A trainer checkpoint also holds optimizer state ('optimizer.*', or 'chained_N.optimizer.*'
    for the dense + expert optimizers): a name component 'optimizer' is never a model tensor's."""
    from megatron.core import dist_checkpointing

    return {k for k in dist_checkpointing.load_tensors_metadata(ckpt_dir)
            if "optimizer" not in k.split(".") and not k.endswith("_extra_state")}


def describe(names: list[str], what: str) -> str:
    """'2 tensors missing (a, b)' / '9 tensors missing (a, b, c, d, e and 4 more)'."""
    shown = ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
    return f"{len(names)} tensor{'s' if len(names) != 1 else ''} {what} ({shown})"


def _union_over_ranks(names: list[str]) -> set[str]:
    """Collective: every rank's names (JSON bytes in uint8 tensors; sizes first, then bytes)."""
    dev, n = current_device(), dist.get_world_size()
    payload = torch.tensor(list(json.dumps(names).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64, device=dev))
    longest = max(int(s.item()) for s in sizes)
    bufs = [torch.zeros(longest, dtype=torch.uint8, device=dev) for _ in range(n)]
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(payload)] = payload
    dist.all_gather(bufs, mine.to(dev))
    return set().union(*(json.loads(bytes(b[: int(s.item())].cpu().tolist())) for b, s in zip(bufs, sizes)))


def check_same_tensors(where: str, here: set[str], present: set[str]) -> None:
    """Collective. `here`: the names this rank loads; `present`: what the checkpoint holds.
    Missing: loaded by some rank, not present. Unexpected: present, loaded by no rank."""
    order = sorted(present)
    index = {name: i for i, name in enumerate(order)}
    used = torch.zeros(len(order), dtype=torch.int32)
    used[[index[n] for n in here if n in index]] = 1
    missing = sorted(n for n in here if n not in index)
    if dist.is_initialized() and dist.get_world_size() > 1:
        used = used.to(current_device())
        dist.all_reduce(used, op=dist.ReduceOp.MAX)
        missing = sorted(_union_over_ranks(missing))
    unexpected = [n for n, u in zip(order, used.tolist()) if not u]
    problems = ([describe(missing, "missing")] if missing else []) + (
        [describe(unexpected, "unexpected")] if unexpected else [])
    if problems:
        raise CheckpointError(f"{where}: {', '.join(problems)}")
