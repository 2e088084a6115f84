"""The packed-bucket wire protocol: the NCCL transport's sender side, every receiver's receive loop.

Used by transports/nccl.py (rank 0 sends), vllm_engine.py (the engines receive) and any other
receiver (tests/support/receiver.py). Control plane (vLLM's native weight-transfer calls;
HTTP endpoints of a vLLM server, JSON bodies):
    init_weight_transfer_engine(init_info)   join the transfer group (once)
    start_weight_update()                    begin an update (vLLM: layer-wise reload starts)
    update_weights(update_info)              receive + load ONE WHOLE SYNC (all buckets)
    finish_weight_update(weight_version)     commit: the engine reports `weight_version`

init_info  = {"mode": "broadcast", "comm_backend": "nccl"|"gloo", "master_address",
              "master_port", "rank_offset", "world_size", "timeout_s"}
update_info = {"version", "verify": bool, "plan_id", "sizes": [bucket nbytes], "num_tensors",
               "plan": {"plan_id", "num_tensors", "buckets": [{"nbytes", "kind",
                        "tensors": [[name, dtype, shape, offset, nbytes]]}]} | None}
              The full plan travels only when the receivers have not seen that plan_id yet
              (receivers cache it; names, dtypes, shapes and offsets are reused while the model
              shape is unchanged); "sizes" always travels, so that a receiver that lost the
              plan can still drain the sync and report the failure instead of hanging.

Data plane, in one process group spanning the trainer sender (rank 0) and every receiver:
    for each bucket k:  broadcast uint8[nbytes_k] from rank 0
                        bytes [0, 64) are the header int64[8]:
                        MAGIC, PROTO, version id, k, status (0 data, 1 abort), nbytes, plan key, 0
    trailer:            broadcast int64[2 + 2T]: END, version id, per-tensor checksums (zeros
                        unless verify)
    status:             all_reduce(SUM) int64[world]: each receiver writes 0 (ok),
                        1 (checksum mismatch) or 2 (load failed) at its own rank
An aborted sync: the sender sends bucket k with status 1, plus bucket k+1 as filler (each
receiver has posted at most one bucket ahead), and no trailer: every receiver raises,
keeps its old weight version, and the group stays usable for the next sync. A receiver that
fails to load a bucket keeps receiving (drains) so nobody hangs, then reports status 2.
The same protocol runs over gloo (CPU tests) and NCCL (GPU): only the communicator differs.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
from typing import Any

import torch
import torch.distributed as dist

from ..rollout.errors import WeightSyncError
from .checksum import buffer_checksums
from .plan import HEADER_BYTES, TensorSlot, plan_from_wire, to_dtype

logger = logging.getLogger(__name__)

MAGIC = 0x534B594C4D454741  # "SKYLMEGA"
END = 0x454E445F53594E43  # "END_SYNC"
PROTO = 1
STATUS_DATA, STATUS_ABORT = 0, 1
OK, MISMATCH, LOAD_FAILED = 0, 1, 2


class WeightSyncAborted(WeightSyncError):
    """The trainer aborted the sync half-way; the receiver keeps its previous version."""


def version_id(version: Any) -> int:
    return int(hashlib.sha1(str(version).encode()).hexdigest()[:15], 16)


def plan_key(plan_id: str) -> int:
    return int(plan_id[:15], 16) if plan_id else 0


def write_header(buf: torch.Tensor, vid: int, index: int, status: int, nbytes: int, pkey: int) -> None:
    h = torch.tensor([MAGIC, PROTO, vid, index, status, nbytes, pkey, 0], dtype=torch.int64)
    buf[:64].view(torch.int64).copy_(h.to(buf.device, non_blocking=False))


def read_header(buf: torch.Tensor) -> list[int]:
    return buf[:64].view(torch.int64).cpu().tolist()


class Communicator:
    """A process group of its own (not torch's default world): TCPStore rendezvous + gloo or NCCL.

    Rank 0 (the trainer sender) hosts the TCPStore unless a store is passed in."""

    def __init__(self, backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                 timeout_s: float = 600.0, device: torch.device | str | None = None, store=None,
                 group: str = "skyrl_ws_pg"):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"comm backend must be gloo or nccl, got {backend!r}")
        self.backend, self.rank, self.world_size = backend, rank, world_size
        self.device = torch.device(device if device is not None else ("cuda" if backend == "nccl" else "cpu"))
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(master_address, int(master_port), world_size, rank == 0, timeout=timeout,
                                  wait_for_workers=False)
        self.store = store
        prefixed = dist.PrefixStore(group, store)  # a new name per re-formed group (same store)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)

    def broadcast(self, t: torch.Tensor, src: int = 0):
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self.pg.broadcast([t], opts)

    def all_reduce_sum(self, t: torch.Tensor):
        """In place; returns the work, like broadcast (the caller waits)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return self.pg.allreduce([t], opts)

    def close(self) -> None:
        try:
            if hasattr(self.pg, "shutdown"):
                self.pg.shutdown()
        except Exception:  # best effort
            pass
        self.pg = None


# -- the receive loop -------------------------------------------------------------------------------
class ParsedPlan:
    def __init__(self, wire: dict):
        self.plan_id, self.buckets = plan_from_wire(wire)
        self.sizes = [b["nbytes"] for b in wire["buckets"]]
        self.num_tensors = int(wire["num_tensors"])
        self.names = [t.name for b in self.buckets for t in b]


def resolve_plan(update_info: dict, cache: dict) -> ParsedPlan | None:
    """The plan of this update: the one it carries (then cached) or a cached one; None if unknown."""
    wire = update_info.get("plan")
    pid = update_info.get("plan_id") or (wire or {}).get("plan_id")
    if wire is not None and pid not in cache:
        cache.clear()  # one live plan per receiver
        cache[pid] = ParsedPlan(wire)
    return cache.get(pid)


class ReceiveSink:
    """What a receiver does with each bucket (vLLM engine: load_weights; receiver: copy)."""

    def buffer(self, index: int, nbytes: int) -> torch.Tensor:
        raise NotImplementedError

    def load(self, index: int, slots: list[TensorSlot], buf: torch.Tensor) -> torch.Tensor | None:
        """Loads one bucket; returns int64 [len(slots), 2] checksums of what it loaded when asked
        (self.verify), or None to have the received bytes checksummed."""
        raise NotImplementedError


def receive_sync(comm: Communicator, update_info: dict, sink: ReceiveSink, plans: dict) -> dict:
    """Receiver side of one sync (see the module doc). Raises WeightSyncError on abort, mismatch
    or a load failure (after draining the sync so that no peer hangs). `plans`: this
    receiver's plan cache."""
    version = update_info["version"]
    verify = bool(update_info.get("verify", False))
    parsed = resolve_plan(update_info, plans)
    error: BaseException | None = None
    if parsed is None:
        error = WeightSyncError(f"unknown plan {update_info.get('plan_id')} (the trainer resends it next sync)")
        plan_id = update_info.get("plan_id", "")
        sizes = list(update_info["sizes"])
        buckets = [[] for _ in sizes]
        T = int(update_info["num_tensors"])
    else:
        plan_id, buckets, sizes, T = parsed.plan_id, parsed.buckets, parsed.sizes, parsed.num_tensors
    n = len(sizes)
    vid, pkey = version_id(version), plan_key(plan_id)
    dev = comm.device
    sink.verify = verify
    sink.plan_id = plan_id
    cs = torch.zeros(T, 2, dtype=torch.int64, device=dev) if verify else None
    bufs: list = [None] * n
    works: list = [None] * n

    def post(k):
        bufs[k] = sink.buffer(k, sizes[k])
        works[k] = comm.broadcast(bufs[k], 0)

    aborted_at = None
    if n:
        post(0)
    for k in range(n):
        if k + 1 < n:
            post(k + 1)
        works[k].wait()
        h = read_header(bufs[k])
        if h[0] != MAGIC or h[1] != PROTO:
            raise WeightSyncError(f"bucket {k}: bad header {h[:2]} (protocol out of step; re-init the group)")
        if h[4] == STATUS_ABORT:
            aborted_at = k
            break
        if h[2] != vid or h[3] != k or h[5] != sizes[k] or h[6] != pkey:
            raise WeightSyncError(f"bucket {k}: header {h} does not match update {version} plan {plan_id} "
                                  f"(protocol out of step; re-init the group)")
        if error is None:
            try:
                got = sink.load(k, buckets[k], bufs[k])
                if verify:
                    first = buckets[k][0].index if buckets[k] else 0
                    if got is None:
                        got = buffer_checksums(bufs[k], [(t.offset, t.nbytes) for t in buckets[k]])
                    cs[first: first + len(buckets[k])] = got
            except BaseException as e:  # keep receiving so that no peer hangs
                logger.exception("loading bucket %d of update %s failed", k, version)
                error = e
        bufs[k] = None
    if aborted_at is not None:
        if aborted_at + 1 < n:
            works[aborted_at + 1].wait()  # the filler
        raise WeightSyncAborted(f"the trainer aborted update {version} at bucket {aborted_at}/{n}")
    trailer = torch.zeros(2 + 2 * T, dtype=torch.int64, device=dev)
    comm.broadcast(trailer, 0).wait()
    tr = trailer.cpu()
    if int(tr[0]) == 0:
        raise WeightSyncAborted(f"the trainer aborted update {version} after its last bucket")
    if int(tr[0]) != END or int(tr[1]) != vid:
        raise WeightSyncError(f"update {version}: bad trailer (protocol out of step)")
    bad: list[str] = []
    if verify and error is None:
        expected = tr[2:].view(T, 2)
        diff = (expected != cs.cpu()).any(1).nonzero().flatten().tolist()
        bad = [parsed.names[i] for i in diff]
    status = torch.zeros(comm.world_size, dtype=torch.int64, device=dev)
    status[comm.rank] = LOAD_FAILED if error is not None else (MISMATCH if bad else OK)
    comm.all_reduce_sum(status).wait()
    if error is not None:
        raise WeightSyncError(f"update {version}: loading failed on receiver rank {comm.rank}: {error!r}") from error
    if bad:
        raise WeightSyncError(f"update {version}: checksum mismatch on receiver rank {comm.rank} for "
                              f"{len(bad)} tensor(s), e.g. {bad[:3]}")
    return {"version": version, "num_tensors": T, "buckets": n, "plan_id": plan_id,
            "checksums": cs if verify else None, "names": parsed.names}


__all__ = ["Communicator", "ReceiveSink", "WeightSyncAborted", "receive_sync", "version_id",
           "write_header", "read_header", "to_dtype", "HEADER_BYTES"]
