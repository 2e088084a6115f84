"""Plan building: which HF tensor goes into which bucket, where, and how it is gathered.

In: the Megatron model chunks of this rank (params.py), the bridge (mbridge's name/format
conversion functions) and a bucket size. Out: a BucketPlan (plan.py) that every trainer rank
builds identically: the metadata of all pipeline stages and expert ranks is exchanged once,
as JSON (collectives.all_gather_json). Runs once per model shape; plan_check.py decides when.

The HF names, shapes and byte ranges come from running the bridge's own conversion
(`_weight_merge_across_tp`, `_weight_to_hf_format`) on meta tensors: no data moves while
planning. Bucket kinds and layouts: see plan.py.
"""

from __future__ import annotations

import hashlib
import json

import torch

from .collectives import all_gather_json, expert_group
from .params import local_params, unwrap
from .plan import (BUCKET_ORDERS, DEFAULT_BUCKET_BYTES, EXPERT_PARAM, HEADER_BYTES, LAYER, BucketPlan, BucketSpec,
                   DenseUnit, ExpertGroup, ExpertParam, TensorSlot, align, dtype_name, to_dtype)


def _meta(shape, dtype: str, tp_sharded=False, partition_dim=-1):
    t = torch.empty(tuple(shape), dtype=to_dtype(dtype), device="meta")
    if tp_sharded:
        t.tensor_model_parallel = True
        t.partition_dim = partition_dim
    return t


def _is_view_of(out: torch.Tensor, base: torch.Tensor) -> bool:
    return (out is base or getattr(out, "_base", None) is base) and out.is_contiguous()


def _hf_outputs(impl, global_name: str, full: torch.Tensor):
    """(names, meta tensors, byte offsets inside `full` or None where not a contiguous view)."""
    names, outs = impl._weight_to_hf_format(global_name, full)
    offs = []
    for o in outs:
        offs.append(o.storage_offset() * o.element_size() if _is_view_of(o, full) else None)
    return list(names), list(outs), offs


class _PlanBuilder:
    def __init__(self, impl, par: dict, bucket_bytes: int):
        self.impl = impl
        self.par = par
        self.bucket_bytes = bucket_bytes
        self.buckets: list[BucketSpec] = []
        self.names: set[str] = set()
        self.next_index = 0
        self.cur: BucketSpec | None = None
        self.cur_fill = HEADER_BYTES

    def _new(self, kind, stage) -> BucketSpec:
        b = BucketSpec(index=len(self.buckets), kind=kind, stage=stage, nbytes=0)
        self.buckets.append(b)
        return b

    def _slot(self, b: BucketSpec, name, dtype, shape, offset, nbytes, direct=False) -> int:
        b.tensors.append(TensorSlot(-1, name, dtype, tuple(int(s) for s in shape), offset, nbytes, direct))
        return len(b.tensors) - 1

    def flush_dense(self):
        if self.cur is not None and self.cur.tensors:
            self.cur.nbytes = align(self.cur_fill)
        elif self.cur is not None:
            self.buckets.remove(self.cur)
        self.cur, self.cur_fill = None, HEADER_BYTES

    def add_dense(self, stage, vpp, local_name, global_name, shape, dtype, tp_sharded, partition_dim):
        tp = self.par["tp"]
        shard = _meta(shape, dtype, tp_sharded, partition_dim)
        if tp_sharded and tp > 1:
            full = self.impl._weight_merge_across_tp(global_name, [_meta(shape, dtype) for _ in range(tp)], shard)
        else:
            full = shard
        names, outs, offs = _hf_outputs(self.impl, global_name, full)
        keep = [(i, n, o, off) for i, (n, o, off) in enumerate(zip(names, outs, offs)) if n not in self.names]
        if not keep:
            return
        size = sum(align(o.numel() * o.element_size()) for _, _, o, _ in keep)
        if self.cur is not None and (self.cur.stage != stage or
                                     (self.cur_fill + size > self.bucket_bytes and self.cur.tensors)):
            self.flush_dense()
        if self.cur is None:
            self.cur = self._new("dense", stage)
        unit = DenseUnit(stage, vpp, local_name, global_name, tuple(shape), dtype, bool(tp_sharded and tp > 1),
                         int(partition_dim))
        direct_ok = stage == 0 and not unit.tp_sharded
        for pos, n, o, off in keep:
            nb = o.numel() * o.element_size()
            unit.slots.append((pos, self._slot(self.cur, n, dtype_name(o.dtype), o.shape, self.cur_fill, nb,
                                               direct=direct_ok and off is not None)))
            self.cur_fill += align(nb)
            self.names.add(n)
        self.cur.units.append(unit)

    def add_experts(self, stage, vpp, layer, params: list[ExpertParam]):
        ep, etp = self.par["ep"], self.par["etp"]
        members = self.par["ep_members"]  # (ep_rank, etp_rank) per member of the gather group
        per_rank = self.par["num_experts"] // ep
        local_bytes = sum(p.nbytes for p in params)
        b = self._new("experts", stage)
        group = ExpertGroup(stage, vpp, layer, params, local_bytes, in_place=etp == 1)
        # HF outputs of every expert param, per member (ETP=1) or per global expert (ETP>1)
        if group.in_place:
            per_member = []
            for m, (ep_rank, _) in enumerate(members):
                base = HEADER_BYTES + m * local_bytes
                mine = []
                for p in params:
                    prefix, local_id = EXPERT_PARAM.match(p.global_name).group(1, 3)
                    gname = f"{prefix}{ep_rank * per_rank + int(local_id)}"
                    full = _meta(p.local_shape, p.dtype)
                    names, outs, offs = _hf_outputs(self.impl, gname, full)
                    if any(off is None for off in offs):
                        group.in_place = False
                        break
                    mine.append([(n, o, base + p.offset + off) for n, o, off in zip(names, outs, offs)])
                if not group.in_place:
                    break
                per_member.append(mine)
        if group.in_place:
            slots = []
            for m, mine in enumerate(per_member):
                slots.append([])
                for outs in mine:
                    idx = []
                    for n, o, off in outs:
                        if n in self.names:
                            raise ValueError(f"HF tensor {n} produced twice (expert layout)")
                        self.names.add(n)
                        idx.append(self._slot(b, n, dtype_name(o.dtype), o.shape, off, o.numel() * o.element_size(),
                                              direct=stage == 0 and ep == 1))
                    slots[-1].append(idx)
            group.slots = slots
            b.nbytes = align(HEADER_BYTES + len(members) * local_bytes)
        else:
            # staged: merge ETP shards per global expert, HF order by expert id, aligned slots
            fill = HEADER_BYTES
            by_expert: dict[int, list] = {}
            for ep_rank in range(ep):
                for p in params:
                    prefix, local_id = EXPERT_PARAM.match(p.global_name).group(1, 3)
                    g = ep_rank * per_rank + int(local_id)
                    gname = f"{prefix}{g}"
                    shard = _meta(p.local_shape, p.dtype, True, 0)
                    full = (self.impl._weight_merge_across_tp(gname, [_meta(p.local_shape, p.dtype)] * etp, shard)
                            if etp > 1 else shard)
                    names, outs, _ = _hf_outputs(self.impl, gname, full)
                    by_expert.setdefault(g, []).append((p, names, outs))
            slot_of: dict[tuple[int, str], list[int]] = {}
            for g in sorted(by_expert):
                for p, names, outs in by_expert[g]:
                    idx = []
                    for n, o in zip(names, outs):
                        nb = o.numel() * o.element_size()
                        self.names.add(n)
                        idx.append(self._slot(b, n, dtype_name(o.dtype), o.shape, fill, nb))
                        fill += align(nb)
                    slot_of[(g, p.local_name)] = idx
            group.slots = [[slot_of[(er * per_rank + int(EXPERT_PARAM.match(p.global_name).group(3)), p.local_name)]
                            for p in params] for er, _ in members]
            b.nbytes = align(fill)
        b.experts = group


