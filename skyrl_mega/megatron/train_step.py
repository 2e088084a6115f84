"""The RL train step on Megatron ranks: old/ref logprobs, policy loss, optimizer update.

In:  `RLBatch`, this data-parallel rank's samples (every rank of one model-parallel group gets
     the same samples; `packing.shard_for_dp` splits a global batch), each a 1-D tensor per
     sample, aligned with its prompt+response tokens:
       input_ids [L] long, response_mask [L] (1 = a response token in the loss; index 0 never
       is: nothing predicts the first token), advantages [L] float (or one scalar per sample),
       rollout_logprobs [L] (engine logprob of token t at index t; needed unless
       algorithm.old_logprobs=recompute), optional ref_logprobs [L], optional routed_experts
       [L or L-1, moe_layers, topk] int (-1 = missing; see r3_replay.py).
Out: `train_step` -> metrics dict (same on every rank): loss, pg_loss, pg_clipfrac, kl,
     entropy, grad_norm, lr, logprob_diff_mean / logprob_diff_max (|train - rollout| over
     response tokens), tokens, r3/coverage, skipped (1 when a non-finite loss or gradient made
     the step skip the update; the gradients are zeroed and the LR schedule does not move).
     `train_on_batch` -> the same over several updates of one rollout batch (train.mini_batches
     x train.epochs; old and reference logprobs once for the batch, before any update):
     `prepare` (plan, old / ref logprobs) once per mini-batch, then `update` per update.

Per step: the micro-batch plan (step_inputs.plan_step over `packing.plan_microbatches`: THD
packing, token budget, balanced, equal micro-batch count on every DP rank) is made once and
reused by every pass;
old logprobs (forward only, algorithm.old_logprobs=recompute, else the rollout's), ref
logprobs (a reference model built from the same HF path, no DDP / optimizer; only when the
batch brings none), then forward+backward of `algorithms.compute_policy_loss` over the
micro-batches through `forward.run_microbatches` (pipeline schedules included), then the
distributed optimizer step (grad clipping inside) and the LR schedule.

Loss scaling: the loss normalisers (valid tokens, sequences) are all-reduced over DP once for
the whole global batch and every micro-batch returns its partial sum of the globally
normalised loss (algorithms/reductions.py), so the summed gradient over micro-batches and DP
ranks is the full-batch gradient whatever the split. Each micro-batch reports 0 tokens to
megatron (`calculate_per_token_loss=True`), so neither the schedule nor
`finalize_model_grads` rescales, and DDP sums over DP.

Logprobs come from vocab-parallel logits (`logprobs.vocab_parallel_logprobs`, logits / T).
Context parallel: the data path splits tokens, labels and routes zig-zag (packing.py), the
attention runs on the split (TE's, or the local / fast spec's cp_attention.py), per-sample
logprobs and the step's metrics are all-reduced over CP (tested at CP=2 on CPU); sequence-level
losses (gspo, seq_tis, mis) under CP are rejected, like every other bad setting, by the config
validator (skyrl_mega/config/validate.py) before the ranks start; this module checks only what
depends on the built model. Virtual pipeline stages are not supported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..algorithms import compute_policy_loss
from . import forward as fwd
from .batch import RLBatch  # noqa: F401  (re-exported: callers import it from here)
from .logprobs import vocab_parallel_logprobs
from .packing import MicroBatchLayout
from .policy import PolicyModel, ReferenceModel
from .step_inputs import (  # plan_step, StepPlan and Parallelism are also imported from here by callers
    LazyMicroBatches, Parallelism, StepPlan, all_reduce, model_inputs, plan_step, rows_of, run_plan,
    scatter_per_sample,
)

# ---------------------------------------------------------------------------- logprobs
def compute_logprobs(model, batch: RLBatch, cfg, plan: Optional[StepPlan] = None, *, replay: Optional[bool] = None,
                     with_entropy: bool = False):
    """Forward-only logprobs of every token (token-aligned [L], index 0 = 0) under `model`
    (PolicyModel or ReferenceModel), logits / algorithm.temperature, vocab-parallel.

    Returns a list per sample on the last pipeline stage (plus a list of entropies when
    with_entropy), None on other stages. `replay`: replay the batch's routes (default: when
    the model has an R3 handle)."""
    handle = model.replay if (replay is None or replay) else None
    if replay and handle is None:
        raise ValueError("replay=True but the model was built without routing replay")
    bridge = model.bridge
    par = Parallelism.current(bridge.config)
    plan = plan or plan_step(batch, cfg, bridge, par, need_routes=handle is not None)
    if handle is not None and plan.routes is None:
        plan = replace(plan, routes=plan_step(batch, cfg, bridge, par, need_routes=True).routes)
    mbs = LazyMicroBatches(plan.layouts, lambda lay: model_inputs(lay, batch, plan, par, bridge, handle is not None))
    temperature = float(cfg.algorithm.temperature)
    vocab = getattr(bridge.hf_config, "vocab_size", None)

    def loss_fn(mb, logits):
        lp, ent = vocab_parallel_logprobs(logits, mb["labels"], temperature, with_entropy=with_entropy,
                                          vocab_size=vocab)
        return lp.detach(), (ent.detach() if ent is not None else None)

    with torch.no_grad():
        out = run_plan(model.models, mbs, loss_fn, True, handle, collect=True)
    if not par.last_stage:
        return None
    lps, ents = [None] * len(batch), [None] * len(batch)
    for mb, (lp, ent) in zip(mbs, out):
        scatter_per_sample(mb["layout"], lp, par, lps)
        if with_entropy:
            scatter_per_sample(mb["layout"], ent, par, ents)
    return (lps, ents) if with_entropy else lps


# ---------------------------------------------------------------------------- loss
SUM_KEYS = ("loss", "pg_loss", "kl_loss", "entropy_loss", "num_tokens", "num_train_tokens",
            "token_sum/pg/clipped", "token_sum/pg/approx_kl", "lp_diff_sum", "nonfinite")
MAX_KEYS = ("lp_diff_max",)


def _loss_inputs(layout: MicroBatchLayout, batch: RLBatch, old: list[Tensor], ref: Optional[list[Tensor]],
                 counts: Tensor) -> dict:
    idx, valid = layout.prediction_index()
    f2l = layout.full_to_local()[idx]
    owned = f2l >= 0
    mask = (rows_of(layout, batch.response_mask) > 0) & valid & owned
    seq_counts = torch.tensor([int(counts[s]) if s >= 0 else 0 for s in layout.samples], dtype=torch.long)
    d = {
        "row_index": f2l.clamp(min=0), "row_mask": mask, "row_old": rows_of(layout, old),
        "row_adv": rows_of(layout, batch.advantages), "seq_counts": seq_counts,
    }
    if batch.rollout_logprobs is not None:
        d["row_rollout"] = rows_of(layout, batch.rollout_logprobs)
    if ref is not None:
        d["row_ref"] = rows_of(layout, ref)
    return d


def _make_loss_fn(cfg, vocab, n_tokens: Tensor, n_seqs: Tensor):
    alg = cfg.algorithm
    temperature = float(alg.temperature)
    entropy_grad = alg.entropy_coef != 0.0

    def loss_fn(mb, logits):
        lp, ent = vocab_parallel_logprobs(logits, mb["labels"], temperature, with_entropy=True,
                                          entropy_grad=entropy_grad, vocab_size=vocab)
        idx, mask = mb["row_index"], mb["row_mask"]
        rows_lp = lp.reshape(-1)[idx]
        rows_ent = ent.reshape(-1)[idx]
        rollout = mb.get("row_rollout")
        loss, sums = compute_policy_loss(
            rows_lp, mb["row_old"], mb["row_adv"], mask,
            policy_loss=alg.policy_loss, policy_loss_kwargs=dict(alg.policy_loss_kwargs or {}),
            reduction=alg.reduction, global_num_tokens=n_tokens, global_num_sequences=n_seqs,
            max_len=alg.max_len_norm, seq_token_counts=mb["seq_counts"],
            off_policy=alg.off_policy, off_policy_kwargs=dict(alg.off_policy_kwargs or {}),
            rollout_logprobs=rollout, ref_logprobs=mb.get("row_ref"), kl_coef=float(alg.kl_coef),
            kl_estimator=alg.kl_estimator, entropy=rows_ent, entropy_coef=float(alg.entropy_coef),
        )
        if rollout is not None:
            diff = torch.where(mask, (rows_lp.detach() - rollout).abs(), torch.zeros_like(rollout))
            sums["lp_diff_sum"] = diff.sum()
            sums["lp_diff_max"] = diff.max() if diff.numel() else diff.new_zeros(())
        sums["nonfinite"] = (~torch.isfinite(loss.detach())).float()
        reported = {k: sums.get(k, torch.zeros((), device=lp.device)).detach().float()
                    for k in SUM_KEYS + MAX_KEYS}
        return loss, torch.zeros((), dtype=torch.int), reported

    return loss_fn


def loss_normalizers(batch: RLBatch, cfg, dp_group) -> tuple[Tensor, Tensor, Tensor]:
    """(N_tokens, N_seqs) of the global batch (all-reduced over DP) and this rank's per-sample
    valid-token counts (response tokens at index >= 1)."""
    counts = torch.tensor([int((m[1:] > 0).sum()) for m in batch.response_mask], dtype=torch.long)
    dev = fwd.device()
    tot = torch.tensor([float(counts.sum()), float((counts > 0).sum())], dtype=torch.float64, device=dev)
    all_reduce(tot, dp_group)
    return tot[0].float(), tot[1].float(), counts


def forward_backward(policy: PolicyModel, batch: RLBatch, cfg, plan: StepPlan,
                     ref_logprobs: Optional[list[Tensor]] = None) -> dict:
    """Zeroes the grad buffers, runs forward+backward of the RL loss over the plan's
    micro-batches; returns this rank's summed metrics (zeros on non-last pipeline stages).
    Gradients are left in the DDP buffers (finalised: DP-reduced, not yet applied)."""
    bridge = policy.bridge
    par = Parallelism.current(bridge.config)
    if batch.old_logprobs is None:
        raise ValueError("forward_backward needs batch.old_logprobs (train_step fills them)")
    n_tokens, n_seqs, counts = loss_normalizers(batch, cfg, par.dp_group)
    handle = policy.replay if cfg.algorithm.routing_replay else None
    if handle is not None and plan.routes is None:
        raise ValueError("R3 is on but the plan has no routes (plan_step(..., need_routes=True))")
    def inputs(lay):
        mb = model_inputs(lay, batch, plan, par, bridge, handle is not None)
        mb.update(_loss_inputs(lay, batch, batch.old_logprobs, ref_logprobs, counts))
        return mb

    mbs = LazyMicroBatches(plan.layouts, inputs)
    for m in policy.models:
        m.zero_grad_buffer()
    policy.optimizer.zero_grad()
    loss_fn = _make_loss_fn(cfg, getattr(bridge.hf_config, "vocab_size", None), n_tokens.to(fwd.device()),
                            n_seqs.to(fwd.device()))
    out = run_plan(policy.models, mbs, loss_fn, False, handle)
    dev = fwd.device()
    sums = torch.zeros(len(SUM_KEYS), dtype=torch.float64, device=dev)
    maxes = torch.zeros(len(MAX_KEYS), dtype=torch.float64, device=dev)
    for rep in out:
        sums += torch.stack([rep[k].to(dev, torch.float64) for k in SUM_KEYS])
        maxes = torch.maximum(maxes, torch.stack([rep[k].to(dev, torch.float64) for k in MAX_KEYS]))
    return {"sums": sums, "maxes": maxes, "n_tokens": n_tokens, "n_seqs": n_seqs}


def _grads_finite(models) -> bool:
    ok = True
    for m in models:
        for buf in list(getattr(m, "buffers", [])) + list(getattr(m, "expert_parallel_buffers", [])):
            ok = ok and bool(torch.isfinite(buf.grad_data).all())
    return ok


def _reduce_metrics(raw: dict, par: Parallelism) -> dict:
    sums, maxes = raw["sums"].clone(), raw["maxes"].clone()
    all_reduce(sums, par.dp_group)
    all_reduce(maxes, par.dp_group, dist.ReduceOp.MAX)
    if par.cp > 1:  # each CP rank's loss covers only the tokens it holds
        all_reduce(sums, par.cp_group)
        all_reduce(maxes, par.cp_group, dist.ReduceOp.MAX)
    if par.pp > 1:  # only the last stage has values; the others add zeros
        all_reduce(sums, par.pp_group)
        all_reduce(maxes, par.pp_group, dist.ReduceOp.MAX)
    s = dict(zip(SUM_KEYS, sums.tolist()))
    m = dict(zip(MAX_KEYS, maxes.tolist()))
    n = max(s["num_tokens"], 1.0)
    return {
        "loss": s["loss"], "pg_loss": s["pg_loss"], "kl": s["kl_loss"], "entropy": s["entropy_loss"],
        "pg_clipfrac": s["token_sum/pg/clipped"] / n, "approx_kl": s["token_sum/pg/approx_kl"] / n,
        "logprob_diff_mean": s["lp_diff_sum"] / n, "logprob_diff_max": m["lp_diff_max"],
        "tokens/response": s["num_tokens"], "tokens/train": s["num_train_tokens"],
    }


@dataclass
class PreparedBatch:
    """A batch ready for updates: its plan, its old logprobs (in batch.old_logprobs) and its
    reference logprobs, all computed with the weights before any update of this rollout batch."""

    batch: RLBatch
    plan: StepPlan
    ref_logprobs: Optional[list[Tensor]]
    timings: dict


def prepare(policy: PolicyModel, batch: RLBatch, cfg, ref: Optional[ReferenceModel] = None) -> PreparedBatch:
    """The plan, old logprobs (recomputed, or the rollout's) and reference logprobs of this DP
    rank's samples (collective over all ranks)."""
    alg = cfg.algorithm
    batch.validate()
    bridge = policy.bridge
    par = Parallelism.current(bridge.config)
    replay = bool(alg.routing_replay)
    if replay and policy.replay is None:
        raise ValueError("algorithm.routing_replay=true but the policy was built without it")
    plan = plan_step(batch, cfg, bridge, par, need_routes=replay or (ref is not None and ref.replay is not None))
    timings = {}

    t = time.perf_counter()
    if alg.old_logprobs == "recompute":
        old = compute_logprobs(policy, batch, cfg, plan, replay=replay)
    else:
        if batch.rollout_logprobs is None:
            raise ValueError("algorithm.old_logprobs=rollout needs batch.rollout_logprobs")
        old = batch.rollout_logprobs
    timings["time/old_logprobs"] = time.perf_counter() - t
    if not par.last_stage:  # only the last stage computes the loss; keep shapes valid elsewhere
        old = old if old is not None else [torch.zeros(n) for n in batch.lengths]
    batch = replace(batch, old_logprobs=old)

    t = time.perf_counter()
    ref_lp = batch.ref_logprobs
    if ref_lp is None and (ref is not None or alg.kl_coef != 0.0):
        if ref is None:
            raise ValueError("algorithm.kl_coef != 0 needs a reference model or batch.ref_logprobs")
        ref_lp = compute_logprobs(ref, batch, cfg, plan, replay=ref.replay is not None)
        if ref_lp is None:
            ref_lp = [torch.zeros(n) for n in batch.lengths]
    timings["time/ref_logprobs"] = time.perf_counter() - t
    return PreparedBatch(batch, plan, ref_lp, timings)


def update(policy: PolicyModel, prepared: PreparedBatch, cfg) -> dict:
    """One optimizer update on a prepared batch (collective): forward + backward of the RL loss,
    the step (skipped, gradients dropped, when the loss or a gradient is not finite), metrics."""
    t0 = time.perf_counter()
    batch, plan, par = prepared.batch, prepared.plan, Parallelism.current(policy.bridge.config)
    timings = {}
    t = time.perf_counter()
    raw = forward_backward(policy, batch, cfg, plan, prepared.ref_logprobs)
    timings["time/forward_backward"] = time.perf_counter() - t

    t = time.perf_counter()
    bad = torch.tensor([float(raw["sums"][SUM_KEYS.index("nonfinite")] > 0 or not _grads_finite(policy.models))],
                       device=fwd.device())
    all_reduce(bad, dist.group.WORLD if dist.is_initialized() else None, dist.ReduceOp.MAX)
    skipped = bool(bad.item() > 0)
    if skipped:
        for m in policy.models:
            m.zero_grad_buffer()
        policy.optimizer.zero_grad()
        grad_norm = float("nan")
    else:
        _, grad_norm, _ = policy.optimizer.step()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
    timings["time/optimizer"] = time.perf_counter() - t

    metrics = _reduce_metrics(raw, par)
    metrics.update(timings)
    replayed, total = plan.r3_counts
    r3 = torch.tensor([float(replayed), float(total), float(sum(batch.lengths)),
                       float(sum(lay.num_tokens for lay in plan.layouts))], dtype=torch.float64, device=fwd.device())
    all_reduce(r3, par.dp_group)
    metrics.update({
        "grad_norm": grad_norm, "skipped": float(skipped),
        "r3/coverage": float(r3[0] / r3[1]) if r3[1] > 0 else 0.0,
        "tokens/total": float(r3[2]), "tokens/padded": float(r3[3]),
        "num_microbatches": float(len(plan.layouts)), "time/update": time.perf_counter() - t0,
    })
    return metrics


def _advance_schedule(policy: PolicyModel, applied: bool) -> float:
    """The LR schedule moves once per rollout batch (optim.lr_warmup_steps and the decay count
    train steps, however many updates a batch gives), unless no update of it was applied;
    returns the learning rate now."""
    if applied:
        policy.scheduler.step(1)
        policy.step += 1
    groups = getattr(policy.optimizer, "param_groups", None)
    return float(groups[0]["lr"]) if groups else float("nan")


def train_step(policy: PolicyModel, batch: RLBatch, cfg, ref: Optional[ReferenceModel] = None) -> dict:
    """One RL update on this DP rank's samples (collective over all ranks). See module docstring."""
    t0 = time.perf_counter()
    prepared = prepare(policy, batch, cfg, ref)
    metrics = update(policy, prepared, cfg)
    metrics["lr"] = _advance_schedule(policy, applied=not metrics["skipped"])
    metrics.update(prepared.timings)
    metrics["time/step"] = time.perf_counter() - t0
    return metrics


# metrics of several updates: summed over them (times, counts) or taken from the last one; the
# rest are means over the updates
SUMMED = ("time/forward_backward", "time/optimizer", "time/update", "skipped", "num_microbatches")


def train_on_batch(policy: PolicyModel, minis: list[RLBatch], cfg, ref: Optional[ReferenceModel] = None) -> dict:
    """Several optimizer updates on one rollout batch (collective): `minis` are this DP rank's
    shares of the batch's mini-batches, in update order. Every mini-batch's old (and reference)
    logprobs are computed first, with the weights that generated the batch, so the PPO ratio of
    a later update measures how far the earlier ones moved the policy; then train.epochs passes
    of one update per mini-batch. The LR schedule moves once for the batch. One mini-batch and
    one epoch is train_step exactly.
    Metrics: means over the updates (loss, clip fraction, approximate KL, ...), sums of times
    and counts, `updates`, and the first and last update's clip fraction and approximate KL."""
    t0 = time.perf_counter()
    prepared = [prepare(policy, m, cfg, ref) for m in minis]
    updates = [update(policy, p, cfg) for _ in range(int(cfg.train.epochs)) for p in prepared]
    metrics = {}
    for k in updates[0]:
        values = [u[k] for u in updates]
        metrics[k] = sum(values) if k in SUMMED else sum(values) / len(values)
    for k in ("pg_clipfrac", "approx_kl"):
        metrics[f"{k}/first_update"], metrics[f"{k}/last_update"] = updates[0][k], updates[-1][k]
    for k in ("time/old_logprobs", "time/ref_logprobs"):
        metrics[k] = sum(p.timings[k] for p in prepared)
    metrics["updates"] = float(len(updates))
    metrics["lr"] = _advance_schedule(policy, applied=metrics["skipped"] < len(updates))
    metrics["time/step"] = time.perf_counter() - t0
    return metrics
