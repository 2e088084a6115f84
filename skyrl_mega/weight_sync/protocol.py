"""The packed-bucket wire protocol, shared by the trainer, vLLM engines and standalone receivers.

Control plane (vLLM's native weight-transfer calls; HTTP endpoints of a vLLM server, or the
TCPStore channel of a standalone receiver):
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
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..rollout.errors import WeightSyncError
from .checksum import buffer_checksums, checksum_rows
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


# -- unpacking -------------------------------------------------------------------------------------
class CopyPlan:
    """Byte-range copies from received buffers into destination tensors, merged where both the
    source and the destination ranges are back to back (one layer's experts -> a few copies).
    The source/destination views are built once per set of source buffers and reused, so a
    sync costs a few launches per bucket, not Python work per tensor."""

    def __init__(self):
        self.runs: list[list] = []  # [src_key, src_off, dst_flat, dst_start, numel, dtype, [(slot, nbytes)..]]
        self._bound: tuple | None = None
        self._graph = None

    def add(self, src_key, src_off: int, dtype: torch.dtype, dst_flat: torch.Tensor, dst_start: int, numel: int,
            slot: int) -> None:
        nbytes = numel * dtype.itemsize
        if self.runs:
            r = self.runs[-1]
            if (r[0] == src_key and r[1] + r[4] * r[5].itemsize == src_off and r[2] is dst_flat
                    and r[3] + r[4] == dst_start and r[5] == dtype):
                r[4] += numel
                r[6].append((slot, nbytes))
                return
        self.runs.append([src_key, src_off, dst_flat, dst_start, numel, dtype, [(slot, nbytes)]])

    # runs at least this long are copied one copy_ (a memcpy) each; shorter ones together in one
    # _foreach_copy_ (one launch for many small tensors). Chosen by bench/weight_sync_bench.py.
    loop_min_bytes = 1 << 20
    # on CUDA, record the copies once per set of source buffers as a CUDA graph and replay it:
    # one launch instead of one per run. Off by default: with strided chains there are few
    # launches left, and on 2 x H200 the same copies without a graph were faster in each of five
    # runs (co-located sync, best of 3: 951-1196 vs 893-1123 GB/s), while the capture adds
    # 10-15 ms to the first sync of every plan (BENCHMARKS.md)
    use_graphs = False
    # runs of equal length whose destinations are back to back and whose sources sit at a constant
    # stride (either sign: one layer's experts in a DDP buffer, or in a packed bucket) become one
    # index_select into the destination block: a layer's gate_up / down experts in one kernel
    strided = True
    min_chain = 4

    def _chains(self) -> tuple[list[tuple[list[list], int]], list[list]]:
        """([(runs of one strided chain, source stride in bytes)], the other runs)."""
        groups: dict = {}
        for r in self.runs:
            groups.setdefault((r[0], id(r[2]), r[4], r[5]), []).append(r)
        chains, rest = [], []
        for rs in groups.values():
            rs = sorted(rs, key=lambda r: r[3])
            i = 0
            while i < len(rs):
                j = i + 1
                stride = rs[j][1] - rs[i][1] if j < len(rs) else 0
                nbytes = rs[i][4] * rs[i][5].itemsize
                while (j < len(rs) and rs[j][3] == rs[j - 1][3] + rs[j - 1][4] and rs[j][1] - rs[j - 1][1] == stride
                       and abs(stride) >= nbytes):
                    j += 1
                if j - i >= self.min_chain:
                    chains.append((rs[i:j], stride))
                else:
                    rest.extend(rs[i:j])
                i = j
        return chains, rest

    @staticmethod
    def _strided_views(chain: list[list], stride: int, sources) -> tuple | None:
        """(dst [k, n], src [k, n] strided view, row index) in the widest element type that
        divides every offset and length; None if no such view exists."""
        first = chain[0]
        k, n, dt, dst = len(chain), first[4], first[5], first[2]
        nbytes = n * dt.itemsize
        lo = min(r[1] for r in chain)
        src = sources[first[0]]
        dst_block = dst[first[3]: first[3] + k * n]
        for w, edt in ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8)):
            if (nbytes % w or stride % w or (src.storage_offset() + lo) % w
                    or (dst_block.storage_offset() * dst.element_size()) % w):
                continue
            s = src.view(torch.uint8)[lo: lo + (k - 1) * abs(stride) + nbytes].view(edt)
            s2 = s.as_strided((k, nbytes // w), (abs(stride) // w, 1), s.storage_offset())
            d2 = dst_block.view(torch.uint8).view(edt).view(k, nbytes // w)
            rows = torch.arange(k, device=dst.device)
            return d2, s2, rows if stride > 0 else rows.flip(0)
        return None

    def bind(self, sources: dict[Any, torch.Tensor]) -> tuple:
        key = (tuple((k, v.data_ptr(), v.numel()) for k, v in sources.items()), self.loop_min_bytes, self.strided)
        if self._bound is not None and self._bound[0] == key:
            return self._bound[1]
        chains, rest = self._chains() if self.strided else ([], self.runs)
        strided = []
        for chain, stride in chains:
            v = self._strided_views(chain, stride, sources)
            if v is None:
                rest = rest + chain
            else:
                strided.append(v)
        big, dsts, srcs = [], [], []
        for k, off, dst, start, n, dt, _ in rest:
            src, d = sources[k][off: off + n * dt.itemsize].view(dt), dst[start: start + n]
            if n * dt.itemsize >= self.loop_min_bytes:
                big.append((d, src))
            else:
                dsts.append(d)
                srcs.append(src)
        self._bound = (key, (strided, big, dsts, srcs))
        self._graph = None
        return self._bound[1]

    @staticmethod
    def _launch(strided, big, dsts, srcs) -> None:
        for d2, s2, rows in strided:
            torch.index_select(s2, 0, rows, out=d2)
        for d, src in big:
            d.copy_(src)
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def execute(self, sources: dict[Any, torch.Tensor]) -> None:
        bound = self.bind(sources)
        if not (self.use_graphs and self.runs and self.runs[0][2].is_cuda):
            return self._launch(*bound)
        g = self._graph
        if g is None:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._launch(*bound)  # warm-up (the real copy: replaying it below is harmless)
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    self._launch(*bound)
            except Exception as e:  # a graph is an optimisation: copy directly instead
                logger.warning("CUDA graph capture of the weight copies failed (%s); copying directly", e)
                self._graph = False
                return self._launch(*bound)
            self._graph = g
        if g is False:
            return self._launch(*bound)
        g.replay()

    def checksums(self, out: torch.Tensor, row_of: Callable[[int], int]) -> None:
        """Checksums of what landed in the destinations (read back), into out[row]."""
        for key, off, dst, start, n, dt, slots in self.runs:
            region = dst[start: start + n]
            if region.dtype != dt:
                raise WeightSyncError("read-back checksums need the wire dtype at the destination")
            b = region.view(torch.uint8)
            sizes = {s for _, s in slots}
            if len(sizes) == 1:
                size = sizes.pop()
                cs = checksum_rows(b.view(len(slots), size))
                for i, (slot, _) in enumerate(slots):
                    out[row_of(slot)] = cs[i]
            else:
                pos = 0
                for slot, size in slots:
                    out[row_of(slot)] = checksum_rows(b[pos: pos + size][None])[0]
                    pos += size


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


__all__ = ["Communicator", "CopyPlan", "ReceiveSink", "WeightSyncAborted", "receive_sync", "version_id",
           "write_header", "read_header", "to_dtype", "HEADER_BYTES"]
