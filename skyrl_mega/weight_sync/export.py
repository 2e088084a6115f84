"""Export: HF-named tensors out of the Megatron model, one coalesced gather per bucket.

In: model chunks on every trainer rank, a BucketPlan (plan.py), and on global rank 0 a
function that hands out a destination buffer per bucket. Out, on rank 0: for each bucket,
the packed buffer (HF tensors at the plan's byte offsets) plus, in the IPC layout, the
tensors that stay in the sender's own parameters ("direct"). Every rank iterates: the
collectives run inside.

Per bucket, at most three collectives (never one per tensor):
- dense bucket, TP>1: each TP rank concatenates the bytes of its shards of every TP-sharded
  parameter in the bucket into one buffer; the stage leader receives all of them in one
  batched point-to-point round (a gather), then merges (mbridge's _weight_merge_across_tp)
  and converts (_weight_to_hf_format) per parameter into the bucket.
- expert bucket (one MoE layer): each EP rank concatenates its local experts into one buffer;
  the leader receives them straight into the bucket (in-place layout, ETP=1) or into a staging
  buffer that is merged over ETP and copied (staged layout). When every EP rank is on the
  leader's host with CUDA (gather="auto"), the leader instead reads the other ranks' experts
  straight from their memory (peer_gather.py): no collective, and no kernel on their GPUs.
- pipeline stage s>0: its leader sends the finished bucket to global rank 0 (one send).
Only the first data-parallel replica takes part; the gathers move data toward rank 0 only.

Every sync starts with one tiny CPU collective (the plan is missing or invalid anywhere? which
bucket order does rank 0's transport want?). Parameter tensors are looked up by name when a
bucket reads them, never cached, and checked against the plan's shapes and dtypes; all of them
are checked again after the last bucket. A mismatch on any rank aborts the sync before its
commit and sync_weights sends it again on a rebuilt plan.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from .plan import (BUCKET_ORDERS, HEADER_BYTES, BucketPlan, BucketSpec, ParamIndex, TensorSlot, build_plan, to_dtype)

logger = logging.getLogger(__name__)


def _dev_of(models) -> torch.device:
    for m in models:
        for t in m.parameters():
            return t.device
    return torch.device("cpu")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 view (callers run under no_grad)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t.view(-1).view(torch.uint8)


class SlotPool:
    """`n` reusable uint8 buffers; a buffer is handed out again only after the work fenced on it ended.
    `wait(work)`: how to wait for a fenced work (default: work.wait())."""

    def __init__(self, device, n: int = 2, wait=None):
        self.device = torch.device(device)
        self.n = n
        self._wait = wait or (lambda w: w.wait())
        self.bufs: list[torch.Tensor | None] = [None] * n
        self.pending: list[list] = [[] for _ in range(n)]
        self.next = 0
        self.last = -1

    def acquire(self, nbytes: int) -> torch.Tensor:
        i = self.next
        self.next = (i + 1) % self.n
        for w in self.pending[i]:
            self._wait(w)
        self.pending[i] = []
        if self.bufs[i] is None or self.bufs[i].numel() < nbytes:
            self.bufs[i] = None
            self.bufs[i] = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        self.last = i
        return self.bufs[i][:nbytes]

    def fence(self, work) -> None:
        """`work` (has .wait()) uses the buffer handed out last."""
        if work is not None and self.last >= 0:
            self.pending[self.last].append(work)

    def busy(self) -> bool:
        """Is a fenced work still pending (not waited for, not completed)?"""
        return any(not w.is_completed() for ws in self.pending for w in ws)

    def drain(self) -> None:
        for i in range(self.n):
            for w in self.pending[i]:
                self._wait(w)
            self.pending[i] = []

    def release(self) -> None:
        self.drain()
        self.bufs = [None] * self.n


def _p2p(ops):
    if not ops:
        return []
    return dist.batch_isend_irecv(ops)


def _gather_rows(send: torch.Tensor, rows: list[torch.Tensor] | None, root: int, ranks: list[int], group) -> None:
    """Rows of all group members at the root (rows[i] <- member i's `send`), one P2P round."""
    me = dist.get_rank()
    if me == root:
        mine = rows[ranks.index(root)]
        if mine.data_ptr() != send.data_ptr():
            mine.copy_(send)
        reqs = _p2p([dist.P2POp(dist.irecv, rows[i], r, group) for i, r in enumerate(ranks) if r != root])
    else:
        reqs = _p2p([dist.P2POp(dist.isend, send, root, group)])
    for r in reqs:
        r.wait()


class BucketExporter:
    """Iterates the plan's buckets; on rank 0 yields (bucket, packed buffer, direct tensors)."""

    # intra-node gather: the leader packs the other ranks' rows (copy engines) before its own
    # (every SM); see _experts. False only to measure the other order (bench/weight_sync_bench.py)
    peer_rows_first = True

    def __init__(self, bridge, models, bucket_bytes: int, gather: str = "auto"):
        if gather not in ("auto", "nccl", "ipc"):
            raise ValueError(f"gather must be 'auto', 'nccl' or 'ipc', got {gather!r}")
        self.gather = gather  # expert gather: NCCL point-to-point, or intra-node IPC (peer_gather.py)
        self._peer = None  # PeerExpertGather while the IPC gather is in use
        self._peer_ok: bool | None = None  # decided once (collective)
        self.bridge = bridge
        self.impl = bridge.impl if hasattr(bridge, "impl") else bridge
        self.models = models
        self.bucket_bytes = int(bucket_bytes)
        self._plan: BucketPlan | None = None
        self.rebuilds = 0
        self._pool: SlotPool | None = None  # for non-zero stage leaders (their bucket before the send)
        self._direct_cache: dict = {}
        self._runs_cache: dict = {}
        self._view_cache: dict = {}  # (vpp, name) -> ((data_ptr, shape, dtype), HF views); see _views
        self._peer_pos = None  # (plan, bucket -> positions of its experts in the ParamIndex order)
        self._index: ParamIndex | None = None
        self._planned = False  # plan() ran for the next iter_buckets
        self._sig = None  # (index, shapes) the plan was built for
        self._invalid = False  # set by invalidate(): rebuild on the next plan()
        self.stale_seen = False  # the last iter_buckets saw a changed shape/dtype on some rank
        self._flag_group = None
        self.plan_timings: dict[str, float] = {}

    # -- plan -------------------------------------------------------------------------------------
    def plan(self, first: str | None = None) -> BucketPlan:
        """The plan for this sync, every rank agreeing on it (one small CPU collective); rebuilt
        when it is missing, a tensor is gone, the previous sync found a changed shape/dtype
        (`invalidate`), or global rank 0 asks for another bucket order (`first`: the sending
        transport's preference, see build_plan).

        Nothing is looked up or compared here: touching every tensor costs about a microsecond
        each on the critical path (1-2 ms for 2000 tensors on an H200 host right after a
        blocking wait). iter_buckets looks every tensor up by name and checks its shape and
        dtype when the bucket that reads it is packed (`_ByName`), and sweeps all of them after
        the last bucket (also: did a member's experts move since it published them); a mismatch
        anywhere makes the sync abort before its commit and run again on a rebuilt plan
        (sync_weights). Tensors are never cached across syncs."""
        t0 = time.perf_counter()
        self.stale_seen = False
        peer = self._peer
        if peer is not None:
            torch.cuda.current_stream().synchronize()  # the leader may read our experts right away
        stale = self._plan is None or self._index is None or self._sig is None or self._invalid
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        want = BUCKET_ORDERS.index(first) + 1 if rank0 and first is not None else 0
        t1 = time.perf_counter()
        stale, want = self.flag_max(int(stale), want)
        t2 = time.perf_counter()
        order = BUCKET_ORDERS[want - 1] if want else (self._plan.first if self._plan is not None else "experts")
        if stale or self._plan.first != order:
            stale = 1
            self._index = ParamIndex(self.models)  # a full traversal whenever anything changed
            ts = self._index.lookup()
            self._plan = build_plan(self.bridge, self.models, self.bucket_bytes, first=order)
            self._sig = (self._index, ParamIndex.shapes(ts))
            self._invalid = False
            self.rebuilds += 1
            if self._pool is not None:
                self._pool.release()
        if self._peer_ok is None:
            self._peer_ok = self._peer_possible()
        if self._peer_ok and (stale or self._peer is None):
            self._publish_peer()
        self._planned = True
        # where the check's time goes (sync_weights reports it): local part, the flag round
        # (waits for the slowest rank), rebuild/publish
        self.plan_timings = {"plan_local_s": t1 - t0, "plan_flags_s": t2 - t1, "plan_rest_s": time.perf_counter() - t2}
        return self._plan

    def invalidate(self) -> None:
        """Every rank: the next plan() rebuilds the plan (a sync saw a changed shape or dtype)."""
        self._invalid = True

    def _sweep(self, params: "_ByName") -> bool:
        """After the last bucket: is any of this rank's tensors gone, reshaped, retyped, or (a
        member of the intra-node gather) somewhere else than it published? One C-level pass over
        all of them, while the GPU / the engines still work on the buckets."""
        if params.stale:
            return True
        try:
            ts = self._index.lookup()
        except KeyError:
            return True
        if ParamIndex.shapes(ts) != self._sig[1]:
            return True
        peer = self._peer
        return peer is not None and dist.get_rank() != peer.leader and peer.stale(self._peer_tensors(ts))

    # -- intra-node expert gather (peer_gather.py) ----------------------------------------------------
    def _peer_possible(self) -> bool:
        """Collective, once: may the expert gather read other ranks' memory (same host, CUDA)?"""
        plan = self._plan
        experts = [b for b in plan.buckets if b.kind != "dense"]
        if self.gather == "nccl" or len(plan.ep_members) <= 1 or not experts or len(plan.leaders) > 1:
            ok = False
        else:
            from .peer_gather import same_host_cuda

            self.flag_max(0)  # creates the gloo group everywhere
            ok = all(b.experts.in_place for b in experts) and same_host_cuda(self._flag_group)
        if self.gather == "ipc" and not ok:
            raise RuntimeError("gather='ipc' needs one pipeline stage, ETP=1 and every expert rank on this "
                               "host with CUDA")
        return ok

    def _peer_tensors(self, params: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
        """bucket index -> this rank's local experts in packing order ({} outside the gather).
        `params`: this rank's tensors in ParamIndex order (a fresh lookup)."""
        from megatron.core import parallel_state as mpu

        if mpu.get_expert_data_parallel_rank() != 0:
            return {}
        pos = self._peer_pos
        if pos is None or pos[0] is not self._plan or pos[1] is not self._index:  # positions, per plan
            at = self._index.pos
            pos = self._peer_pos = (self._plan, self._index, {
                b.index: [at[(b.experts.vpp, p.local_name)] for p in b.experts.params]
                for b in self._plan.buckets if b.kind != "dense"})
        return {b: [params[i] for i in idx] for b, idx in pos[2].items()}

    def _publish_peer(self) -> None:
        from megatron.core import parallel_state as mpu

        from .peer_gather import PeerExpertGather
        from .plan import _expert_group

        group = _expert_group(dict(etp=mpu.get_expert_tensor_parallel_world_size()))
        peer = PeerExpertGather(self._flag_group, self._plan.leaders[0], dist.get_process_group_ranks(group))
        if peer.publish(self._peer_tensors(self._index.lookup())):
            self._peer = peer
        else:
            self._peer, self._peer_ok = None, False

    def _peer_done(self, stale: bool) -> None:
        """After the last bucket, every rank: the leader's peer reads finished before any member
        moves on, and everyone learns whether some rank saw a changed shape (`stale_seen`)."""
        if self._peer is not None and dist.get_rank() == self._peer.leader:
            torch.cuda.current_stream().synchronize()
        self.stale_seen = bool(self.flag_max(int(stale)))

    def flag_max(self, *values: int):
        """Max of small ints over all trainer ranks (each on its own), on the CPU (gloo). One
        value in: an int back; several: a tuple.

        With NCCL a rank that is done early would otherwise sit in a spinning NCCL kernel for the
        rest of the sync, and on a GPU it shares with a receiver that kernel takes GPU time
        slices from the receiver (measured on H200: the receiver's broadcast at half speed)."""
        out = [int(v) for v in values]
        if dist.is_initialized() and dist.get_world_size() > 1:
            if self._flag_group is None:
                self._flag_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
            t = torch.tensor(out, dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._flag_group)
            out = t.tolist()
        return out[0] if len(out) == 1 else tuple(out)

    # -- iteration --------------------------------------------------------------------------------
    def iter_buckets(self, acquire: Callable[[BucketSpec, int], torch.Tensor | None] | None = None,
                     layout: str = "full", plan: BucketPlan | None = None
                     ) -> Iterator[tuple[BucketSpec, torch.Tensor | None, list[tuple[TensorSlot, torch.Tensor]]]]:
        """Every rank calls. layout "full": every tensor packed at `offset` (broadcast transports);
        "ipc": direct tensors stay in the sender's parameters and come back as
        (parameter, [(TensorSlot, byte offset in the parameter), ...]); the rest is packed at
        `ipc_offset`. `acquire(bucket, nbytes)` gives rank 0 its destination buffer."""
        from megatron.core import parallel_state as mpu

        if layout not in ("full", "ipc"):
            raise ValueError(f"layout must be 'full' or 'ipc', got {layout!r}")
        if plan is None or not self._planned:
            plan = self.plan()
        self._planned = False  # the next iteration checks the plan again
        params = _ByName(self._index, self._sig[1])
        rank = dist.get_rank() if dist.is_initialized() else 0
        dev = _dev_of(self.models)
        ctx = _Ctx(
            rank=rank, stage=mpu.get_pipeline_model_parallel_rank(),
            dense_part=mpu.get_data_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0,
            expert_part=mpu.get_expert_data_parallel_rank() == 0,
            tp_group=mpu.get_tensor_model_parallel_group() if mpu.get_tensor_model_parallel_world_size() > 1 else None,
            pp_group=mpu.get_pipeline_model_parallel_group() if mpu.get_pipeline_model_parallel_world_size() > 1 else None,
        )
        ctx.expert_group = None
        if len(plan.ep_members) > 1:
            from .plan import _expert_group

            ctx.expert_group = _expert_group(dict(etp=mpu.get_expert_tensor_parallel_world_size()))
        if acquire is None:
            pool = SlotPool(dev, n=1)
            acquire = lambda b, n: pool.acquire(n)  # noqa: E731
        if self._pool is None and rank != 0 and rank in plan.leaders:
            self._pool = SlotPool(dev, n=2)
        with torch.no_grad():
            for b in plan.buckets:
                leader = plan.leaders[b.stage]
                nbytes = b.nbytes if layout == "full" else b.ipc_nbytes
                dest, direct = None, []
                if rank == 0:
                    dest = acquire(b, nbytes) if nbytes else None
                elif rank == leader:
                    dest = self._pool.acquire(nbytes) if nbytes else None
                if b.stage == ctx.stage:
                    if b.kind == "dense":
                        self._dense(b, ctx, params, leader, dest, layout, direct)
                    else:
                        self._experts(b, ctx, params, leader, dest, layout, direct)
                if b.stage != 0 and nbytes:
                    if rank == leader:
                        reqs = _p2p([dist.P2POp(dist.isend, dest, 0, ctx.pp_group)])
                        for r in reqs:
                            self._pool.fence(r)
                    elif rank == 0:
                        for r in _p2p([dist.P2POp(dist.irecv, dest, leader, ctx.pp_group)]):
                            r.wait()
                yield b, (dest if rank == 0 else None), direct
        self._peer_done(self._sweep(params))

    @staticmethod
    def _place(t: TensorSlot, src: torch.Tensor, dest, layout, direct, param=None) -> None:
        if layout == "ipc" and t.direct:
            intra = (src.storage_offset() - param.storage_offset()) * src.element_size()
            direct.append((param, [(t, intra)]))
            return
        off = t.offset if layout == "full" else t.ipc_offset
        t.view(dest, off).copy_(src)

    def _dense(self, b: BucketSpec, ctx, params, leader, dest, layout, direct) -> None:
        if not ctx.dense_part:
            return
        sharded = [u for u in b.units if u.tp_sharded]
        staging, ranks, offs = None, None, {}
        if sharded:
            ranks = dist.get_process_group_ranks(ctx.tp_group)
            parts, total = [], 0
            for u in sharded:
                p = _bytes(params[(u.vpp, u.local_name)])
                offs[u.local_name] = (total, p.numel())
                parts.append(p)
                total += (p.numel() + 15) // 16 * 16  # keep every shard's dtype view aligned
            send = torch.empty(total, dtype=torch.uint8, device=parts[0].device)
            for u, p in zip(sharded, parts):
                o, n = offs[u.local_name]
                send[o : o + n].copy_(p)
            rows = None
            if ctx.rank == leader:
                staging = torch.empty(len(ranks), total, dtype=torch.uint8, device=send.device)
                rows = list(staging.unbind(0))
            _gather_rows(send, rows, leader, ranks, ctx.tp_group)
        if ctx.rank != leader:
            return
        for u in b.units:
            p = params[(u.vpp, u.local_name)]
            if u.tp_sharded:
                o, n = offs[u.local_name]
                shards = [staging[i, o : o + n].view(p.dtype).view(p.shape) for i in range(len(ranks))]
                outs = self.impl._weight_to_hf_format(u.global_name,
                                                      self.impl._weight_merge_across_tp(u.global_name, shards, p))[1]
            else:
                outs = self._views(u, p)
            for pos, si in u.slots:
                self._place(b.tensors[si], outs[pos], dest, layout, direct, p)

    def _experts(self, b: BucketSpec, ctx, params, leader, dest, layout, direct) -> None:
        if not ctx.expert_part:
            return
        g = b.experts
        members = len(b.experts.slots)
        ranks = dist.get_process_group_ranks(ctx.expert_group) if members > 1 else [leader]
        if members == 1 and layout == "ipc" and all(t.direct for t in b.tensors):
            # unchecked here (the engine reads them; nothing is copied on this side): the sweep
            # after the last bucket checks them while the engine copies
            local = [params.raw((g.vpp, p.local_name)) for p in g.params]
            # no gather, nothing packed: the sender's own experts are the HF tensors, at byte
            # offsets the plan already knows (no per-tensor conversion call)
            cache = self._direct_cache.get(b.index)
            if cache is None or cache[0] is not self._plan:
                cache = self._direct_cache[b.index] = (self._plan, [
                    [(b.tensors[si], b.tensors[si].offset - HEADER_BYTES - p.offset) for si in idx]
                    for p, idx in zip(g.params, g.slots[0])])
            direct.extend(zip(local, cache[1]))
            return
        local = [params[(g.vpp, p.local_name)] for p in g.params]
        if g.in_place and self._peer is not None:
            if ctx.rank == leader:  # members launch nothing: the leader reads their memory
                rows = [dest[HEADER_BYTES + m * g.local_bytes: HEADER_BYTES + (m + 1) * g.local_bytes]
                        for m in range(members)]
                mine = rows[ranks.index(leader)]
                # peer reads first: they run on copy engines, so when this bucket's buffer is
                # released by the end of a broadcast, the next broadcast kernel (already queued)
                # gets the SMs at once. The own row is a same-GPU copy that takes every SM: run
                # first, it held that broadcast back by its whole run, ~190 us per bucket on
                # H200 (BENCHMARKS.md, run J). Same for a concatenation kernel (run D).
                if self.peer_rows_first:
                    self._peer.copy_rows(b.index, rows)
                for src, pos, n in self._row_runs(b.index, local):
                    mine[pos: pos + n].copy_(src)
                if not self.peer_rows_first:
                    self._peer.copy_rows(b.index, rows)
            return
        if g.in_place:
            runs = self._row_runs(b.index, local)
            rows = None
            if ctx.rank == leader:
                rows = [dest[HEADER_BYTES + m * g.local_bytes: HEADER_BYTES + (m + 1) * g.local_bytes]
                        for m in range(members)]
                send = rows[ranks.index(leader)]
                for src, pos, n in runs:
                    send[pos: pos + n].copy_(src)
            elif len(runs) == 1:
                send = runs[0][0]  # the row is this rank's memory as it is: sent without a copy
            else:
                send = torch.cat([src for src, _, _ in runs])
            if members > 1:
                _gather_rows(send, rows, leader, ranks, ctx.expert_group)
            return
        # staged (ETP>1 or a conversion that is not a contiguous view)
        send = torch.cat([_bytes(t) for t in local])
        staging = None
        rows = None
        if ctx.rank == leader:
            staging = torch.empty(members, g.local_bytes, dtype=torch.uint8, device=send.device)
            rows = list(staging.unbind(0))
        if members > 1:
            _gather_rows(send, rows, leader, ranks, ctx.expert_group)
        else:
            rows[0].copy_(send)
        if ctx.rank != leader:
            return
        ep_members = self._plan.ep_members if self._plan else [(0, 0)]
        by_ep: dict[int, list[int]] = {}
        for m, (ep_rank, etp_rank) in enumerate(ep_members):
            by_ep.setdefault(ep_rank, []).append((etp_rank, m))
        for ep_rank, mem in sorted(by_ep.items()):
            mem = [m for _, m in sorted(mem)]
            for pi, (p, t) in enumerate(zip(g.params, local)):
                shards = [staging[m, p.offset: p.offset + p.nbytes].view(t.dtype).view(t.shape) for m in mem]
                name = self._global(p, ep_rank, b)
                full = self.impl._weight_merge_across_tp(name, shards, t) if len(shards) > 1 else shards[0]
                _, outs = self.impl._weight_to_hf_format(name, full)
                for si, o in zip(g.slots[mem[0]][pi], outs):
                    self._place(b.tensors[si], o, dest, layout, direct)

    def _views(self, u, p: torch.Tensor) -> list[torch.Tensor]:
        """The HF tensors of an unsharded parameter. When every one is a view of the parameter's
        own memory (most conversions: identity, q/k/v split), the views are kept and reused
        while the parameter stays where it is: no mbridge call on the next syncs. Anything
        computed (not a view) is recomputed every sync."""
        key = (u.vpp, u.local_name)
        c = self._view_cache.get(key)
        if c is not None and c[0] == (p.data_ptr(), p.shape, p.dtype):
            return c[1]
        outs = self.impl._weight_to_hf_format(u.global_name, p.detach())[1]
        st = p.untyped_storage().data_ptr()
        if all(o.untyped_storage().data_ptr() == st for o in outs):
            self._view_cache[key] = ((p.data_ptr(), p.shape, p.dtype), outs)
        return outs

    def _row_runs(self, key, local: list[torch.Tensor]) -> list[tuple[torch.Tensor, int, int]]:
        """One layer's local experts as copy runs (ipc_handles.byte_runs): the plan packs them in
        address order, so a row is usually one copy. Rebuilt only when a tensor moved."""
        from .ipc_handles import byte_runs, storage_bytes

        ptrs = tuple(t.data_ptr() for t in local)
        c = self._runs_cache.get(key)
        if c is None or c[0] != ptrs:
            pieces = ((*storage_bytes(t), t.numel() * t.element_size()) for t in local)
            c = self._runs_cache[key] = (ptrs, byte_runs(pieces))
        return c[1]

    def _global(self, p, ep_rank: int, b: BucketSpec) -> str:
        from .plan import _EXPERT

        prefix, local_id = _EXPERT.match(p.global_name).group(1, 3)
        per_rank = int(self.impl.config.num_moe_experts) // max(1, len({e for e, _ in self._plan.ep_members}))
        return f"{prefix}{ep_rank * per_rank + int(local_id)}"


class _ByName:
    """params[(vpp, name)] -> the tensor, looked up by name from its owner now, and checked
    against the plan's shape and dtype.

    A tensor that is gone or does not match sets `stale`, and zeros of the planned shape are
    handed out instead, so every collective of the sync still matches across ranks; the sync
    then aborts before its commit (sync_weights) and runs again on a rebuilt plan."""

    __slots__ = ("index", "expect", "stale")

    def __init__(self, index: ParamIndex, expect: list):
        self.index, self.expect, self.stale = index, expect, False

    def _zeros(self, i: int, like) -> torch.Tensor:
        self.stale = True
        shape, dtype = self.expect[i]
        return torch.zeros(shape, dtype=dtype, device=like.device if like is not None else None)

    def __getitem__(self, key):
        i = self.index.pos[key]
        t = self.index.get(i)
        if t is None:
            return self._zeros(i, None)
        shape, dtype = self.expect[i]
        if t.shape != shape or t.dtype != dtype:
            return self._zeros(i, t)
        return t

    def raw(self, key):
        """Looked up, not checked (the sweep after the last bucket checks it)."""
        i = self.index.pos[key]
        t = self.index.get(i)
        return t if t is not None else self._zeros(i, None)


class _Ctx:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def direct_view(param: torch.Tensor, t: TensorSlot, intra: int) -> torch.Tensor:
    return _bytes(param)[intra: intra + t.nbytes].view(to_dtype(t.dtype)).view(t.shape)


def bucket_tensors(b: BucketSpec, buf: torch.Tensor | None, direct, layout: str = "full"):
    """(name, tensor) of one exported bucket: views into `buf` plus the direct tensors."""
    out = [(t.name, direct_view(p, t, intra)) for p, slots in direct for t, intra in slots]
    if buf is not None:
        for t in b.tensors:
            if layout == "ipc" and t.direct:
                continue
            out.append((t.name, t.view(buf, t.offset if layout == "full" else t.ipc_offset)))
    return out


_EXPORTERS: dict = {}


def get_exporter(bridge, models, bucket_bytes: int, gather: str = "auto") -> BucketExporter:
    """The cached exporter of (bridge, models, bucket size, gather); its plan is re-verified every sync."""
    key = (id(bridge), tuple(id(m) for m in models), int(bucket_bytes), gather)
    ex = _EXPORTERS.get(key)
    if ex is None:
        ex = _EXPORTERS[key] = BucketExporter(bridge, models, bucket_bytes, gather)
    return ex


def export_hf_state_dict(bridge, models, bucket_bytes: int = 1 << 30, device="cpu",
                         gather: str = "auto") -> dict[str, torch.Tensor]:
    """The whole HF state dict on rank 0 (copies on `device`); {} on other ranks. Collective."""
    ex = get_exporter(bridge, models, bucket_bytes, gather)
    out = {}
    for b, buf, direct in ex.iter_buckets():
        if buf is not None or direct:
            for name, t in bucket_tensors(b, buf, direct):
                out[name] = t.to(device, copy=True)
    return out


__all__ = ["BucketExporter", "SlotPool", "bucket_tensors", "export_hf_state_dict", "get_exporter", "to_dtype"]
