"""Intra-node expert gather over CUDA IPC: the bucket leader reads the other EP ranks' experts itself.

In: on every member of an expert-parallel group, its local expert tensors per expert bucket
(`publish`, collective, repeated only when a tensor moved); out, on the leader: per bucket and
member, the member's tensors as views of its GPU memory (opened through CUDA IPC handles), which
the leader copies into the packed bucket row of that member (`copy_rows`).

Why: with the NCCL point-to-point gather, every member runs a send kernel for every bucket. When
a member's GPU also hosts an engine or a receiver (2-GPU boxes, co-located engines), that kernel
takes GPU time slices from the engine's receive kernel, which then runs at about half speed.
Here members launch no work during a sync at all: the leader's process copies the bytes over
NVLink (copy engines, no kernel on the member's side). Members only synchronise their streams
before (their parameters are final) and wait on a CPU barrier after (the leader finished reading).

Used by the exporter (export.py, gather="auto", through PeerExperts) when every trainer rank
runs on one host with CUDA, with one pipeline stage and ETP=1, and the leader can open every
member's GPU (matched by device UUID); otherwise the exporter keeps the NCCL gather. Multi-node
jobs therefore use NCCL even for node-local EP groups (a per-group check would lift that).
Handles are exchanged as typed JSON over a gloo group (ipc_handles.encode,
collectives.all_gather_json).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from . import cuda_copy, ipc_handles
from .collectives import FlagRound, all_gather_json, expert_group, same_host_cuda
from .params import ParamIndex
from .plan import BucketPlan

logger = logging.getLogger(__name__)


def _uuid(index: int) -> str:
    return str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))


class PeerExperts:
    """The exporter's side of the intra-node gather: whether it is used (decided once, a
    collective), the PeerExpertGather of the current plan (`active`, published again when the
    plan was rebuilt), and the per-sync steps around it."""

    def __init__(self, gather: str, flags: FlagRound):
        self.gather = gather  # "auto" | "nccl" | "ipc"
        self.flags = flags
        self.ok: bool | None = None  # decided once (collective)
        self.active: PeerExpertGather | None = None
        self._pos = None  # (plan, index, bucket -> positions of its experts in the ParamIndex order)

    def before_sync(self) -> None:
        """Every rank, before the sync's flag round: the leader may read our experts right away."""
        if self.active is not None:
            torch.cuda.current_stream().synchronize()

    def prepare(self, plan: BucketPlan, index: ParamIndex, rebuilt: bool) -> None:
        """Collective: decide once whether the gather can be used; publish the experts of a new plan."""
        if self.ok is None:
            self.ok = self._possible(plan)
        if self.ok and (rebuilt or self.active is None):
            self._publish(plan, index)

    def moved(self, plan: BucketPlan, index: ParamIndex, ts: list[torch.Tensor]) -> bool:
        """After the last bucket, on a member: did one of its experts move since it published them?"""
        peer = self.active
        return peer is not None and dist.get_rank() != peer.leader and peer.stale(self._local(plan, index, ts))

    def done(self) -> None:
        """After the last bucket, the leader: its peer reads finished before any member moves on."""
        if self.active is not None and dist.get_rank() == self.active.leader:
            torch.cuda.current_stream().synchronize()

    def _possible(self, plan: BucketPlan) -> bool:
        """Collective, once: may the expert gather read other ranks' memory (same host, CUDA)?"""
        experts = [b for b in plan.buckets if b.kind != "dense"]
        if self.gather == "nccl" or len(plan.ep_members) <= 1 or not experts or len(plan.leaders) > 1:
            ok = False
        else:
            self.flags.max(0)  # creates the gloo group everywhere
            ok = all(b.experts.in_place for b in experts) and same_host_cuda(self.flags.group)
        if self.gather == "ipc" and not ok:
            raise RuntimeError("gather='ipc' needs one pipeline stage, ETP=1 and every expert rank on this "
                               "host with CUDA")
        return ok

    def _local(self, plan: BucketPlan, index: ParamIndex, params: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
        """bucket index -> this rank's local experts in packing order ({} outside the gather).
        `params`: this rank's tensors in ParamIndex order (a fresh lookup)."""
        from megatron.core import parallel_state as mpu

        if mpu.get_expert_data_parallel_rank() != 0:
            return {}
        pos = self._pos
        if pos is None or pos[0] is not plan or pos[1] is not index:  # positions, per plan
            at = index.pos
            pos = self._pos = (plan, index, {
                b.index: [at[(b.experts.vpp, p.local_name)] for p in b.experts.params]
                for b in plan.buckets if b.kind != "dense"})
        return {b: [params[i] for i in idx] for b, idx in pos[2].items()}

    def _publish(self, plan: BucketPlan, index: ParamIndex) -> None:
        from megatron.core import parallel_state as mpu

        group = expert_group(mpu.get_expert_tensor_parallel_world_size())
        peer = PeerExpertGather(self.flags.group, plan.leaders[0], dist.get_process_group_ranks(group))
        if peer.publish(self._local(plan, index, index.lookup())):
            self.active = peer
        else:
            self.active, self.ok = None, False


class PeerExpertGather:
    """The leader's views of other ranks' experts (see module doc). `group`: a gloo group of all
    trainer ranks (every rank calls publish); `members`: the expert group's global ranks."""

    def __init__(self, group, leader: int, members: list[int]):
        self.group = group
        self.leader = leader
        self.members = list(members)
        self.rank = dist.get_rank()
        self._sig = None
        self._runs: dict[tuple[int, int], list[tuple[torch.Tensor, int, int]]] = {}  # (bucket, member) -> runs
        self._opened: dict = {}
        # "torch": Tensor.copy_ (PyTorch enqueues a cross-device copy on the member GPU's stream);
        # "driver": on the leader's own stream (cuda_copy.py). Neither won consistently on
        # 2 x H200 (within +-2% run to run, BENCHMARKS.md), so the plain one is the default
        self.copier = "torch"

    def stale(self, local: dict[int, list[torch.Tensor]]) -> bool:
        sig = tuple((b, tuple((t.data_ptr(), t.numel() * t.element_size()) for t in ts))
                    for b, ts in sorted(local.items()))
        return sig != self._sig

    def publish(self, local: dict[int, list[torch.Tensor]]) -> bool:
        """Collective over `group`. `local`: bucket index -> this rank's expert tensors in packing
        order ({} on ranks outside the expert group). Returns False (everyone) if the leader
        cannot open some member's memory: the caller falls back to the NCCL gather."""
        mine: dict = {"rank": self.rank, "buckets": {}, "handles": []}
        if local and self.rank != self.leader:
            dev = next(iter(local.values()))[0].device
            mine["uuid"] = _uuid(dev.index)
            stores: dict[int, int] = {}
            for b, ts in local.items():
                rows = []
                for t in ts:
                    whole, off = ipc_handles.storage_bytes(t)
                    k = whole.data_ptr()
                    if k not in stores:
                        stores[k] = len(mine["handles"])
                        mine["handles"].append(ipc_handles.encode(whole))
                    rows.append([stores[k], off, t.numel() * t.element_size()])
                mine["buckets"][str(b)] = rows
        everyone = all_gather_json(mine, self.group)
        ok = 1
        if self.rank == self.leader:
            self._runs = {}
            uuids = {_uuid(i): i for i in range(torch.cuda.device_count())}
            try:
                for info in everyone:
                    if info["rank"] not in self.members or not info["buckets"]:
                        continue
                    if info.get("uuid") not in uuids:
                        raise RuntimeError(f"rank {info['rank']}'s GPU {info.get('uuid')} is not visible here")
                    dev = torch.device("cuda", uuids[info["uuid"]])
                    wholes = []
                    for h in info["handles"]:
                        key = ipc_handles.handle_key(h)
                        if key not in self._opened:
                            self._opened[key] = ipc_handles.decode(h, dev)
                            cuda_copy.enable_peer_access(torch.device("cuda", torch.cuda.current_device()),
                                                         self._opened[key])
                        wholes.append(self._opened[key])
                    for b, rows in info["buckets"].items():  # back to back in its memory: one copy
                        self._runs[(int(b), info["rank"])] = ipc_handles.byte_runs(
                            (wholes[s], off, n) for s, off, n in rows)
            except Exception as e:
                logger.warning("intra-node expert gather unavailable (%s); using NCCL point-to-point", e)
                ok = 0
        t = torch.tensor([ok], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        if t.item():
            self._sig = None if not local else tuple(
                (b, tuple((x.data_ptr(), x.numel() * x.element_size()) for x in ts)) for b, ts in sorted(local.items()))
        return bool(t.item())

    def copy_rows(self, bucket: int, rows: list[torch.Tensor]) -> None:
        """Leader: rows[i] <- member i's packed experts of `bucket` (peer copies, async, on the
        leader's stream: nothing is launched on the member's GPU)."""
        driver = self.copier == "driver"
        stream = torch.cuda.current_stream(rows[0].device).cuda_stream if driver else None
        for i, r in enumerate(self.members):
            if r == self.leader:
                continue
            for src, pos, n in self._runs[(bucket, r)]:
                if driver:
                    cuda_copy.copy_on_dst_stream(rows[i][pos: pos + n], src, n, stream)
                else:
                    rows[i][pos: pos + n].copy_(src, non_blocking=True)

    def close(self) -> None:
        self._runs, self._opened = {}, {}
