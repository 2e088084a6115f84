"""torchrun worker for the RL train-step tests (packing, vocab-parallel logprobs, R3, update).

Run: torchrun --nproc-per-node N tests/workers/train_step_worker.py OUT_DIR INPUTS model.path=... [overrides]
INPUTS (safetensors, written by the test): ids_i, rollout_i (HF logprobs, token-aligned) and
routes_i (HF top-k experts with the original weights, the engine's L-1 rows) per sample i.
Rank 0 writes to OUT_DIR: logprobs.safetensors (packed / padded per sample), checks.json (max
diffs, R3 counts, gradient checks), metrics.json (the RL update) and final.safetensors (HF export
after the update). Order: logprob checks, gradient checks, R3 checks (router perturbed, then
restored), then one RL update from the original weights.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from skyrl_mega.config import load_config, validate_config
from skyrl_mega.megatron import parallel
from skyrl_mega.megatron import train_step as ts
from skyrl_mega.megatron.policy import build_policy, build_reference
from skyrl_mega.megatron.forward import device, gather_vocab_parallel
from skyrl_mega.megatron.logprobs import reference_logprobs, vocab_parallel_logprobs
from skyrl_mega.megatron.packing import shard_for_dp
from skyrl_mega.megatron.r3_replay import route_positions

# Adam's first step is lr * g / (|g| + eps): for gradients near 0 it amplifies float rounding
# differences between layouts by up to lr / eps, so eps is raised from 1e-8 to keep the
# comparison about the math (1e-3 / 1e-6 = 1e3 instead of 1e5).
BASE = [
    "optim.lr=1e-3", "optim.adam_eps=1e-6", "optim.clip_grad=1.0", "train.packing=true", "train.max_tokens_per_microbatch=48",
    "algorithm.routing_replay=true", "algorithm.use_reference=true", "algorithm.kl_coef=0.05",
    "algorithm.entropy_coef=0.01", "algorithm.old_logprobs=recompute", "algorithm.off_policy=tis",
    "algorithm.temperature=0.9", "+algorithm.policy_loss_kwargs.eps_low=0.1",
]


def load_batch(path):
    t = load_file(path)
    n = len([k for k in t if k.startswith("ids_")])
    ids = [t[f"ids_{i}"] for i in range(n)]
    prompt = [int(t["prompt_lens"][i]) for i in range(n)]
    mask = [torch.cat([torch.zeros(p), torch.ones(x.numel() - p)]) for p, x in zip(prompt, ids)]
    adv = [t["advantages"][i : i + 1] for i in range(n)]
    return ts.RLBatch(ids, mask, adv, rollout_logprobs=[t[f"rollout_{i}"] for i in range(n)],
                      routed_experts=[t[f"routes_{i}"] for i in range(n)])


def gather_samples(local: dict, rank_has: bool):
    """{sample: tensor} from every rank (only ranks with rank_has contribute) -> merged on all."""
    from skyrl_mega.weight_sync.collectives import all_gather_json

    items = all_gather_json({str(k): v.tolist() for k, v in local.items()} if rank_has else {})
    merged = {}
    for d in items:
        for k, v in d.items():
            merged.setdefault(k, torch.tensor(v))
    return merged


def flat_grads(models):
    return torch.cat([b.grad_data.detach().clone().float() for m in models
                      for b in list(m.buffers) + list(m.expert_parallel_buffers)])


def main():
    out_dir, inputs, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    cfg = load_config(None, BASE + overrides)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate_config(cfg, world)
    rank, world = parallel.init_distributed()
    parallel.init_model_parallel(cfg.parallel, seed=cfg.train.seed)
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay

    # reference first, then the policy: R3 handles must not depend on build order
    ref = build_reference(cfg)
    policy = build_policy(cfg, total_steps=4)
    checks = {"global_replay_instances_after_attach": len(
        [r for r in RouterReplay.global_router_replay_instances if r in policy.replay.routers])}

    full = load_batch(inputs)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    mine = shard_for_dp(full.lengths, dp, dp_rank)
    batch = full.select(mine)
    last = mpu.is_pipeline_last_stage()
    writer = last and mpu.get_tensor_model_parallel_rank() == 0
    par = ts.Parallelism.current(policy.bridge.config)

    # 1) logprobs: packed vs padded, and vocab-parallel vs a float64 reference from gathered logits
    out = {}
    for packed in (True, False):
        cfg.train.packing = packed
        lps = ts.compute_logprobs(policy, batch, cfg, replay=False)
        got = {mine[i]: lp for i, lp in enumerate(lps)} if last else {}
        merged = gather_samples(got, writer)
        for k, v in merged.items():
            out[f"{'packed' if packed else 'padded'}_{k}"] = v.float().contiguous()
    cfg.train.packing = True
    plan = ts.plan_step(batch, cfg, policy.bridge, par)
    mbs = [ts.model_inputs(lay, batch, plan, par, policy.bridge, False) for lay in plan.layouts]
    temp = float(cfg.algorithm.temperature)

    def ref_check(mb, logits):
        lp, ent = vocab_parallel_logprobs(logits, mb["labels"], temp, with_entropy=True)
        rlp, rent = reference_logprobs(gather_vocab_parallel(logits), mb["labels"], temp)
        return torch.stack([(lp.double() - rlp).abs().max(), (ent.double() - rent).abs().max()])

    with torch.no_grad():
        diffs = ts.run_plan(policy.models, mbs, ref_check, True, None, collect=True)
    d = torch.stack(diffs).max(0).values if diffs else torch.zeros(2, dtype=torch.float64, device=device())
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    checks["vocab_parallel_vs_float64_logprob"], checks["vocab_parallel_vs_float64_entropy"] = d.tolist()

    # 2) gradients: token_mean through the real step, 1 x 8 vs 4 x 2 micro-batches (+ recompute)
    batch.old_logprobs = batch.rollout_logprobs
    fixed_ref = [x - 0.1 for x in batch.rollout_logprobs]
    grads, plans = {}, {}
    for name, packed, mbsize in (("1x8", True, 8), ("4x2", True, 2), ("pad_4x2", False, 2)):
        cfg.train.packing, cfg.train.micro_batch_size, cfg.train.max_tokens_per_microbatch = packed, mbsize, None
        plans[name] = ts.plan_step(batch, cfg, policy.bridge, par, need_routes=True)
        ts.forward_backward(policy, batch, cfg, plans[name], fixed_ref)
        grads[name] = (flat_grads(policy.models), len(plans[name].layouts))
    cfg.train.packing = True
    mc = policy.bridge.config
    mc.recompute_granularity, mc.recompute_method, mc.recompute_num_layers = "full", "uniform", 1
    with policy.replay.capturing() as cap:
        ts.forward_backward(policy, batch, cfg, plans["4x2"], fixed_ref)
    grads["recompute"] = (flat_grads(policy.models), len(plans["4x2"].layouts))
    checks["recompute_router_calls_per_layer"] = [len(v) for v in cap.values()]
    mc.recompute_granularity, mc.recompute_method, mc.recompute_num_layers = None, None, None
    ref_grad = grads["1x8"][0]
    for name, (g, n) in grads.items():
        diff = (g - ref_grad).abs().max().reshape(1)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        checks[f"grad_diff_{name}"] = diff.item()
        checks[f"num_microbatches_{name}"] = n
    checks["grad_norm_1x8"] = float(ref_grad.norm())
    cfg.train.micro_batch_size, cfg.train.max_tokens_per_microbatch = 1, 48

    # 3) R3: perturb the routers, replay the HF routes (recorded with the original weights)
    routers = [m for m in policy.models[0].modules() if isinstance(m, TopKRouter)]
    saved = [r.weight.detach().clone() for r in routers]
    for r in routers:
        g = torch.Generator().manual_seed(1000 + r.layer_number)
        with torch.no_grad():
            r.weight.add_(torch.randn(r.weight.shape, generator=g).to(r.weight) * 0.5)
    plan = ts.plan_step(batch, cfg, policy.bridge, par, need_routes=True)
    moe_cols = {g: c for c, g in enumerate(policy.bridge.moe_layers)}
    counts = torch.zeros(4, dtype=torch.long)  # checked, replay mismatches, live mismatches, pad rows
    for replay in (True, False):
        with policy.replay.capturing() as cap:
            ts.compute_logprobs(policy, batch, cfg, plan, replay=replay)
        for layer, used_list in cap.items():
            assert len(used_list) == len(plan.layouts), (layer, len(used_list), len(plan.layouts))
            for lay, used in zip(plan.layouts, used_list):
                pos = route_positions(lay, par.tp, par.tp_rank, par.sp)
                assert pos.shape[0] == used.shape[0], (pos.shape, used.shape)
                for row, (seg_k, tok) in enumerate(pos.tolist()):
                    if seg_k < 0:
                        counts[3] += int(replay)
                        assert len(set(used[row].tolist())) == used.shape[1]
                        continue
                    s = lay.segments[seg_k].sample
                    want = plan.routes[s][tok, moe_cols[layer]]
                    if (want < 0).any():
                        continue
                    if replay:
                        counts[0] += 1
                        counts[1] += int(not torch.equal(used[row].cpu(), want))
                    else:
                        counts[2] += int(sorted(used[row].tolist()) != sorted(want.tolist()))
    counts = counts.to(device())
    dist.all_reduce(counts)
    checks["r3_checked"], checks["r3_replay_mismatch"], checks["r3_live_mismatch"], checks["r3_pad_rows"] = counts.tolist()
    # the router still learns under replay
    ts.forward_backward(policy, batch, cfg, plan, fixed_ref)
    gn = torch.tensor([min((r.weight.main_grad.norm().item() for r in routers), default=1.0)], device=device())
    dist.all_reduce(gn, op=dist.ReduceOp.MIN)
    checks["r3_min_router_grad_norm"] = gn.item()
    with torch.no_grad():
        for r, w in zip(routers, saved):
            r.weight.copy_(w)
    for m in policy.models:
        m.zero_grad_buffer()

    # 4) one RL update (packing, R3, reference + KL, recomputed old logprobs, TIS, entropy bonus)
    batch.old_logprobs = None
    metrics = ts.train_step(policy, batch, cfg, ref=ref)
    # 5) a non-finite loss skips the update and leaves the weights alone
    before = [p.detach().clone() for p in policy.models[0].parameters()]
    bad = batch.select(range(len(batch)))
    bad.advantages = [a * float("nan") for a in bad.advantages]
    skipped = ts.train_step(policy, bad, cfg, ref=ref)
    checks["nan_skipped"] = skipped["skipped"]
    checks["nan_weights_changed"] = max((p.detach() - b).abs().max().item()
                                        for p, b in zip(policy.models[0].parameters(), before))
    final = {name: t.detach().cpu().clone().contiguous() for name, t in policy.bridge.export_hf(policy.models)}
    if rank == 0:
        save_file(out, os.path.join(out_dir, "logprobs.safetensors"))
        save_file(final, os.path.join(out_dir, "final.safetensors"))
        with open(os.path.join(out_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f)
        with open(os.path.join(out_dir, "checks.json"), "w") as f:
            json.dump(checks, f)
    print(json.dumps({"rank": rank, "checks": checks, "metrics": metrics}), flush=True)
    parallel.destroy()


if __name__ == "__main__":
    main()