def build_plan(bridge, models, bucket_bytes: int = DEFAULT_BUCKET_BYTES, first: str = "experts") -> BucketPlan:
    """Collective over all trainer ranks (JSON all_gathers over the world, the expert group and
    the pipeline group). `first`: "experts" or "dense", the kind of bucket sent first in each
    stage (see below)."""
    if first not in BUCKET_ORDERS:
        raise ValueError(f"first must be one of {BUCKET_ORDERS}, got {first!r}")
    from megatron.core import parallel_state as mpu

    impl = bridge.impl if hasattr(bridge, "impl") else bridge
    cfg = impl.config
    par = dict(
        tp=mpu.get_tensor_model_parallel_world_size(), pp=mpu.get_pipeline_model_parallel_world_size(),
        ep=mpu.get_expert_model_parallel_world_size(), etp=mpu.get_expert_tensor_parallel_world_size(),
        num_experts=int(cfg.num_moe_experts or 0),
    )
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    ddp_zero = (mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0
                and mpu.get_context_parallel_rank() == 0)
    edp_zero = (mpu.get_expert_model_parallel_rank() == 0 and mpu.get_expert_tensor_parallel_rank() == 0
                and mpu.get_expert_data_parallel_rank() == 0) if par["num_experts"] else True
    if ddp_zero != edp_zero:
        raise RuntimeError("weight_sync: the dense and the expert leader of a pipeline stage differ; "
                           "unsupported rank order")
    infos = all_gather_json([pp_rank, ddp_zero and edp_zero])
    leaders = [None] * par["pp"]
    for r, (s, lead) in enumerate(infos):
        if lead and leaders[s] is None:
            leaders[s] = r
    if leaders[0] != 0:
        raise RuntimeError(f"weight_sync: global rank 0 must lead pipeline stage 0 (leaders {leaders})")
    # who is in my expert gather group, and in which order
    ep_members = [(0, 0)]
    if par["num_experts"] and (par["ep"] > 1 or par["etp"] > 1):
        ep_members = all_gather_json([mpu.get_expert_model_parallel_rank(), mpu.get_expert_tensor_parallel_rank()],
                                     group=expert_group(par["etp"]))
    par["ep_members"] = [tuple(m) for m in ep_members]

    # local metadata -> every stage's metadata (all ranks of a stage hold the same names/shapes)
    maps = [impl._weight_name_mapping_mcore_local_to_global(m, consider_ep=False) for m in unwrap(models)]
    local = []
    for vpp, name, t in local_params(models):
        local.append((vpp, name, maps[vpp][name], tuple(t.shape), dtype_name(t.dtype),
                      bool(getattr(t, "tensor_model_parallel", False)), int(getattr(t, "partition_dim", -1))))
    stages = [local]
    if par["pp"] > 1:
        stages = [[(vpp, lname, gname, tuple(shape), dt, tp_sharded, pdim)
                   for vpp, lname, gname, shape, dt, tp_sharded, pdim in entries]
                  for entries in all_gather_json(local, group=mpu.get_pipeline_model_parallel_group())]

    orders = _expert_memory_orders(models, maps, pp_rank) if par["num_experts"] else {}

    pb = _PlanBuilder(impl, par, bucket_bytes)
    for stage, entries in enumerate(stages):
        pending: dict[tuple[int, int], list[ExpertParam]] = {}
        order: list[tuple[int, int]] = []
        for vpp, lname, gname, shape, dt, tp_sharded, pdim in entries:
            m = EXPERT_PARAM.match(gname)
            if m and par["num_experts"]:
                layer = int(LAYER.search(gname).group(1))
                key = (vpp, layer)
                if key not in pending:
                    pending[key] = []
                    order.append(key)
                n = 1
                for s in shape:
                    n *= s
                nb = n * to_dtype(dt).itemsize
                lst = pending[key]
                off = (lst[-1].offset + lst[-1].nbytes) if lst else 0
                lst.append(ExpertParam(lname, gname, shape, dt, nb, off))
                continue
            pb.add_dense(stage, vpp, lname, gname, shape, dt, tp_sharded, pdim)
        for vpp, layer in order:
            params = pending[(vpp, layer)]
            mem = orders.get((stage, vpp, layer))
            if mem is not None and sorted(mem) == list(range(len(params))):
                params, off = [params[i] for i in mem], 0
                for p in params:  # the row follows the sender's memory: one copy per row
                    p.offset, off = off, off + p.nbytes
            pb.add_experts(stage, vpp, layer, params)
        pb.flush_dense()
    # number every tensor in bucket order; compact IPC layout. The order per stage, `first`:
    # - "experts" (both transports' choice): an expert bucket costs the sender a few large copies
    #   (or none: IPC zero copy), so the first send / the engine's copies start at once while the
    #   dense buckets' per-parameter conversions run on the CPU;
    # - "dense": no EP gather before the first send, but 2-4 ms of per-tensor packing on the
    #   CPU; measured no better on 2 x H200 (BENCHMARKS.md).
    buckets = sorted(pb.buckets, key=lambda b: (b.stage, (b.kind == "experts") == (first == "dense"), b.index))
    index = 0
    for i, b in enumerate(buckets):
        b.index = i
        ipc = 0
        new = []
        for t in b.tensors:
            if t.direct:
                io = -1
            elif b.kind == "experts" and b.experts.in_place:
                io = t.offset  # the gather writes the whole in-place layout
            else:
                io = ipc
                ipc += align(t.nbytes)
            new.append(TensorSlot(index, t.name, t.dtype, t.shape, t.offset, t.nbytes, t.direct, io))
            index += 1
        b.tensors = new
        if b.kind == "experts" and b.experts.in_place and not all(t.direct for t in b.tensors):
            ipc = b.nbytes
        b.ipc_nbytes = ipc
    plan = BucketPlan(buckets, bucket_bytes, leaders, par["ep_members"], first=first)
    plan.plan_id = hashlib.sha256(json.dumps(plan.wire(), sort_keys=True).encode()).hexdigest()[:16]
    return plan


def _expert_memory_orders(models, maps, pp_rank: int) -> dict:
    """(stage, vpp, layer) -> the order of that layer's local expert tensors by address, agreed by
    every rank (collective: one JSON all_gather over the world).

    A layer's local experts usually sit back to back in the DDP parameter buffer (in reverse
    order of declaration). Packed in address order, an EP rank's row of an expert bucket is one
    contiguous copy of its memory instead of one copy per tensor. Ranks whose layouts differ
    (or any doubt) keep the declaration order for that layer."""
    mine: dict = {}
    for vpp, name, t in local_params(models):
        gname = maps[vpp][name]
        m = EXPERT_PARAM.match(gname)
        if m:
            key = (pp_rank, vpp, int(LAYER.search(gname).group(1)))
            mine.setdefault(key, []).append(t.data_ptr())
    mine = [[list(k), sorted(range(len(v)), key=v.__getitem__)] for k, v in mine.items()]
    agreed: dict = {}
    for d in all_gather_json(mine):  # each rank's [(stage, vpp, layer), order] pairs
        for k, order in d:
            k, order = tuple(k), tuple(order)
            agreed[k] = order if agreed.get(k, order) == order else None
    return {k: v for k, v in agreed.items() if v is not None}

