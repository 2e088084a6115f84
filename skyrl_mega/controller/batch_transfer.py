"""Broadcast an RLBatch from the controller (rank 0) to every trainer rank, without pickle.

In: an RLBatch on `src` (None elsewhere). Out: the same RLBatch on every rank. The batch is
flattened into a few typed tensors (concatenated fields + a lengths header), broadcast with
torch.distributed, and split again.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..devices import current_device
from ..megatron.train_step import RLBatch

_FIELDS = ("input_ids", "response_mask", "advantages", "rollout_logprobs", "ref_logprobs", "routed_experts")
_DTYPES = {"input_ids": torch.int64, "response_mask": torch.float32, "advantages": torch.float32,
           "rollout_logprobs": torch.float32, "ref_logprobs": torch.float32, "routed_experts": torch.int32}  # gloo has no int16


def _bcast(t: torch.Tensor, src: int) -> torch.Tensor:
    dev = current_device()
    moved = t.to(dev)
    dist.broadcast(moved, src)
    return moved.cpu()


def broadcast_rl_batch(batch: RLBatch | None, src: int = 0) -> RLBatch:
    rank = dist.get_rank()
    # header: [n, present flags..., route dims (layers, topk)]
    if rank == src:
        n = len(batch)
        present = [getattr(batch, f) is not None for f in _FIELDS]
        routes = batch.routed_experts
        dims = list(routes[0].shape[1:]) if present[-1] else [0, 0]
        header = torch.tensor([n, *map(int, present), *dims], dtype=torch.int64)
    else:
        header = torch.zeros(1 + len(_FIELDS) + 2, dtype=torch.int64)
    header = _bcast(header, src)
    n, present, dims = int(header[0]), header[1:1 + len(_FIELDS)].bool().tolist(), header[-2:].tolist()
    lengths = torch.tensor(batch.lengths if rank == src else [0] * n, dtype=torch.int64)
    lengths = _bcast(lengths, src).tolist()
    route_lengths = torch.tensor([r.shape[0] for r in batch.routed_experts] if rank == src and present[-1]
                                 else [0] * n, dtype=torch.int64)
    route_lengths = _bcast(route_lengths, src).tolist() if present[-1] else None
    out = {}
    for field, has in zip(_FIELDS, present):
        if not has:
            out[field] = None
            continue
        dtype = _DTYPES[field]
        sizes = route_lengths if field == "routed_experts" else lengths
        if field == "advantages" and rank == src:
            vals = [a.expand(L) if a.numel() == 1 else a for a, L in zip(batch.advantages, lengths)]
        else:
            vals = getattr(batch, field) if rank == src else None
        if rank == src:
            flat = torch.cat([v.to(dtype).reshape(-1) for v in vals])
        else:
            per = (dims[0] * dims[1]) if field == "routed_experts" else 1
            flat = torch.empty(sum(sizes) * per, dtype=dtype)
        flat = _bcast(flat, src)
        if field == "routed_experts":
            parts = torch.split(flat.view(-1, dims[0], dims[1]), sizes)
            out[field] = [p.to(torch.int64) for p in parts]
        else:
            out[field] = list(torch.split(flat, sizes))
    return RLBatch(**out)
