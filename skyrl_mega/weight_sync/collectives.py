"""The trainer ranks' collectives of a weight sync (torch.distributed; typed data only, no pickle).

    all_gather_json(obj, group)        every rank's JSON-able object (JSON bytes in a uint8
                                       tensor, one all_gather for the sizes, one for the bytes)
    FlagRound.max(*ints)               max of small ints over all ranks, on the CPU (gloo)
    gather_rows(send, rows, root, ...) every member's row at the root, one point-to-point round
    p2p(ops)                           one batched isend/irecv round
    same_host_cuda(group)              do all ranks of a gloo group share this host, with CUDA?
    expert_group(etp)                  the process group that gathers one layer's experts

Used by planner.py (metadata exchange, once per model shape), plan_check.py (the flag round
that opens every sync), export.py (the per-bucket gathers) and peer_gather.py (handles).
"""

from __future__ import annotations

import json
import socket
import zlib

import torch
import torch.distributed as dist


def _coll_device(group) -> torch.device:
    """Where a collective of `group` takes its tensors: the CPU if its backend has gloo, else
    this rank's CUDA device (NCCL)."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def all_gather_bytes(payload: bytes, group=None) -> list[bytes]:
    """Every rank's bytes, in group rank order (two all_gathers: sizes, then padded bytes)."""
    dev = _coll_device(group)
    n = dist.get_world_size(group)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    sizes = [int(s.item()) for s in sizes]
    longest = max(sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    buf = buf.to(dev)
    outs = [torch.zeros(longest, dtype=torch.uint8, device=dev) for _ in range(n)]
    dist.all_gather(outs, buf, group=group)
    return [bytes(o[:s].cpu().numpy()) for o, s in zip(outs, sizes)]


def all_gather_json(obj, group=None) -> list:
    """Every rank's `obj` (JSON types: dict with str keys, list, str, int, float, bool, None;
    tuples come back as lists), in group rank order."""
    return [json.loads(raw) for raw in all_gather_bytes(json.dumps(obj).encode(), group)]


class FlagRound:
    """Max of small ints over all trainer ranks (each on its own), on the CPU (gloo). One
    value in: an int back; several: a tuple.

    With NCCL a rank that is done early would otherwise sit in a spinning NCCL kernel for the
    rest of the sync, and on a GPU it shares with a receiver that kernel takes GPU time
    slices from the receiver (measured on H200: the receiver's broadcast at half speed).
    `group`: the gloo group of all ranks (created by the first round on more than one rank)."""

    def __init__(self):
        self.group = None

    def max(self, *values: int):
        out = [int(v) for v in values]
        if dist.is_initialized() and dist.get_world_size() > 1:
            if self.group is None:
                self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
            t = torch.tensor(out, dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            out = t.tolist()
        return out[0] if len(out) == 1 else tuple(out)


def p2p(ops):
    if not ops:
        return []
    return dist.batch_isend_irecv(ops)


def gather_rows(send: torch.Tensor, rows: list[torch.Tensor] | None, root: int, ranks: list[int], group) -> None:
    """Rows of all group members at the root (rows[i] <- member i's `send`), one P2P round."""
    me = dist.get_rank()
    if me == root:
        mine = rows[ranks.index(root)]
        if mine.data_ptr() != send.data_ptr():
            mine.copy_(send)
        reqs = p2p([dist.P2POp(dist.irecv, rows[i], r, group) for i, r in enumerate(ranks) if r != root])
    else:
        reqs = p2p([dist.P2POp(dist.isend, send, root, group)])
    for r in reqs:
        r.wait()


def same_host_cuda(group) -> bool:
    """True when every rank of `group` (a gloo group) runs on this host with CUDA tensors."""
    if not torch.cuda.is_available():
        ok = 0
    else:
        ok = 1
    host = zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF
    t = torch.tensor([[ok, host]], dtype=torch.int64)
    outs = [torch.zeros_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(outs, t, group=group)
    rows = torch.cat(outs)
    return bool(rows[:, 0].all().item()) and len(set(rows[:, 1].tolist())) == 1


def expert_group(etp: int):
    """The group that gathers one MoE layer's experts: EP x ETP when ETP > 1, else EP."""
    from megatron.core import parallel_state as mpu

    if etp > 1:
        return mpu.get_expert_tensor_and_model_parallel_group()
    return mpu.get_expert_model_parallel_group()
