"""The RL step's micro-batches: the plan, each micro-batch's model inputs, running them through
megatron's schedules, and per-sample outputs back. Its public interface (train_step.py and the
tests use these names, nothing private):

In:  an `RLBatch` (this DP rank's samples), the config, the model's bridge (MoE layers, top-k,
     experts) and the parallel layout (`Parallelism.current`).
Out: `plan_step` -> `StepPlan` (THD-packed micro-batch layouts from `packing.plan_microbatches`,
     made once per step, and each sample's R3 routes aligned to its tokens when a micro-batch
     first needs them: `AlignedRoutes`);
     `model_inputs` -> one micro-batch's input dict (token ids, positions, labels, packed
     cu_seqlens, routes), built lazily through `LazyMicroBatches` when megatron's schedule asks;
     `rows_of` -> per-sample values laid out as a micro-batch's rows;
     `run_plan` -> what the loss function returned per micro-batch (R3 replay session around it);
     `scatter_per_sample` -> values per prediction position back to token-aligned per-sample
     tensors; `all_reduce` -> a collective that is a no-op without a group.
train_step.py builds the losses and the update on top of these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import forward as fwd
from .batch import RLBatch
from .packing import MicroBatchLayout, plan_microbatches, thd_packed_seq_params
from .r3_replay import R3Replay, align_routes, microbatch_routes

# ---------------------------------------------------------------------------- parallel facts
@dataclass
class Parallelism:
    tp: int = 1
    tp_rank: int = 0
    cp: int = 1
    cp_rank: int = 0
    sp: bool = False
    dp_group: object = None
    cp_group: object = None
    pp_group: object = None
    pp: int = 1
    last_stage: bool = True

    @classmethod
    def current(cls, config) -> "Parallelism":
        from megatron.core import parallel_state as mpu

        return cls(
            tp=mpu.get_tensor_model_parallel_world_size(), tp_rank=mpu.get_tensor_model_parallel_rank(),
            cp=mpu.get_context_parallel_world_size(), cp_rank=mpu.get_context_parallel_rank(),
            sp=bool(config.sequence_parallel), dp_group=mpu.get_data_parallel_group(),
            cp_group=mpu.get_context_parallel_group(), pp_group=mpu.get_pipeline_model_parallel_group(),
            pp=mpu.get_pipeline_model_parallel_world_size(), last_stage=mpu.is_pipeline_last_stage(),
        )


def all_reduce(t: Tensor, group, op=dist.ReduceOp.SUM) -> Tensor:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


# ---------------------------------------------------------------------------- micro-batches
class AlignedRoutes(Sequence):
    """Each sample's R3 routes aligned to its tokens (`align_routes`), aligned when a micro-batch
    first needs them and kept: the host aligns micro-batch i+1's samples while the GPU runs i,
    not all of them before the first forward. A bad route raises R3Error at that point, before
    the optimizer step."""

    def __init__(self, raw: list, lengths: list[int], num_moe_layers: int, topk: int, num_experts: int):
        self._raw, self._lengths, self._shape = raw, lengths, (num_moe_layers, topk, num_experts)
        self._done: dict[int, Optional[Tensor]] = {}

    def __len__(self) -> int:
        return len(self._raw)

    def __getitem__(self, i: int) -> Optional[Tensor]:
        if i not in self._done:
            r = self._raw[i]
            self._done[i] = None if r is None else align_routes(r, self._lengths[i], *self._shape)
        return self._done[i]

    def counts(self) -> tuple[int, int]:
        """(replayed token-layers, token-layers that reach the loss) over every sample: all tokens
        but the last (its output predicts nothing; the engine never routes it either)."""
        replayed = total = 0
        for i, n in enumerate(self._lengths):
            a = self[i]
            total += (n - 1) * self._shape[0]
            replayed += 0 if a is None else int((a[: n - 1] >= 0).all(-1).sum())
        return replayed, total


@dataclass
class StepPlan:
    """Micro-batch layouts and aligned routes of one batch (reused by every pass of a step)."""

    layouts: list[MicroBatchLayout]
    routes: Optional[AlignedRoutes] = None  # aligned [L, moe_layers, topk] per sample, made lazily

    @property
    def r3_counts(self) -> tuple[int, int]:
        return (0, 0) if self.routes is None else self.routes.counts()


def plan_step(batch: RLBatch, cfg, bridge, par: Optional[Parallelism] = None, need_routes: bool = False) -> StepPlan:
    """Micro-batch layouts for the batch (+ its R3 routes, aligned as micro-batches need them)."""
    par = par or Parallelism.current(bridge.config)
    t = cfg.train
    layouts = plan_microbatches(
        batch.lengths, packed=bool(t.packing), max_tokens=t.max_tokens_per_microbatch if t.packing else None,
        micro_batch_size=t.micro_batch_size, tp=par.tp, cp=par.cp, cp_rank=par.cp_rank, dp_group=par.dp_group,
        pad_to=t.pad_packed_to,
    )
    plan = StepPlan(layouts)
    if need_routes:
        if batch.routed_experts is None:
            raise ValueError("R3 is on (algorithm.routing_replay) but the batch has no routed_experts")
        mc = bridge.config
        plan.routes = AlignedRoutes(list(batch.routed_experts), batch.lengths, len(bridge.moe_layers),
                                    mc.moe_router_topk, mc.num_moe_experts)
    return plan


def rows_of(layout: MicroBatchLayout, per_sample: Optional[list[Tensor]], dtype=torch.float32) -> Tensor:
    """Loss rows [n, Lmax-1]: column j of segment k = per_sample[k][j+1] (prediction-aligned)."""
    idx, _ = layout.prediction_index()
    out = torch.zeros(idx.shape, dtype=dtype)
    if per_sample is None:
        return out
    for k, seg in enumerate(layout.segments):
        if seg.sample >= 0 and seg.length > 1:
            x = per_sample[seg.sample]
            x = x.expand(seg.length) if x.numel() == 1 else x
            out[k, : seg.length - 1] = x[1:].to(dtype)
    return out


def model_inputs(layout: MicroBatchLayout, batch: RLBatch, plan: StepPlan, par: Parallelism, bridge,
                  replay: bool) -> dict:
    ids = [batch.input_ids[s] if s >= 0 else None for s in layout.samples]
    mb = {
        "input_ids": layout.to_local(layout.scatter(ids, fill=0, dtype=torch.long)),
        "position_ids": layout.to_local(layout.position_ids()),
        "labels": layout.to_local(layout.next_token_labels(ids)),
        "layout": layout,
    }
    if layout.packed:
        mb["cu_seqlens"] = layout.cu_seqlens(False)
        mb["cu_seqlens_padded"] = layout.cu_seqlens(True)
        mb["packed_total"] = int(mb["cu_seqlens_padded"][-1])
    if replay:
        mc = bridge.config
        segs = [plan.routes[s] if s >= 0 else None for s in layout.samples]
        mb["routes"] = microbatch_routes(
            layout, segs, num_moe_layers=len(bridge.moe_layers), topk=mc.moe_router_topk,
            num_experts=mc.num_moe_experts, tp_size=par.tp, tp_rank=par.tp_rank, sequence_parallel=par.sp,
        )
        mb["routes_complete"] = not bool((mb["routes"] < 0).any())  # on the host, before the move
    return mb


class LazyMicroBatches(Sequence):
    """The micro-batches' input dicts, each built when megatron's schedule first asks for it and
    kept: the host builds micro-batch i+1 while the GPU still runs the kernels queued for i (the
    layers read nothing back to the host), instead of all of them before the first forward."""

    def __init__(self, layouts: list, build):
        self._layouts, self._build, self._made = layouts, build, {}

    def __len__(self) -> int:
        return len(self._layouts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = i + len(self) if i < 0 else i
        if not 0 <= i < len(self):
            raise IndexError(i)
        if i not in self._made:
            self._made[i] = self._build(self._layouts[i])
        return self._made[i]


def _kwargs_fn(replay_handle: Optional[R3Replay]):
    # mb's tensors are on the device here: whatever the host needs from them was read before
    def fn(mb):
        if replay_handle is not None:
            replay_handle.set_microbatch(mb["routes"], complete=mb.get("routes_complete"))
        if "cu_seqlens" not in mb:
            return {}
        return {"packed_seq_params": thd_packed_seq_params(mb["cu_seqlens"], mb["cu_seqlens_padded"],
                                                           mb["layout"].max_seqlen, mb.get("packed_total"))}

    return fn


def run_plan(models, mbs, loss_fn, forward_only, replay_handle, collect=False):
    if replay_handle is None:
        return fwd.run_microbatches(models, mbs, loss_fn, forward_only=forward_only, collect_non_loss_data=collect,
                                    model_kwargs_fn=_kwargs_fn(None))
    with replay_handle.session():
        return fwd.run_microbatches(models, mbs, loss_fn, forward_only=forward_only, collect_non_loss_data=collect,
                                    model_kwargs_fn=_kwargs_fn(replay_handle))


def scatter_per_sample(layout: MicroBatchLayout, local: Tensor, par: Parallelism, n_samples_out: list) -> None:
    """Local prediction-position values [b, s_local] -> token-aligned per-sample tensors
    (index t = value predicting token t; index 0 = 0), written into n_samples_out."""
    full = torch.zeros(layout.num_tokens, dtype=torch.float32, device=local.device)
    full[layout.local_positions().to(local.device)] = local.reshape(-1).float()
    if par.cp > 1:
        all_reduce(full, par.cp_group)
    for seg, x in zip(layout.segments, layout.gather(full.view(layout.rows, layout.width))):
        if seg.sample >= 0:
            n_samples_out[seg.sample] = torch.cat([x.new_zeros(1), x[:-1]]).cpu()
