"""Bucket filling: HF-named tensors out of the Megatron model, one coalesced gather per bucket.

In: model chunks on every trainer rank, the sync's plan (plan_check.py: a BucketPlan plus the
CheckedParams its tensors are read through), and on global rank 0 a function that hands out a
destination buffer per bucket (the transport's `acquire`). Out, on rank 0: for each bucket,
the packed buffer (HF tensors at the plan's byte offsets) plus, in the IPC layout, the tensors
that stay in the sender's own parameters ("direct"). Every rank iterates: the collectives run
inside (collectives.py).

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
- pipeline stage s>0: its leader sends the finished bucket to global rank 0 (one send, from a
  two-slot pool: slot_pool.py).
Only the first data-parallel replica takes part; the gathers move data toward rank 0 only.
Every rank sweeps its tensors (CheckedParams.sweep) once per sync, after the leading expert
buckets (their round is then on its way) or after the last bucket, and all agree in one
flag round whether some rank saw a changed shape or dtype (`stale_seen`).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from .collectives import FlagRound, expert_group, gather_rows, p2p
from .ipc_handles import byte_runs, storage_bytes
from .params import chunked_map
from .peer_gather import PeerExperts
from .plan import (HEADER_BYTES, BucketPlan, BucketSpec, DirectRefs, TensorSlot, bucket_tensors, flat_bytes,
                   global_expert_name)
from .plan_check import PlanCheck
from .slot_pool import SlotPool

logger = logging.getLogger(__name__)


def _dev_of(models) -> torch.device:
    for m in models:
        for t in m.parameters():
            return t.device
    return torch.device("cpu")


class _Ctx:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class BucketExporter:
    """Iterates the plan's buckets; on rank 0 yields (bucket, packed buffer, direct tensors)."""

    # intra-node gather: the leader packs the other ranks' rows (copy engines) before its own
    # (every SM); see _experts. False only to measure the other order (bench/weight_sync_bench.py)
    peer_rows_first = True

    def __init__(self, bridge, models, bucket_bytes: int, gather: str = "auto"):
        if gather not in ("auto", "nccl", "ipc"):
            raise ValueError(f"gather must be 'auto', 'nccl' or 'ipc', got {gather!r}")
        self.bridge = bridge
        self.impl = bridge.impl if hasattr(bridge, "impl") else bridge
        self.models = models
        self.bucket_bytes = int(bucket_bytes)
        self.flags = FlagRound()  # the CPU flag rounds of every sync (gloo)
        self.check = PlanCheck(bridge, models, bucket_bytes, self.flags)
        # expert gather: NCCL point-to-point, or intra-node IPC reads (peer_gather.py)
        self.peers = PeerExperts(gather, self.flags)
        self._pool: SlotPool | None = None  # for non-zero stage leaders (their bucket before the send)
        self._direct_cache: dict = {}  # bucket index -> (plan, DirectRefs, positions, addresses)
        self._direct_keys = 0  # DirectRefs keys handed out (each cached list gets a new one)
        self._runs_cache: dict = {}
        self._view_cache: dict = {}  # (vpp, name) -> ((data_ptr, shape, dtype), HF views); see _views
        self._planned = False  # plan() ran for the next iter_buckets
        self.stale_seen = False  # the last iter_buckets saw a changed shape/dtype on some rank
        self.plan_timings: dict[str, float] = {}

    @property
    def rebuilds(self) -> int:
        return self.check.rebuilds

    # -- the sync's plan ---------------------------------------------------------------------------
    def plan(self, first: str | None = None) -> BucketPlan:
        """The plan for this sync, every rank agreeing on it (plan_check.PlanCheck.plan: one small
        CPU collective); then, on a new plan, the intra-node gather's handles are published.
        iter_buckets reads every tensor by name through CheckedParams and sweeps them all after
        the last bucket (also: did a member's experts move since it published them)."""
        t0 = time.perf_counter()
        self.stale_seen = False
        self.peers.before_sync()
        plan, rebuilt = self.check.plan(first)
        t1, t2 = self.check.flag_round_at
        if rebuilt and self._pool is not None:
            self._pool.release()
        self.peers.prepare(plan, self.check.index, rebuilt)
        self._planned = True
        # where the check's time goes (sync_weights reports it): local part, the flag round
        # (waits for the slowest rank), rebuild/publish
        self.plan_timings = {"plan_local_s": t1 - t0, "plan_flags_s": t2 - t1, "plan_rest_s": time.perf_counter() - t2}
        return plan

    def invalidate(self) -> None:
        """Every rank: the next plan() rebuilds the plan (a sync saw a changed shape or dtype)."""
        self.check.invalidate()

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
        params = self.check.params()
        rank = dist.get_rank() if dist.is_initialized() else 0
        dev = _dev_of(self.models)
        ctx = _Ctx(
            rank=rank, stage=mpu.get_pipeline_model_parallel_rank(), plan=plan,
            dense_part=mpu.get_data_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0,
            expert_part=mpu.get_expert_data_parallel_rank() == 0,
            tp_group=mpu.get_tensor_model_parallel_group() if mpu.get_tensor_model_parallel_world_size() > 1 else None,
            pp_group=mpu.get_pipeline_model_parallel_group() if mpu.get_pipeline_model_parallel_world_size() > 1 else None,
        )
        ctx.expert_group = None
        if len(plan.ep_members) > 1:
            ctx.expert_group = expert_group(mpu.get_expert_tensor_parallel_world_size())
        if acquire is None:
            pool = SlotPool(dev, n=1)
            acquire = lambda b, n: pool.acquire(n)  # noqa: E731
        if self._pool is None and rank != 0 and rank in plan.leaders:
            self._pool = SlotPool(dev, n=2)
        sweep_at, stale = self._sweep_position(plan), False
        with torch.no_grad():
            if not plan.buckets:
                stale = self._sweep(plan, params)
            for pos, b in enumerate(plan.buckets):
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
                        direct = self._experts(b, ctx, params, leader, dest, layout, direct)
                if b.stage != 0 and nbytes:
                    if rank == leader:
                        reqs = p2p([dist.P2POp(dist.isend, dest, 0, ctx.pp_group)])
                        for r in reqs:
                            self._pool.fence(r)
                    elif rank == 0:
                        for r in p2p([dist.P2POp(dist.irecv, dest, leader, ctx.pp_group)]):
                            r.wait()
                yield b, (dest if rank == 0 else None), direct
                if pos == sweep_at:
                    stale = self._sweep(plan, params)
        # after the last bucket: every rank learns whether any saw a change (a dense tensor read
        # after the sweep is checked as it is read: params.stale)
        self.peers.done()
        self.stale_seen = bool(self.flags.max(int(stale or params.stale)))

    @staticmethod
    def _sweep_position(plan: BucketPlan) -> int:
        """After which bucket this rank sweeps its tensors: the last of the expert buckets when
        they lead the plan (their round is on its way to the engines then, and the sweep runs
        while the engines copy it; the dense buckets after them read each tensor checked),
        else the last bucket."""
        lead = 0
        while lead < len(plan.buckets) and plan.buckets[lead].kind != "dense":
            lead += 1
        return lead - 1 if 0 < lead < len(plan.buckets) else len(plan.buckets) - 1

    def _sweep(self, plan: BucketPlan, params) -> bool:
        """This rank's check of every tensor against the plan: gone, reshaped, retyped, or (the
        cached direct ones, and a member's published experts) moved."""
        stale, ts = params.sweep()
        return stale or self._direct_moved(plan, ts) or self.peers.moved(plan, self.check.index, ts)

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
                p = flat_bytes(params[(u.vpp, u.local_name)])
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
            gather_rows(send, rows, leader, ranks, ctx.tp_group)
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

    def _experts(self, b: BucketSpec, ctx, params, leader, dest, layout, direct) -> list:
        """Fills (or gathers toward the leader) one expert bucket; returns its direct tensors."""
        if not ctx.expert_part:
            return direct
        g = b.experts
        members = len(b.experts.slots)
        ranks = dist.get_process_group_ranks(ctx.expert_group) if members > 1 else [leader]
        if members == 1 and layout == "ipc" and all(t.direct for t in b.tensors):
            return self._direct_experts(b, ctx.plan, params)
        local = [params[(g.vpp, p.local_name)] for p in g.params]
        peer = self.peers.active
        if g.in_place and peer is not None:
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
                    peer.copy_rows(b.index, rows)
                for src, pos, n in self._row_runs(b.index, local):
                    mine[pos: pos + n].copy_(src)
                if not self.peer_rows_first:
                    peer.copy_rows(b.index, rows)
            return direct
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
                gather_rows(send, rows, leader, ranks, ctx.expert_group)
            return direct
        # staged (ETP>1 or a conversion that is not a contiguous view)
        send = torch.cat([flat_bytes(t) for t in local])
        staging = None
        rows = None
        if ctx.rank == leader:
            staging = torch.empty(members, g.local_bytes, dtype=torch.uint8, device=send.device)
            rows = list(staging.unbind(0))
        if members > 1:
            gather_rows(send, rows, leader, ranks, ctx.expert_group)
        else:
            rows[0].copy_(send)
        if ctx.rank != leader:
            return direct
        ep_members = ctx.plan.ep_members
        per_rank = int(self.impl.config.num_moe_experts) // max(1, len({e for e, _ in ep_members}))
        by_ep: dict[int, list[int]] = {}
        for m, (ep_rank, etp_rank) in enumerate(ep_members):
            by_ep.setdefault(ep_rank, []).append((etp_rank, m))
        for ep_rank, mem in sorted(by_ep.items()):
            mem = [m for _, m in sorted(mem)]
            for pi, (p, t) in enumerate(zip(g.params, local)):
                shards = [staging[m, p.offset: p.offset + p.nbytes].view(t.dtype).view(t.shape) for m in mem]
                name = global_expert_name(p.global_name, ep_rank, per_rank)
                full = self.impl._weight_merge_across_tp(name, shards, t) if len(shards) > 1 else shards[0]
                _, outs = self.impl._weight_to_hf_format(name, full)
                for si, o in zip(g.slots[mem[0]][pi], outs):
                    self._place(b.tensors[si], o, dest, layout, direct)
        return direct

    def _direct_experts(self, b: BucketSpec, plan: BucketPlan, params) -> DirectRefs:
        """A layer's experts that stay in this rank's parameters (no gather, nothing packed: the
        sender's own experts are the HF tensors, at byte offsets the plan already knows). Looked
        up on the plan's first sync; later syncs hand out the same cached DirectRefs without
        touching the tensors (a microsecond each, thousands per model, before the first round
        can leave): the sync's sweep checks that they still sit where they sat
        (`_direct_moved`), while the engine copies."""
        cache = self._direct_cache.get(b.index)
        if cache is None or cache[0] is not plan:
            g = b.experts
            keys = [(g.vpp, p.local_name) for p in g.params]
            pos, local = params.positions(keys), [params.raw(k) for k in keys]
            refs = DirectRefs(zip(local, [
                [(b.tensors[si], b.tensors[si].offset - HEADER_BYTES - p.offset) for si in idx]
                for p, idx in zip(g.params, g.slots[0])]))
            self._direct_keys += 1
            refs.key = ("experts", b.index, self._direct_keys)
            cache = self._direct_cache[b.index] = (plan, refs, pos, [t.data_ptr() for t in local])
        return cache[1]

    def _direct_moved(self, plan: BucketPlan, ts: list[torch.Tensor] | None) -> bool:
        """After the last bucket: did a tensor handed out from the direct cache move (replaced,
        `p.data = ...`)? Compared against the sweep's fresh lookup in C-level passes."""
        if ts is None:
            return False
        for cplan, _, pos, ptrs in self._direct_cache.values():
            if cplan is plan and chunked_map(torch.Tensor.data_ptr, chunked_map(ts.__getitem__, pos)) != ptrs:
                return True
        return False

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
        ptrs = tuple(t.data_ptr() for t in local)
        c = self._runs_cache.get(key)
        if c is None or c[0] != ptrs:
            pieces = ((*storage_bytes(t), t.numel() * t.element_size()) for t in local)
            c = self._runs_cache[key] = (ptrs, byte_runs(pieces))
        return c[1]


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


__all__ = ["BucketExporter", "export_hf_state_dict", "get_exporter"]
